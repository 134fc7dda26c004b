"""Destructive tests on the real cluster, run after every other test (marker ``cluster_last``):
a node reboot, uninstall and reinstall. Each puts the release back installed (``release``).
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from support.cluster import Cluster, Sampler
from support.clusterfixtures import DAEMONSETS, NAMESPACE, RELEASE, Installed, running_workload, workload

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS

pytestmark = [pytest.mark.cluster, pytest.mark.cluster_last, pytest.mark.slow, pytest.mark.timeout(600)]

HYPERVISOR, ACCESS = "hyperlight.dev/hypervisor", "hyperlight.dev/device-access"
NODE_PATH = "/api/v1/nodes/hlnode"
# Allocatable comes back after two node-status updates (device-access published, so the main pod
# can be scheduled; then hypervisor), each 0-10 s after its registration depending on the update's
# phase: 21.5-21.6 s here on a quiet machine, 27.9 s once under load (the 20.7-21.3 s and
# its 25 s target). The guard allows both phases at their worst and a busy machine.
GUARD = 35.0


def allocatable(node: dict[str, Any]) -> str | None:
    value: str | None = node["status"].get("allocatable", {}).get(HYPERVISOR)
    return value


def stamp(event: dict[str, Any]) -> float:
    """When an event last happened, in epoch seconds."""
    text = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"]["creationTimestamp"]
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


REGISTERED = '"Got registration request from device plugin with resource" resourceName="{}"'
PUBLISHED = '"Updated capacity for device plugin" plugin="{}"'
# Each step of a reboot, as the kubelet logs it: (name, text, the step it follows).
MILESTONES = [
    ("kubelet serves registrations", '"Starting device plugin registration server"', None),
    ("main pod failed admission", "UnexpectedAdmissionError", None),
    ("device-access registered", REGISTERED.format(ACCESS), None),
    ("device-access published", PUBLISHED.format(ACCESS), "device-access registered"),
    ("hypervisor registered", REGISTERED.format(HYPERVISOR), None),
    ("hypervisor published", PUBLISHED.format(HYPERVISOR), "hypervisor registered"),
]


def timeline(log: str, wall: float) -> str:
    """When the kubelet's log first shows each step after a reboot began at ``wall`` (epoch)."""
    midnight = datetime.fromtimestamp(wall, UTC).replace(hour=0, minute=0, second=0,
                                                                 microsecond=0).timestamp()
    lines = log.splitlines()
    found: dict[str, int] = {}
    shown = []
    for name, needle, after in MILESTONES:
        start = found.get(after, -1) + 1 if after else 0
        index = next((i for i in range(start, len(lines)) if needle in lines[i]), None)
        if index is None:
            continue
        found[name] = index
        hours, minutes, rest = lines[index].split()[1].split(":")
        at = midnight + int(hours) * 3600 + int(minutes) * 60 + float(rest) - wall
        shown.append(f"{name} +{at:.1f}s")
    return ", ".join(shown)


def denials_after_healthy(log: str, daemonset: str, resource: str) -> tuple[int, list[str]]:
    """How many of ``daemonset``'s pods the kubelet denied admission in ``log``, and those it
    denied after it first processed a healthy device of ``resource`` (its own log line, so the
    order is the kubelet's, whatever the machine's load)."""
    healthy = re.compile(rf'"Processed device updates for resource" resourceName="{re.escape(resource)}"'
                         r".* healthyCount=[1-9]")
    denied, seen_healthy = 0, False
    late: list[str] = []
    for line in log.splitlines():
        if healthy.search(line):
            seen_healthy = True
        elif '"Pod admission denied"' in line and f'pod="{NAMESPACE}/{daemonset}-' in line:
            denied += 1
            if seen_healthy:
                late.append(line)
    return denied, late


def admission_failures(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(namespace) if p["status"].get("reason") == "UnexpectedAdmissionError"]


