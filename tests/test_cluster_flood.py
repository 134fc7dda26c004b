"""The CONTINUATION flood contained on a node (issue 40 item 3): the frame guard is off by default
(its cost: docs/security.md, "The CONTINUATION flood"), so a client that can reach the main
daemon's socket (UID 0 on the node) grows grpc core past the pod's memory limit. On the real
cluster the flood is sent from the host to the kubelet's device-plugin directory, as such a
client would, while a workload creates a pod every 0.5 s: the daemon's container is OOM-killed,
the kubelet restarts it and it registers again, the kubelet's gap from the old stream's end to
the new first list (the time it cannot admit a pod) is measured from its log and printed with the
workload pods that failed admission in it, a pod running VMs keeps making them, and our pods
raise no Warning event but the killed pod's probes (the kubelet may probe its port before it is
back). Budget about 50 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from frameguard_server import flood
from support.cluster import NODE, Cluster, Sampler
from support.clusterfixtures import NAMESPACE, Installed
from support.upgrades import HYPERVISOR, VM_WORKER, Churn, gaps, stamp, vm_worker
from support.waits import quiet_blocking

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

MAIN = "hyperlight-device-plugin"
RECOVERY = 60.0  # seconds from the flood to serving again: a guard (about 3 s here)
FLOOD_BYTES = 512 << 20  # more than any limit of ours: the kill, not the budget, ends it


def main_pod(c: Cluster) -> dict[str, Any]:
    (pod,) = [p for p in c.pods(NAMESPACE, f"app.kubernetes.io/name={MAIN}")
              if not p["metadata"].get("deletionTimestamp")]
    return pod


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (status,) = pod["status"]["containerStatuses"]
    return dict(status)


def test_a_continuation_flood_oom_kills_the_main_daemon_and_the_node_serves_again(
        release: Installed) -> None:
    c = release.cluster
    vm_worker(c)
    killed_pod = main_pod(c)["metadata"]["name"]
    before = container(main_pod(c))
    limit = main_pod(c)["spec"]["containers"][0]["resources"]["limits"]["memory"]
    socket = c.run / "kubelet" / "device-plugins" / "hyperlight.sock"
    offset = len(c.log("kubelet"))
    wall = time.time()
    churn = Churn(c)
    workload = threading.Thread(target=churn.run, daemon=True)
    with Sampler(c, f"/api/v1/nodes/{NODE}",
                 lambda n: n["status"].get("allocatable", {}).get(HYPERVISOR)) as sampler:
        workload.start()
        try:
            quiet_blocking(3.0, "the workload's pods before the flood")
            began = time.monotonic()
            sent = asyncio.run(flood(socket, 4, FLOOD_BYTES, seconds=30, reconnect=False))
            flooded = time.monotonic() - began

            def restarted() -> bool:
                now = container(main_pod(c))
                return bool(now.get("restartCount", 0) > before.get("restartCount", 0)
                            and now.get("ready"))

            c.until(restarted, RECOVERY, "the main daemon restarted and Ready")
            ready = time.monotonic() - began
            quiet_blocking(5.0, "the workload's pods after it")
        finally:
            churn.done.set()
            workload.join(30)
    c.kubectl("delete", "pods", "-n", "default", "-l", "app=churn", "--wait=false", check=False)
    after = container(main_pod(c))
    killed = after.get("lastState", {}).get("terminated", {})
    down = [v for _, v in sampler.samples if v != "2k"]
    measured = gaps(c.log("kubelet")[offset:], HYPERVISOR)
    worker_log = c.kubectl("logs", "-n", "default", VM_WORKER).stdout
    worker = container(c.get("pod", VM_WORKER, "-n", "default"))
    c.kubectl("delete", "pod", VM_WORKER, "-n", "default", "--wait=true", "--timeout=60s", timeout=90)
    warnings = [f"{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                for e in c.events(NAMESPACE) if e["type"] == "Warning" and stamp(e) >= wall - 1]
    print(f"flood: {sent.sent / 2**20:.0f} MiB sent on {sent.opened} connections in {flooded:.1f} s, "
          f"{sent.closed} ended by the kill; the main daemon ({limit}) {killed.get('reason')} "
          f"(exit {killed.get('exitCode')}), restarts {before.get('restartCount', 0)} -> "
          f"{after.get('restartCount', 0)}, Ready again {ready:.1f} s after the flood began; the "
          f"kubelet's gap from the stream's end to the new first list (s) "
          f"{[round(g, 2) for g in measured]}; allocatable below 2k in {len(down)} of "
          f"{len(sampler.samples)} samples; workload pods {len(churn.outcomes)}, failed admission "
          f"{len(churn.failed())} {[churn.messages.get(p, '')[:120] for p in churn.failed()][:3]}; "
          f"warnings {warnings}")
    assert killed.get("reason") == "OOMKilled", killed
    assert len(measured) == 1 and measured[0] < RECOVERY, measured
    assert worker.get("restartCount", 0) == 0 and "created a KVM VM" in worker_log, worker_log[-2000:]
    # The kubelet may probe the killed container's port before it is back: its probe's Warning
    # is the kill's, and says so. Any other is not.
    assert not [w for w in warnings if not w.startswith((f"{killed_pod}: Unhealthy: ",
                                                         f"{killed_pod}: BackOff: "))], warnings
