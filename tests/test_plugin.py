"""The DevicePlugin servers in-process over a real unix socket, with an injected health state."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from harness import STALLING_CLIENT, healthy_tracker, wait_until
from support.observers import Calls
from support.waits import quiet

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.bootstrap import DeviceAccessPlugin
from hlplugin.detect import detect_hypervisor, wait_for_hypervisor
from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import new_server
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import (
    MAX_CONTAINERS,
    MAX_ID_BYTES,
    MAX_STREAMS,
    TrackedDevicePlugin,
)
from hlplugin.metrics import Metrics
from hlplugin.plugin import HypervisorPlugin, slots
from hlplugin.settings import HealthSettings

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@asynccontextmanager
async def served(plugin: TrackedDevicePlugin
                 ) -> AsyncIterator[tuple[pb_grpc.DevicePluginStub, Path]]:
    """``plugin`` served as the lifecycle serves it, on a real unix socket: a stub and the path."""
    with tempfile.TemporaryDirectory(prefix="hlp-") as directory:
        path = Path(directory) / "p.sock"
        server = new_server(plugin)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            try:
                yield pb_grpc.DevicePluginStub(channel), path
            finally:
                plugin.close_streams()
                await server.stop(grace=1)


def make_plugin(tracker: HealthTracker, count: int = 4, hypervisor: str = "kvm") -> HypervisorPlugin:
    async def gate() -> HealthState:
        return tracker.state

    return HypervisorPlugin(hypervisor, slots(hypervisor, count), tracker, gate, metrics=Metrics().plugin)


def allocate_request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])


async def refused_with(stub: pb_grpc.DevicePluginStub, request: pb.AllocateRequest,
                       code: grpc.StatusCode = INVALID) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Allocate(request, timeout=10)
    assert refused.value.code() == code, refused.value.details()
    details = refused.value.details() or ""
    assert len(details) < 300, details[:300]
    return details


async def test_the_first_list_waits_for_the_first_checks_with_the_stream_counted() -> None:
    """A plugin served before its first checks are done (the main daemon registers while they
    run) holds every stream's first list until they are, so the kubelet's first list is what
    they found; meanwhile the stream counts as open (the lifecycle would re-register a plugin
    the kubelet opened no stream to)."""
    tracker = HealthTracker(required=("device",))
    first: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def gate() -> HealthState:
        return tracker.state

    metrics = Metrics()
    plugin = HypervisorPlugin("kvm", slots("kvm", 2), tracker, gate, metrics=metrics.plugin,
                              first=first)

    def advertised() -> float | None:  # what the daemon exports of the latest list sent
        return metrics.registry.get_sample_value(f"{metrics.daemon.prefix}_devices_advertised")

    async with served(plugin) as (stub, _):
        stream = stub.ListAndWatch(pb.Empty())
        reading = asyncio.create_task(stream.read())
        await wait_until(lambda: plugin.open_streams == 1, what="the stream open")
        assert advertised() == 0 and not reading.done()
        tracker.set_condition("device", True)  # what the first check found
        first.set_result(None)
        response = await asyncio.wait_for(reading, 10)
        assert {d.health for d in response.devices} == {"Healthy"} and advertised() == 2
        stream.cancel()


async def test_options_streams_and_the_allocate_gate_follow_every_transition() -> None:
    """Every stream gets every transition and ends cleanly; the gate refuses with the reason
    while unhealthy; an unknown ID is the request's fault, healthy or not: INVALID_ARGUMENT."""
    tracker = healthy_tracker()
    plugin = make_plugin(tracker, count=3)
    async with served(plugin) as (stub, _):
        options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert not options.pre_start_required
        assert not options.get_preferred_allocation_available
        assert await stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=["kvm-0"]), timeout=5) == \
            pb.PreStartContainerResponse()
        assert await stub.GetPreferredAllocation(pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=["kvm-0", "kvm-1"], allocation_size=1)]),
            timeout=5) == pb.PreferredAllocationResponse()

        streams = [stub.ListAndWatch(pb.Empty()) for _ in range(5)]
        seen: list[list[str]] = [[] for _ in streams]

        async def drain(i: int, call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:  # type: ignore[type-arg]
            async for response in call:
                assert len(response.devices) == 3
                seen[i].append({d.health for d in response.devices}.pop())
            return await call.code()

        readers = [asyncio.create_task(drain(i, c)) for i, c in enumerate(streams)]
        await wait_until(lambda: all(seen) and plugin.open_streams == 5)
        request = allocate_request(["kvm-0"])
        for n, ok in enumerate((True, False, True, False, True)):
            if n:  # the first is the state it starts in
                tracker.set_condition("device", ok, "KVM_CREATE_VM on /dev/kvm failed: [Errno 25]")
                want = "Healthy" if ok else "Unhealthy"
                await wait_until(lambda w=want: all(s[-1] == w for s in seen))  # type: ignore[misc]
            if ok:
                answer = await stub.Allocate(request, timeout=5)
                assert [d.name for d in answer.container_responses[0].cdi_devices] == [
                    "hyperlight.dev/hypervisor=kvm"]
                assert not answer.container_responses[0].annotations  # only with --cdi-annotations
            else:
                details = await refused_with(stub, request, grpc.StatusCode.FAILED_PRECONDITION)
                assert "KVM_CREATE_VM" in details and "device" in details
            await refused_with(stub, allocate_request(["kvm-4"]))
        plugin.close_streams()
        codes = await asyncio.gather(*readers)
        assert codes == [grpc.StatusCode.OK] * 5
        for history in seen:
            assert history == ["Healthy", "Unhealthy", "Healthy", "Unhealthy", "Healthy"]
        assert plugin.open_streams == 0


def test_auto_prefers_mshv_over_kvm(tmp_path: Path) -> None:
    assert detect_hypervisor(HealthSettings(dev_dir=tmp_path)) is None
    (tmp_path / "kvm").touch()
    assert detect_hypervisor(HealthSettings(dev_dir=tmp_path)) == "kvm"
    (tmp_path / "mshv").touch()
    assert detect_hypervisor(HealthSettings(dev_dir=tmp_path)) == "mshv"
    assert detect_hypervisor(HealthSettings(dev_dir=tmp_path, hypervisor="kvm")) == "kvm"


async def test_auto_never_follows_a_symlink_at_either_name_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Detection is by lstat (upstream): a symlink at /dev/mshv or /dev/kvm is passed over,
    whatever it points at, and the wait's warning names it."""
    (tmp_path / "mshv").symlink_to("/dev/null")
    (tmp_path / "kvm").symlink_to("/dev/null")
    settings = HealthSettings(dev_dir=tmp_path)
    assert detect_hypervisor(settings) is None
    with caplog.at_level(logging.WARNING, logger="hlplugin.health"):
        waiting = asyncio.create_task(wait_for_hypervisor(settings))
        await wait_until(lambda: "waiting for one" in caplog.text)
        assert "mshv is a symlink (not followed)" in caplog.text
        assert "kvm is a symlink (not followed)" in caplog.text
        (tmp_path / "kvm").unlink()
        (tmp_path / "kvm").touch()  # a node that is not a symlink: detected (the probe judges it)
        async with asyncio.timeout(10):
            assert await waiting == "kvm"  # and the symlink at mshv is not preferred


async def test_cancelled_streams_leave_no_task_and_streams_past_the_bound_are_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hlplugin.deviceplugin.kubelet.deviceplugin.servicer"):
        plugin = make_plugin(healthy_tracker())
        async with served(plugin) as (stub, _):
            # Streams the kubelet cancels: each used to leave a pending wait on the tracker until
            # the next health transition; none may outlive its stream.
            first = stub.ListAndWatch(pb.Empty())
            await first.read()  # the server side is up and its tasks exist
            baseline = len(asyncio.all_tasks())
            for _ in range(300):
                call = stub.ListAndWatch(pb.Empty())
                await call.read()
                call.cancel()
            await wait_until(lambda: plugin.open_streams == 1)
            await wait_until(lambda: len(asyncio.all_tasks()) <= baseline)

            # The stream bound: more are refused with RESOURCE_EXHAUSTED until one ends.
            calls = [first, *(stub.ListAndWatch(pb.Empty()) for _ in range(MAX_STREAMS - 1))]
            for call in calls[1:]:
                await call.read()
            assert plugin.open_streams == MAX_STREAMS
            for _ in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListAndWatch(pb.Empty()).read()
                assert refused.value.code() == EXHAUSTED
                assert f"{MAX_STREAMS} ListAndWatch streams are open already" in (
                    refused.value.details() or "")
            assert plugin.open_streams == MAX_STREAMS
            calls[0].cancel()
            await wait_until(lambda: plugin.open_streams == MAX_STREAMS - 1)
            again = stub.ListAndWatch(pb.Empty())
            assert len((await again.read()).devices) == 4
            for call in [*calls, again]:
                call.cancel()
            await wait_until(lambda: plugin.open_streams == 0)
    # A client retrying in a loop is logged once while the bound holds, not once per attempt.
    assert [r.getMessage() for r in caplog.records] == [
        f"refused a ListAndWatch stream: {MAX_STREAMS} are open already (at most {MAX_STREAMS})"]


async def test_a_reader_that_stops_reading_gets_the_latest_state_not_a_backlog() -> None:
    """A stopped process, not an in-process client: gRPC's client reads the socket eagerly into
    its own memory, which only a stopped reader does not."""

    tracker = healthy_tracker()
    plugin = make_plugin(tracker, count=2000)  # ~40 KB a list: the transport fills quickly
    lists = Calls(plugin.devices, "wire")  # one a list sent
    async with served(plugin) as (_, path):
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STALLING_CLIENT, str(path), stdout=subprocess.PIPE)
        assert client.stdout is not None
        try:
            seen = [(await client.stdout.readline()).decode().strip()]
            assert seen == ["Healthy"]
            transitions = 41
            for n in range(transitions):
                tracker.set_condition("device", n % 2 == 1, "flap")
                await quiet(0.01, "pacing: each state has a chance to be written")
            assert not tracker.state.healthy
            queued = lists.began
            assert queued < transitions // 2, f"{queued} lists sent to a reader that stopped"
            client.send_signal(signal.SIGCONT)

            async def read() -> None:
                assert client.stdout is not None
                async for line in client.stdout:
                    seen.append(line.decode().strip())

            reader = asyncio.create_task(read())
            await wait_until(lambda: seen[-1] == "Unhealthy" and len(seen) == lists.began)
            assert lists.began < transitions // 2
            reader.cancel()
        finally:
            client.kill()
            await client.wait()


