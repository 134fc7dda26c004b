"""Upgrades that fail no pod (issue 29 item 1), on the real cluster: rollouts of a new image tag
and rollbacks, with the node's allocatable sampled every 100 ms and a workload pod created every
0.5 s. The hand-over's gap is measured in every rollout from the kubelet's own log and printed;
the test holds it to GAP_GUARD (a guard: before the hand-over it was 1.4-20.7 s), while the aim
(under 100 ms, the least this kubelet allows) is reported beside it, since a timed assertion on a
shared 2-core machine measures the machine (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
from support.cluster import Cluster, Sampler
from support.clusterfixtures import DAEMONSETS, NAMESPACE, RELEASE, Installed
from support.upgrades import (
    ACCESS_ZERO,
    HYPERVISOR,
    VM_WORKER,
    Churn,
    access_drops,
    access_holders,
    access_restored,
    access_sampler,
    gaps,
    most_holders,
    stamp,
    vm_worker,
)

ROUNDS = int(os.environ.get("HLPLUGIN_UPGRADE_ROUNDS", "10"))

pytestmark = [
    pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300 + ROUNDS * 120),
]
GAP_GUARD = 1.0  # seconds: a hand-over that took longer did not happen as designed
GAP_AIM = 0.100


def rolled_out(cluster: Cluster, restored: list[float]) -> int:
    """Wait as the runbook has an operator wait (docs/operations.md, Upgrade, steps 3 and 4): both
    rollouts, then the node's device-access allocatable back to the bootstrap's slots (the
    seconds that took, appended to ``restored``); how many main pods are still terminating then
    (Succeeded, not yet deleted: the scheduler no longer counts them)."""
    for name in DAEMONSETS:
        cluster.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{name}", "--timeout=180s",
                        timeout=200)
    restored.append(access_restored(cluster))
    return sum(bool(p["metadata"].get("deletionTimestamp")) for p in cluster.pods(NAMESPACE)
               if p["metadata"]["name"].startswith(f"{DAEMONSETS[1]}-"))


def test_upgrade_fails_no_pod(release: Installed) -> None:
    """Budget about 40 s a round (a rollout and a rollback of both DaemonSets). In each of
    ROUNDS rounds: upgrade to a new image tag (the same image retagged in containerd), then
    `helm rollback`. No plugin pod fails admission, our pods raise no Warning event, the node's
    allocatable never drops below 2k in any 100 ms sample, and the hand-over gap (the kubelet's
    log: the old stream's end to the new instance's first list) is measured every time."""
    rollouts(release, lambda c, i: c.upgrade(tag=f"0.1.0-round{i}"), ROUNDS)


@pytest.mark.parametrize(("key", "value"), [
    ("plugin.resources.limits.cpu", "900m"),  # the main DaemonSet only
    ("config.logLevel", "debug"),             # both DaemonSets
])
def test_a_value_upgrade_fails_no_pod(release: Installed, key: str, value: str) -> None:
    """Budget about 40 s a round, 2 rounds: test_upgrade_fails_no_pod's guarantees when the
    upgrade changes a value of one DaemonSet, or of both."""
    rollouts(release, lambda c, i: c.upgrade(values={key: value}), 2)


def rollouts(release: Installed, upgrade: Callable[[Cluster, int], object], rounds: int) -> None:
    """``rounds`` times ``upgrade`` then `helm rollback`, with issue 29 item 1's guarantees
    asserted from events, node status sampled every 100 ms and the kubelet's log."""
    c = release.cluster
    vm_worker(c)
    offset = len(c.log("kubelet"))
    wall = time.time()
    churn = Churn(c)
    terminating: list[int] = []  # main pods still terminating when each rollout was done
    restored: list[float] = []  # the seconds until the node's device-access was back, each rollout
    worker = threading.Thread(target=churn.run, daemon=True)
    with Sampler(c, "/api/v1/nodes/hlnode", lambda n: n["status"].get("allocatable", {}).get(HYPERVISOR)) \
            as sampler, access_sampler(c) as access, access_holders(c, NAMESPACE) as holders:
        worker.start()
        try:
            for i in range(rounds):
                upgrade(c, i)
                terminating.append(rolled_out(c, restored))
                c.helm("rollback", RELEASE, "-n", NAMESPACE)
                terminating.append(rolled_out(c, restored))
        finally:
            churn.done.set()
            worker.join(30)
    c.kubectl("delete", "pods", "-n", "default", "-l", "app=churn", "--wait=false", check=False)
    worker_pod = c.get("pod", VM_WORKER, "-n", "default")
    worker_log = c.kubectl("logs", "-n", "default", VM_WORKER).stdout
    vms = worker_log.count("created a KVM VM")
    vm_restarts = worker_pod["status"]["containerStatuses"][0].get("restartCount", 0)
    # Gone before the next test makes its own under the same name (applied to a terminating
    # pod, it vanished under that test: "pods \"vm-worker\" not found").
    c.kubectl("delete", "pod", VM_WORKER, "-n", "default", "--wait=true", "--timeout=60s", timeout=90)
    log = c.log("kubelet")[offset:]
    measured = gaps(log, HYPERVISOR)
    events = [e for e in c.events(NAMESPACE) if stamp(e) >= wall - 1]
    warnings = [f"{e['involvedObject']['kind']}/{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                for e in events if e["type"] == "Warning"]
    failed_pods = [p["metadata"]["name"] for p in c.pods(NAMESPACE)
                   if p["status"].get("reason") == "UnexpectedAdmissionError"]
    drops = [(round(t - sampler.samples[0][0], 1), v) for t, v in sampler.samples if v != "2k"]
    over_aim = [g for g in measured if g >= GAP_AIM]
    print(f"upgrade: {rounds} rounds; hand-over gaps (ms) "
          f"{[round(g * 1000, 1) for g in measured]}; allocatable samples {len(sampler.samples)}, "
          f"below 2k {len(drops)} (first {drops[:3]}); warnings {len(warnings)}; workload pods "
          f"{len(churn.outcomes)}, failed admission {len(churn.failed())}; VMs created by the running "
          f"worker {vms}, its restarts {vm_restarts}; gaps over the {GAP_AIM * 1000:.0f} ms aim "
          f"{len(over_aim)} of {len(measured)}; main pods still terminating at each rollout's end "
          f"{terminating}; device-access allocatable below its slots in {len(access_drops(access))} of "
          f"{len(access.samples)} samples (first {access_drops(access)[:3]}); its holders at once (the "
          f"scheduler's count) at most {most_holders(holders)[0]} of {len(holders.samples)} samples; "
          f"seconds until it was back after each rollout {[round(r, 1) for r in restored]}; node-status "
          f"updates that published it 0 {[m.group(1) for m in ACCESS_ZERO.finditer(log)]}")
    assert vm_restarts == 0 and vms > 0, f"the running workload lost its device: {worker_log[-2000:]}"
    assert not failed_pods and not [w for w in warnings if "FailedDaemonPod" in w], warnings
    # A readiness probe that met a terminating pod's port closed: a pod stopped before its second
    # probe once closed at once (probeclearance.py now waits on one kubelet probe too); none allowed.
    late = [w for w in warnings if "Readiness probe failed" in w and "connection refused" in w]
    print(f"readiness probes that met a closed port: {len(late)} in {4 * rounds} terminations")
    assert not warnings, "\n".join(warnings[:20])
    assert not drops, drops[:20]
    assert not sampler.errors, sampler.errors[:5]
    assert len(measured) >= rounds * 2, f"a stream end in every rollout of the main plugin: {measured}"
    assert max(measured) < GAP_GUARD, measured
