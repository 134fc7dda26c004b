"""A check per Allocate: every Allocate is answered from a device check that began after it
arrived (concurrent ones share it), a failure withdraws the slots at once, and a fault inotify
cannot see (/dev/null bind-mounted over the node) is refused by the very next Allocate."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from harness import GUARD, HAVE_KVM, IS_ROOT, mknod_char, wait_until
from support.waits import quiet

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import new_server
from hlplugin.health import DeviceMonitor
from hlplugin.metrics import Metrics
from hlplugin.plugin import HypervisorPlugin, slots
from hlplugin.probe import ProbeError
from hlplugin.settings import HealthSettings

NOT_KVM = ProbeError("KVM_GET_API_VERSION on /dev/kvm failed: [Errno 25]", step="KVM_GET_API_VERSION",
                     reason="api_version")


def monitor(**probes: object) -> DeviceMonitor:
    return DeviceMonitor(HealthTracker(("device", "host_identity")), "kvm",
                         HealthSettings(dev_dir=Path("/nonexistent-dev"), host_dev_dir=None),
                         metrics=Metrics().proofs, **probes)  # type: ignore[arg-type]


async def test_each_allocate_is_answered_by_a_check_that_began_after_it_and_callers_share_it() -> None:
    """Callers that arrive while a check runs neither take its answer (a failure included) nor
    start their own: they share the next one. A caller that gives up stops nothing."""
    started, release, calls = threading.Event(), threading.Event(), []

    def light() -> None:  # the first check blocks, then fails; later ones pass
        calls.append(len(calls))
        if len(calls) == 1:
            started.set()
            release.wait(GUARD)
            raise NOT_KVM

    mon = monitor(device_probe=lambda: None, allocate_probe=light)
    assert (await mon.check()).healthy
    first = asyncio.create_task(mon.for_allocate())
    await wait_until(started.is_set)
    later = [asyncio.create_task(mon.for_allocate()) for _ in range(10)]
    await quiet(0.05, "a bounded watch: they are waiting, none has its answer yet")
    assert not any(t.done() for t in later)
    later[0].cancel()
    release.set()
    refused = await first
    assert refused.reasons == {"device": str(NOT_KVM)}
    answers = await asyncio.gather(*later[1:])
    assert all(a.healthy for a in answers), [a.describe() for a in answers]
    assert len(calls) == 2  # one check for the ten, begun after they arrived
    assert later[0].cancelled()
    # Done checks are not reused either: the next caller gets a check of its own.
    assert (await mon.for_allocate()).healthy
    assert len(calls) == 3


async def test_a_failed_check_withdraws_at_once_and_only_the_full_check_restores() -> None:
    """The Allocate check records a failure at once; passing after a failure (its own or the
    guest's), it runs the full check, whose answer it gives."""
    light_error: list[Exception] = []
    full_error: list[Exception] = []
    full_calls = []

    def light() -> None:
        if light_error:
            raise light_error[0]

    def full() -> None:
        full_calls.append(1)
        if full_error:
            raise full_error[0]

    mon = monitor(device_probe=full, allocate_probe=light)
    await mon.check()
    assert len(full_calls) == 1
    assert (await mon.for_allocate()).healthy
    assert len(full_calls) == 1  # healthy: the upstream check alone

    light_error.append(NOT_KVM)
    answer = await mon.for_allocate()
    assert answer.reasons == {"device": str(NOT_KVM)}
    assert mon.tracker.state.reasons == {"device": str(NOT_KVM)}  # every stream: Unhealthy now
    light_error.clear()
    assert (await mon.for_allocate()).healthy
    assert len(full_calls) == 2  # the guest ran before the device came back
    assert mon.tracker.state.healthy

    guest = ProbeError("guest on /dev/kvm: expected exit HLT, got SHUTDOWN", step="guest exit",
                       reason="guest")
    full_error.append(guest)
    await mon.check()  # the periodic check finds the guest failing
    answer = await mon.for_allocate()  # the upstream check passes, the guest still fails
    assert answer.reasons == {"device": str(guest)}
    assert len(full_calls) == 4


# --- /dev/null bind-mounted over the node, in a private mount namespace ---------------------------

MS_BIND = 4096
ROUNDS = 8
BURST = 16


async def child(root: Path) -> dict[str, list[object]]:
    """In the private mount namespace: a monitor running as in the daemon (periodic checks every
    second, inotify watches) and the plugin over gRPC; each round: granted, then /dev/null
    bind-mounted over the node and the next Allocate (and a burst) refused, then unmounted and
    the first Allocate granted."""
    libc = ctypes.CDLL(None, use_errno=True)
    dev, host = root / "dev", root / "host-dev"
    node = bytes(dev / "kvm")
    tracker = HealthTracker(("device", "host_identity"))
    mon = DeviceMonitor(tracker, "kvm", HealthSettings(dev, host, interval=1.0, probe_timeout=GUARD))
    await mon.check()
    plugin = HypervisorPlugin("kvm", slots("kvm", 4), tracker, mon.for_allocate)
    server = new_server(plugin)
    server.add_insecure_port(f"unix://{root / 'p.sock'}")
    await server.start()
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])
    rounds: dict[str, list[object]] = {"before": [], "mounted": [], "burst": [], "after": []}

    async def allocate() -> str:
        try:
            await stub.Allocate(request, timeout=GUARD)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return "granted"

    running = asyncio.create_task(mon.run())
    try:
        async with grpc.aio.insecure_channel(f"unix://{root / 'p.sock'}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            for _ in range(ROUNDS):
                rounds["before"].append(await allocate())
                if libc.mount(b"/dev/null", node, None, MS_BIND, None) != 0:
                    raise OSError(ctypes.get_errno(), "mount --bind /dev/null")
                try:
                    rounds["mounted"].append(await allocate())
                    rounds["burst"].append(sorted(set(await asyncio.gather(
                        *(allocate() for _ in range(BURST))))))
                finally:
                    if libc.umount2(node, 0) != 0:
                        raise OSError(ctypes.get_errno(), "umount")
                rounds["after"].append(await allocate())
    finally:
        running.cancel()
        await server.stop(None)
    return rounds


@pytest.mark.skipif(not (IS_ROOT and HAVE_KVM and shutil.which("unshare")),
                    reason="needs root, a usable /dev/kvm and unshare(1) (a private mount namespace)")
def test_dev_null_bind_mounted_over_the_node_refuses_the_next_allocate_every_time(tmp_path: Path) -> None:
    """The fault of issue 21: a bind mount inotify cannot see, right after a good check. The real
    /dev/kvm is never touched: a private node (10:232) in a temporary dir, in a private mount
    namespace that ends with the child."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount fails here (no CAP_SYS_ADMIN?): no private mount namespace")
    for d in ("dev", "host-dev"):
        (tmp_path / d).mkdir()
        mknod_char(tmp_path / d / "kvm", os.stat("/dev/kvm").st_rdev)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, __file__, str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = json.loads(result.stdout)
    assert rounds["before"] == ["granted"] * ROUNDS
    assert rounds["after"] == ["granted"] * ROUNDS  # the first Allocate after the unmount
    for refusal in rounds["mounted"]:  # the first Allocate after the mount
        assert isinstance(refusal, str) and refusal.startswith("FAILED_PRECONDITION: "), refusal
        assert "KVM_GET_API_VERSION" in refusal and "is 1:3" in refusal, refusal
    for burst in rounds["burst"]:
        assert all(str(r).startswith("FAILED_PRECONDITION") for r in burst), burst  # type: ignore[union-attr]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(child(Path(sys.argv[1])))))
