"""The node's own events on the real kubelet, with the chart installed: a kubelet restart and a
drain. Each test leaves the release installed and the node schedulable (the ``release`` fixture).
Budgets are wall time on a busy 2-core machine; the timeouts are guards.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from support.cluster import NODE, Cluster
from support.clusterfixtures import DAEMONSETS, NAMESPACE, Installed, running_workload, workload

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

HYPERVISOR, ACCESS = "hyperlight.dev/hypervisor", "hyperlight.dev/device-access"
REGISTERED = re.compile(r'^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*"Got registration request from device plugin '
                        r'with resource" resourceName="([^"]+)"', re.M)

SERVER = re.compile(r'^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*"Starting device plugin registration server"', re.M)


def seconds(clock: str) -> float:
    """A klog time of day (HH:MM:SS.micro) in seconds."""
    hours, minutes, rest = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def plugin_pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The one pod of each DaemonSet, by DaemonSet name."""
    found = {}
    for name in DAEMONSETS:
        pods = [p for p in cluster.pods(NAMESPACE, f"app.kubernetes.io/name={name}")
                if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, f"{name}: {[p['metadata']['name'] for p in pods]}"
        found[name] = pods[0]
    return found


def restarts(pod: dict[str, Any]) -> int:
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses", []))


def kubelet_log_since(cluster: Cluster, offset: int) -> str:
    return cluster.log("kubelet")[offset:]


def test_a_kubelet_restart_reregisters_both_plugins(release: Installed) -> None:
    """Budget 30 s. The kubelet restarts (its socket is made anew): both plugins register again
    from the same pods, none restarts, and the node's allocatable is whole again."""
    c = release.cluster
    before = plugin_pods(c)
    offset = len(c.log("kubelet"))
    kubelet = c.status()["running"]["kubelet"]
    began = time.monotonic()
    c.restart_kubelet()
    assert c.status()["running"]["kubelet"] != kubelet, "a new kubelet process"

    def registered() -> set[str]:
        return {m.group(2) for m in REGISTERED.finditer(kubelet_log_since(c, offset))}

    c.until(lambda: registered() == {HYPERVISOR, ACCESS}, 60, "both plugins registered again")
    took = time.monotonic() - began
    log = kubelet_log_since(c, offset)
    server = SERVER.search(log)
    assert server, "the kubelet's registration server started"
    gaps = {m.group(2): seconds(m.group(1)) - seconds(server.group(1)) for m in REGISTERED.finditer(log)}
    c.until(lambda: c.allocatable().get(HYPERVISOR) == "2k"
            and c.allocatable().get(ACCESS) == str(ACCESS_SLOTS), 60,
            "allocatable whole again")
    after = plugin_pods(c)
    for name in DAEMONSETS:
        assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"], name
        assert restarts(after[name]) == restarts(before[name]), name
    assert all(0 <= gap < 10 for gap in gaps.values()), gaps  # a guard; the figure is printed
    shown = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in gaps.items())
    print(f"re-registered {took:.2f}s after the restart began (kubelet stop included); after the "
          f"kubelet's registration server started: {shown}")


def test_drain_with_ignore_daemonsets_moves_the_workload_and_keeps_the_plugins(release: Installed) -> None:
    """Budget 45 s. `kubectl drain --ignore-daemonsets` evicts the workload (it waits Pending on
    the cordoned node) and leaves both plugin pods running; after uncordon it runs again."""
    c = release.cluster
    before = plugin_pods(c)
    try:
        c.apply(workload("drained"))
        c.until(lambda: len(running_workload(c, "drained")) == 1, 90, "the workload running")
        (evicted,) = running_workload(c, "drained")
        drain = c.kubectl("drain", NODE, "--ignore-daemonsets", "--timeout=120s", timeout=150)
        assert f"evicting pod default/{evicted['metadata']['name']}" in drain.stdout + drain.stderr
        assert "node/hlnode drained" in drain.stdout, drain.stdout
        assert c.node()["spec"].get("unschedulable") is True
        pending = [p for p in c.pods("default", "app=drained") if not p["metadata"].get("deletionTimestamp")]
        assert all(p["status"].get("phase") == "Pending" for p in pending), pending
        after = plugin_pods(c)
        assert {n: p["metadata"]["uid"] for n, p in after.items()} == \
            {n: p["metadata"]["uid"] for n, p in before.items()}
        assert all(p["status"]["phase"] == "Running" for p in after.values())
        c.kubectl("uncordon", NODE)
        c.until(lambda: len(running_workload(c, "drained")) == 1, 90, "the workload running again")
    finally:
        c.kubectl("uncordon", NODE, check=False)
        c.kubectl("delete", "deployment", "drained", "-n", "default", "--ignore-not-found")
