"""What the real cluster's upgrade tests share (tests/test_cluster_upgrade.py for the device
plugin, tests/test_cluster_dra.py for the DRA driver): the kubelet's log clock, events' times, and
the workload that creates a pod asking ``hyperlight.dev/hypervisor: 1`` every 0.5 s throughout."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from support.cluster import NODE, PAUSE_IMAGE, Cluster, Sampler
from support.waits import quiet_blocking

HYPERVISOR = "hyperlight.dev/hypervisor"
ACCESS = "hyperlight.dev/device-access"
KLOG = r"^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d+)\s+\d+ \S+\] "  # a klog line's header; group 1 its clock


def seconds(clock: str) -> float:
    hours, minutes, rest = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def stamp(event: dict[str, Any]) -> float:
    text = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"]["creationTimestamp"]
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def access_sampler(cluster: Cluster) -> Sampler:
    """The node's allocatable ``hyperlight.dev/device-access`` every 100 ms: a surge pod of ours
    that waits with "Insufficient hyperlight.dev/device-access" is told apart from a drop in the
    bootstrap's slots (its own hand-over) by these samples."""
    return Sampler(cluster, f"/api/v1/nodes/{NODE}",
                   lambda n: n["status"].get("allocatable", {}).get(ACCESS))


def access_drops(sampler: Sampler) -> list[tuple[float, Any]]:
    """(seconds since the first sample, value) of every sample below the bootstrap's slots."""
    start = sampler.samples[0][0] if sampler.samples else 0.0
    return [(round(t - start, 1), v) for t, v in sampler.samples if v != str(ACCESS_SLOTS)]


@dataclass
class Churn:
    """A workload pod created every 0.5 s, each deleted once the kubelet decided on it."""

    cluster: Cluster
    outcomes: dict[str, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    created: int = 0

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            n += 1
            self.cluster.apply({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"churn-{n}", "namespace": "default", "labels": {"app": "churn"}},
                "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                    "name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                    "resources": {"limits": {HYPERVISOR: "1"}}}]}})
            self.created = n
            decided = []
            for pod in self.cluster.pods("default", "app=churn"):
                phase = pod["status"].get("phase", "")
                if phase in ("Running", "Failed") and pod["metadata"]["name"] not in self.outcomes:
                    self.outcomes[pod["metadata"]["name"]] = pod["status"].get("reason") or phase
                    decided.append(pod["metadata"]["name"])
            if decided:
                self.cluster.kubectl("delete", "pod", "-n", "default", "--wait=false", *decided)
            quiet_blocking(0.5, "the workload's pace: one pod every 0.5 s")

    def failed(self) -> list[str]:
        return [name for name, outcome in self.outcomes.items() if outcome == "UnexpectedAdmissionError"]
