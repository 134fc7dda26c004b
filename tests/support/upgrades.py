"""What the real cluster's upgrade and migration tests share (tests/test_cluster_upgrade.py for
the device plugin, tests/test_cluster_dra.py for the DRA driver, tests/test_cluster_migrate.py for
a node moved between them): the kubelet's log clock and the lines it logs as a device plugin or a
DRA driver comes and goes, events' times, the pod that makes a VM every 0.5 s, and the workload
that creates a pod asking ``hyperlight.dev/hypervisor: 1`` every 0.5 s throughout."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from support.cluster import NODE, PAUSE_IMAGE, Cluster, Sampler
from support.waits import quiet_blocking

HYPERVISOR = "hyperlight.dev/hypervisor"
ACCESS = "hyperlight.dev/device-access"
KLOG = r"^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d+)\s+\d+ \S+\] "  # a klog line's header; group 1 its clock
# The device manager (the kubelet's verbosity 2): a plugin's stream ended, a plugin's first list.
ENDED = re.compile(KLOG + r'"ListAndWatch ended unexpectedly for device plugin".*resource="([^"]+)"', re.M)
PUSHED = re.compile(KLOG + r'"State pushed for device plugin" resource="([^"]+)"', re.M)
# The DRA plugin manager (its verbosity 3): an instance of a driver taken or let go, with
# ``numPlugins``, the instances of that driver it then keeps.
REGISTRATION = re.compile(KLOG + r'"(Registered|Unregistered) DRA plugin"(.*)$', re.M)
# The kubelet's node-status update (its verbosity 2) that published no device-access: one that
# fell inside the bootstrap's own hand-over gap (or a kubelet start before it registered).
ACCESS_ZERO = re.compile(KLOG + r'"Updated allocatable" device="hyperlight\.dev/device-access" allocatable=0',
                         re.M)
KUBELET_VERBOSITY = 2  # tests/support/cluster.py starts the kubelet with --v 2


def seconds(clock: str) -> float:
    hours, minutes, rest = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def gaps(log: str, resource: str) -> list[float]:
    """For each end of a plugin's stream the kubelet logged, the time to its next first list."""
    ends = [seconds(m.group(1)) for m in ENDED.finditer(log) if m.group(2) == resource]
    pushes = [seconds(m.group(1)) for m in PUSHED.finditer(log) if m.group(2) == resource]
    return [min((p for p in pushes if p >= end), default=float("inf")) - end for end in ends]


def kubelet_verbosity(c: Cluster, level: int) -> str:
    """The kubelet's log verbosity set at run time (its /debug/flags/v, through the API server)."""
    result = c.kubectl("replace", "--raw", f"/api/v1/nodes/{NODE}/proxy/debug/flags/v", "-f", "-",
                       input=str(level), check=False)
    return (result.stdout + result.stderr).strip()


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


def access_restored(cluster: Cluster) -> float:
    """The runbook's check after a rollout, before a rollback or the next upgrade
    (docs/operations.md, Upgrade, step 4): the node's allocatable shows the bootstrap's slots.
    The seconds it took: 0 unless the kubelet's node-status update (every 10 s) fell inside the
    bootstrap's own hand-over gap and published 0, which the next update (up to 10 s later)
    puts back; a surge pod scheduled meanwhile waits with FailedScheduling ("Insufficient
    hyperlight.dev/device-access")."""
    return cluster.until(lambda: cluster.allocatable().get(ACCESS) == str(ACCESS_SLOTS), 30,
                         f"the node's {ACCESS} back to {ACCESS_SLOTS}")


def holds_access(pod: dict[str, Any]) -> bool:
    """The pod counts against the node's ``hyperlight.dev/device-access`` as the scheduler counts:
    bound to the node and not terminal (a Terminating pod counts until the kubelet reports it
    Succeeded or Failed), asking for it in a container."""
    return (pod["spec"].get("nodeName") == NODE
            and pod["status"].get("phase") not in ("Succeeded", "Failed")
            and any(ACCESS in (c.get("resources", {}).get("requests") or {})
                    for c in pod["spec"].get("containers", [])))


