"""Our daemons start as on an idle node while workload pods keep every CPU busy (the chart's CPU
requests; docs/operations.md "CPU under load"). On the real cluster's 2-core node, two workload
pods requesting 700m each spin one CPU each; each daemon's pod is deleted and its replacement must
become Ready with no Warning event from our pods (at a 10m request 3 of 4 such starts failed a
startup probe). Budget about 45 s; the timeouts are guards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.cluster import Cluster
from support.clusterfixtures import DAEMONSETS, NAMESPACE, Installed
from support.upgrades import stamp

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

SPINNERS = 2  # one per CPU of the test node
SPINNER_REQUEST = "700m"  # with ours (2 x 100m) and the surge's room, within the node's 2 CPUs


def live_pods(c: Cluster, daemonset: str) -> list[dict[str, Any]]:
    return [p for p in c.pods(NAMESPACE, f"app.kubernetes.io/name={daemonset}")
            if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return any(s.get("ready") for s in pod["status"].get("containerStatuses") or [])


@pytest.fixture
def busy_node(release: Installed) -> Iterator[Cluster]:
    """Every CPU of the node kept busy by workload pods that request most of it."""
    c = release.cluster
    c.apply({"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": "spinner", "namespace": "default"},
             "spec": {"replicas": SPINNERS, "selector": {"matchLabels": {"app": "spinner"}},
                      "template": {"metadata": {"labels": {"app": "spinner"}}, "spec": {
                          "terminationGracePeriodSeconds": 0,
                          "containers": [{"name": "c", "image": Cluster.chart_image(),
                                          "imagePullPolicy": "IfNotPresent",
                                          "command": ["python3", "-c", "while True: pass"],
                                          "resources": {"requests": {"cpu": SPINNER_REQUEST}}}]}}}})
    try:
        c.kubectl("rollout", "status", "deployment/spinner", "-n", "default", "--timeout=120s",
                  timeout=150)
        yield c
    finally:
        c.kubectl("delete", "deployment", "spinner", "-n", "default", "--wait=true",
                  "--timeout=60s", timeout=90, check=False)


def test_the_daemons_start_without_a_probe_warning_while_workloads_keep_every_cpu_busy(
        busy_node: Cluster) -> None:
    c = busy_node
    wall = time.time()
    took = {}
    for name in DAEMONSETS:
        (old,) = live_pods(c, name)
        began = time.monotonic()
        c.kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=false")

        def replaced_and_ready(name: str = name, old_name: str = old["metadata"]["name"]) -> bool:
            pods = [p for p in live_pods(c, name) if p["metadata"]["name"] != old_name]
            return len(pods) == 1 and ready(pods[0])

        c.until(replaced_and_ready, 120, f"a new {name} pod Ready on the busy node")
        took[name] = round(time.monotonic() - began, 1)
    warnings = [f"{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                for e in c.events(NAMESPACE) if e["type"] == "Warning" and stamp(e) >= wall - 1]
    print(f"busy node: deletion to Ready (s) {took}; warnings {len(warnings)}")
    assert not warnings, "\n".join(warnings)