# --- Allocate bounds (issue 11 #5) ---------------------------------------------------------------

async def node_never_rechecked() -> bool:
    raise AssertionError("the bounds refuse before the device-access plugin looks at its node")


LONGEST_ID = "k" * (MAX_ID_BYTES - 2) + "-0"  # the ID of hypervisor "kkk...": exactly MAX_ID_BYTES
PLUGINS: dict[str, Callable[[Path], TrackedDevicePlugin]] = {
    "kvm-4": lambda _: make_plugin(healthy_tracker()),
    "kvm-3": lambda _: make_plugin(healthy_tracker(), count=3),
    "longest": lambda _: make_plugin(healthy_tracker(), count=1, hypervisor=LONGEST_ID[:-2]),
    "access": lambda dev: DeviceAccessPlugin("kvm", healthy_tracker(), node_never_rechecked),
}


def of_size(size: int) -> pb.AllocateRequest:
    """One container naming one ID of x's, the request exactly ``size`` bytes on the wire."""
    n = size
    while allocate_request(["x" * n]).ByteSize() > size:
        n -= 1
    request = allocate_request(["x" * n])
    assert request.ByteSize() == size
    return request


@pytest.mark.parametrize(("plugin", "request_for", "code", "says"), [
    ("kvm-4", lambda p: allocate_request(*[["kvm-0"]] * MAX_CONTAINERS), None, []),
    ("kvm-4", lambda p: allocate_request(*[["kvm-0"]] * (MAX_CONTAINERS + 1)), INVALID,
     [f"{MAX_CONTAINERS + 1} container requests", f"at most {MAX_CONTAINERS}"]),
    # 200,000 containers in one request (1.8 MB): refused before it is even parsed.
    ("kvm-4", lambda p: allocate_request(*[["kvm-0"]] * 200_000), EXHAUSTED, []),
    ("kvm-3", lambda p: allocate_request(sorted(p.device_ids)), None, []),
    ("kvm-3", lambda p: allocate_request([*sorted(p.device_ids), "kvm-0"]), INVALID,
     ["names 4 device IDs; this plugin advertises 3"]),
    ("longest", lambda p: allocate_request([LONGEST_ID]), None, []),
    ("longest", lambda p: allocate_request([LONGEST_ID + "0"]), INVALID,
     [f"longer than {MAX_ID_BYTES} bytes", f"... ({MAX_ID_BYTES + 1} bytes)"]),
    # The device-access plugin applies the same bounds.
    ("access", lambda p: allocate_request(["device-access-kvm"] * 4), INVALID,
     ["names 4 device IDs; this plugin advertises 3"]),
    ("access", lambda p: allocate_request(*[["device-access-kvm"]] * (MAX_CONTAINERS + 1)),
     INVALID, []),
    ("access", lambda p: allocate_request(["x" * 50_000]), INVALID, ["50000 bytes"]),
    # At the receive limit the plugin itself answers (the ID is too long); one byte more and
    # gRPC refuses the message before it is parsed.
    ("kvm-4", lambda p: of_size(p.max_request_bytes), INVALID, ["longer than"]),
    ("kvm-4", lambda p: of_size(p.max_request_bytes + 1), EXHAUSTED, []),
    ("kvm-4", lambda p: allocate_request(["x" * 4_000_000]), EXHAUSTED, []),
    # Refusals quote a short escaped prefix of what they got.
    ("kvm-4", lambda p: allocate_request(["\x1b[2J" + "A" * 60_000]), INVALID,
     ["\\x1b[2J", "60004 bytes"]),
    ("kvm-4", lambda p: allocate_request(["kvm-9\x00\x07"]), INVALID, ["'kvm-9\\x00\\x07'"]),
    ("kvm-4", lambda p: allocate_request([f"bad-{i}" for i in range(4)],
                                         [f"bad-{i}" for i in range(4, 8)]), INVALID, ["and 3 more"]),
])
async def test_allocate_at_and_past_each_bound(
        tmp_path: Path, plugin: str, code: grpc.StatusCode | None, says: list[str],
        request_for: Callable[[TrackedDevicePlugin], pb.AllocateRequest],
        caplog: pytest.LogCaptureFixture) -> None:
    served_plugin = PLUGINS[plugin](tmp_path)
    request = request_for(served_plugin)
    with caplog.at_level(logging.WARNING, logger="hlplugin.deviceplugin.kubelet.deviceplugin.servicer"):
        async with served(served_plugin) as (stub, _):
            if code is None:
                ok = await stub.Allocate(request, timeout=10)
                assert len(ok.container_responses) == len(request.container_requests)
            else:
                details = await refused_with(stub, request, code)
                assert all(s in details for s in says), details
                assert details.isprintable(), details[:300]  # nothing raw that drives a terminal
    # The plugin logs each refusal of its own once, short and escaped; a message gRPC refuses
    # before it is parsed never reaches the plugin.
    refusals = [r.getMessage() for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert len(refusals) == (1 if code == INVALID else 0), refusals
    assert all(len(m) < 400 and m.isprintable() for m in refusals), refusals


async def test_refusals_repeated_in_a_loop_are_logged_once_and_counted_every_time(
        caplog: pytest.LogCaptureFixture) -> None:
    """A kubelet retrying pods on an unhealthy node, and a client sending the same bad request in
    a loop: each refusal is counted, and each distinct one logged once (more, a minute later)."""
    tracker = healthy_tracker()
    tracker.set_condition("device", False, "open on /dev/kvm failed")
    plugin = make_plugin(tracker)
    with caplog.at_level(logging.WARNING, logger="hlplugin.deviceplugin.kubelet.deviceplugin.servicer"):
        async with served(plugin) as (stub, _):
            for _ in range(40):
                await refused_with(stub, allocate_request(["kvm-0"]), grpc.StatusCode.FAILED_PRECONDITION)
                await refused_with(stub, allocate_request(["nope"]))
    refusals = [r.getMessage() for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert "open on /dev/kvm failed" in refusals[0] and "'nope'" in refusals[1], refusals
    counted = {result: plugin.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "hyperlight_allocations_total", {"result": result}) for result in ("refused", "invalid")}
    assert counted == {"refused": 40, "invalid": 40}