def access_holders(cluster: Cluster, namespace: str) -> Sampler:
    """Every 100 ms, the release's pods holding a ``hyperlight.dev/device-access`` in the
    scheduler's count (``holds_access``): (name, Terminating) for each."""
    def holders(listing: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return tuple(sorted((p["metadata"]["name"], bool(p["metadata"].get("deletionTimestamp")))
                            for p in listing["items"] if holds_access(p)))

    return Sampler(cluster, f"/api/v1/namespaces/{namespace}/pods", holders)


def most_holders(sampler: Sampler) -> tuple[int, list[tuple[float, Any]]]:
    """The most holders at once in ``access_holders``' samples, and (seconds since the first
    sample, holders) of each sample with that many."""
    start = sampler.samples[0][0] if sampler.samples else 0.0
    most = max((len(v) for _, v in sampler.samples), default=0)
    return most, [(round(t - start, 1), v) for t, v in sampler.samples if len(v) == most]


VM_WORKER = "vm-worker"


def vm_worker(cluster: Cluster, name: str = VM_WORKER, *, selected: bool = False) -> None:
    """The examples' VM check as a pod that creates a VM every 0.5 s through its slot, as UID
    65534, for the length of the upgrades: a check that fails exits, and the container restarts.
    It asks ``hyperlight.dev/hypervisor: 1`` and is placed by the scheduler, so a driver node
    serves it through the DeviceClass's mapping; ``selected`` adds the runbook's check-pod
    nodeSelector (``kubernetes.io/hostname``: still the scheduler, unlike ``nodeName``)."""
    cluster.kubectl("create", "configmap", "hyperlight-vm-check", "-n", "default",
                    "--from-file=deploy/examples/vm_check.py", check=False)
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"terminationGracePeriodSeconds": 1,
                 **({"nodeSelector": {"kubernetes.io/hostname": NODE}} if selected else {}),
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534},
                 "containers": [{
                     "name": "c", "image": Cluster.chart_image(), "imagePullPolicy": "IfNotPresent",
                     "command": ["python3", "/opt/vm-check/vm_check.py", "--interval", "0.5"],
                     "resources": {"limits": {HYPERVISOR: "1"}},
                     "securityContext": {"allowPrivilegeEscalation": False,
                                         "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "check", "mountPath": "/opt/vm-check", "readOnly": True}]}],
                 "volumes": [{"name": "check", "configMap": {"name": "hyperlight-vm-check"}}]}})

    def running() -> bool:
        return bool(cluster.get("pod", name, "-n", "default")["status"].get("phase") == "Running")

    cluster.until(running, 90, f"the VM worker {name} running")


@dataclass
class Churn:
    """A workload pod created every 0.5 s, each deleted once the kubelet decided on it. For each
    pod decided: its outcome (the status's reason, else its phase), the kubelet's message when it
    failed, which way it was served when it ran ("driver": the scheduler made it a claim; "device
    plugin"), and when (time.monotonic()) the workload saw it decided."""

    cluster: Cluster
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    served: dict[str, str] = field(default_factory=dict)
    decided_at: dict[str, float] = field(default_factory=dict)
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
                name = pod["metadata"]["name"]
                if phase in ("Running", "Failed") and name not in self.outcomes:
                    self.record(pod)
                    decided.append(name)
            if decided:
                self.cluster.kubectl("delete", "pod", "-n", "default", "--wait=false", *decided)
            quiet_blocking(0.5, "the workload's pace: one pod every 0.5 s")

    def record(self, pod: dict[str, Any]) -> None:
        """A pod's outcome as the workload saw it decided (or as it was left at the end)."""
        name, status = pod["metadata"]["name"], pod["status"]
        self.outcomes[name] = status.get("reason") or status.get("phase", "")
        self.decided_at[name] = time.monotonic()
        if status.get("phase") == "Failed":
            self.messages[name] = status.get("message", "")
        elif status.get("phase") == "Running":
            self.served[name] = "driver" if status.get("extendedResourceClaimStatus") else "device plugin"

    def failed(self) -> list[str]:
        return [name for name, outcome in self.outcomes.items() if outcome == "UnexpectedAdmissionError"]