def test_a_node_reboot_fails_the_main_pod_once_and_allocatable_comes_back(
        release: Installed) -> None:
    """Budget 45 s. A reboot: every container killed, containerd's state (/run, a tmpfs) wiped,
    the disk kept, the kubelet started with its checkpoint. It re-admits its pods before any
    plugin registered, so the main plugin's pod fails admission (it needs device-access), and so
    does the workload's (left Failed by its ReplicaSet). How many main pods fail is the DaemonSet
    controller's race with the bootstrap's start (one per back-off step: 1 in most runs, 3 on a
    loaded machine); what is ours is that none fails once the kubelet holds device-access healthy
    (``denials_after_healthy``). The CDI spec is rewritten, and
    the node's allocatable, sampled every 100 ms, is 2k again (GUARD says within what: the
    kubelet's node-status updates decide, and the figure is printed with the kubelet's steps)."""
    c = release.cluster
    cdi = c.run / "run-cdi" / "hyperlight.json"
    try:
        c.apply(workload("rebooted"))
        c.until(lambda: len(running_workload(c, "rebooted")) == 1, 90, "the workload running")
        (old_workload,) = running_workload(c, "rebooted")
        old_container = old_workload["status"]["containerStatuses"][0]["containerID"]
        assert cdi.exists()
        with Sampler(c, NODE_PATH, allocatable) as sampler:
            began, wall = time.monotonic(), time.time()
            offset = len(c.log("kubelet"))
            c.reboot()
            rebooted = time.monotonic() - began
            c.until(lambda: any(t > began and v != "2k" for t, v in sampler.samples)
                    and sampler.samples[-1][1] == "2k", 60, "allocatable dropped and back at 2k")
            for name in DAEMONSETS:
                c.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{name}", "--timeout=120s",
                          timeout=150)
        samples = [(t - began, v) for t, v in sampler.samples if t > began]
        last_short = max(t for t, v in samples if v != "2k")
        back = min(t for t, v in samples if t > last_short)
        since = [e for e in c.events(NAMESPACE) if e["reason"] == "FailedDaemonPod" and stamp(e) >= wall - 1]
        failed = {name: sum(e.get("count", 1) for e in since if e["involvedObject"]["name"] == name)
                  for name in DAEMONSETS}
        steps = timeline(c.log("kubelet")[offset:], wall)
        print(f"reboot: took {rebooted:.1f}s; allocatable back at {back:.1f}s; failed daemon pods "
              f"{failed}; sampler errors {len(sampler.errors)}; kubelet: {steps}")
        assert back < GUARD, f"{back:.1f}s: {steps}"
        # As today (issue 29): the main pod fails admission, the bootstrap's never, in the words
        # the emulator gives (tests/test_emulator.py's reboot test), and never once device-access
        # is healthy in the kubelet.
        assert failed[DAEMONSETS[0]] == 0 and failed[DAEMONSETS[1]] >= 1, failed
        denied, late = denials_after_healthy(c.log("kubelet")[offset:], DAEMONSETS[1], ACCESS)
        print(f"reboot: main pods denied admission {denied}, after device-access was healthy {late}")
        assert denied >= 1 and late == [], late
        refused = {e["message"] for e in c.events(NAMESPACE) if e["reason"] == "UnexpectedAdmissionError"
                   and stamp(e) >= wall - 1}
        assert refused == {"Allocate failed due to no healthy devices present; cannot allocate unhealthy "
                           f"devices {ACCESS}, which is unexpected"}, refused
        assert cdi.exists(), "the main plugin rewrote the CDI spec /run lost"
        c.until(lambda: len(running_workload(c, "rebooted")) == 1, 90, "a workload replacement running")
        (new_workload,) = running_workload(c, "rebooted")
        assert new_workload["status"]["containerStatuses"][0]["containerID"] != old_container
        left = [p for p in admission_failures(c, "default") if p["metadata"]["name"].startswith("rebooted")]
        print(f"reboot: workload pods left Failed by UnexpectedAdmissionError: {len(left)}")
    finally:
        c.kubectl("delete", "deployment", "rebooted", "-n", "default", "--ignore-not-found")
        c.kubectl("delete", "pods", "-n", "default", "--field-selector=status.phase=Failed", check=False)


def test_uninstall_keeps_capacity_for_the_grace_period_and_a_reinstall_serves_again(
        release: Installed) -> None:
    """Budget 60 s. `helm uninstall` removes both DaemonSets' pods; the kubelet marks both
    resources unhealthy at once (allocatable 0 at the next node-status update) and keeps their
    capacity for its grace period; the CDI spec stays. The README's install then serves again."""
    c = release.cluster
    cdi = c.run / "run-cdi" / "hyperlight.json"
    c.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=120s", timeout=150)
    c.until(lambda: not [p for p in c.pods(NAMESPACE) if p["metadata"]["name"].startswith(DAEMONSETS)],
            90, "the plugin pods gone")
    c.until(lambda: c.allocatable().get(HYPERVISOR) == "0" and c.allocatable().get(ACCESS) == "0", 40,
            "both resources unhealthy: allocatable 0")
    assert c.capacity().get(HYPERVISOR) == "2k" and c.capacity().get(ACCESS) == str(ACCESS_SLOTS)
    assert cdi.exists(), "the CDI spec stays after uninstall (docs say so)"
    assert not c.kubectl("get", "validatingadmissionpolicy", "-o", "name").stdout.strip()
    release.install()
    c.until(lambda: c.allocatable().get(HYPERVISOR) == "2k"
            and c.allocatable().get(ACCESS) == str(ACCESS_SLOTS), 40, "allocatable back after the reinstall")
    result = c.helm("test", RELEASE, "-n", NAMESPACE, timeout=180)
    assert "Phase:          Succeeded" in result.stdout
