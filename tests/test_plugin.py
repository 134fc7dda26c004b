"""The DevicePlugin servers in-process over a real unix socket, with an injected health state."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from harness import wait_until

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.bootstrap import DeviceAccessPlugin
from hlplugin.config import Settings
from hlplugin.deviceplugin.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.lifecycle import new_server
from hlplugin.deviceplugin.servicer import (
    MAX_CONTAINERS,
    MAX_ID_BYTES,
    MAX_STREAMS,
    TrackedDevicePlugin,
)
from hlplugin.metrics import Metrics
from hlplugin.plugin import HypervisorPlugin


@asynccontextmanager
async def served_at(plugin: TrackedDevicePlugin
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


@asynccontextmanager
async def served(plugin: TrackedDevicePlugin) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    async with served_at(plugin) as (stub, _):
        yield stub


def healthy_tracker() -> HealthTracker:
    tracker = HealthTracker(required=("device",))
    tracker.set_condition("device", True)
    return tracker


def make_plugin(tracker: HealthTracker, count: int = 4) -> HypervisorPlugin:
    async def gate() -> HealthState:
        return tracker.state

    return HypervisorPlugin("kvm", count, tracker, gate, metrics=Metrics())


async def test_allocate_gate_refuses_with_the_reason_while_unhealthy_unknown_ids_before_it() -> None:
    tracker = healthy_tracker()
    async with served(make_plugin(tracker)) as stub:
        request = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])
        ok = await stub.Allocate(request, timeout=5)
        assert [d.name for d in ok.container_responses[0].cdi_devices] == [
            "hyperlight.dev/hypervisor=kvm"]
        tracker.set_condition("device", False, "KVM_CREATE_VM on /dev/kvm failed: [Errno 25]")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Allocate(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "KVM_CREATE_VM" in (refused.value.details() or "")
        assert "device" in (refused.value.details() or "")
        # An unknown ID is the request's fault, healthy or not: INVALID_ARGUMENT, not the gate's.
        unknown = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["kvm-4"])])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Allocate(unknown, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        tracker.set_condition("device", True)
        await stub.Allocate(request, timeout=5)


async def test_every_stream_gets_every_transition_and_ends_cleanly() -> None:
    tracker = healthy_tracker()
    plugin = make_plugin(tracker, count=3)
    async with served(plugin) as stub:
        streams = [stub.ListAndWatch(pb.Empty()) for _ in range(5)]
        seen: list[list[str]] = [[] for _ in streams]

        async def drain(i: int, call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:  # type: ignore[type-arg]
            async for response in call:
                assert len(response.devices) == 3
                seen[i].append({d.health for d in response.devices}.pop())
            return await call.code()

        readers = [asyncio.create_task(drain(i, c)) for i, c in enumerate(streams)]
        await wait_until(lambda: all(seen) and plugin.open_streams == 5)
        for ok in (False, True, False, True):
            tracker.set_condition("device", ok, "flap")
            want = "Healthy" if ok else "Unhealthy"
            await wait_until(lambda w=want: all(s[-1] == w for s in seen))  # type: ignore[misc]
        plugin.close_streams()
        codes = await asyncio.gather(*readers)
        assert codes == [grpc.StatusCode.OK] * 5
        for history in seen:
            assert history == ["Healthy", "Unhealthy", "Healthy", "Unhealthy", "Healthy"]
        assert plugin.open_streams == 0


async def test_options_and_empty_answers() -> None:
    async with served(make_plugin(healthy_tracker())) as stub:
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


def test_auto_prefers_mshv_over_kvm(tmp_path: Path) -> None:
    assert Settings(dev_dir=tmp_path).detect_hypervisor() is None
    (tmp_path / "kvm").touch()
    assert Settings(dev_dir=tmp_path).detect_hypervisor() == "kvm"
    (tmp_path / "mshv").touch()
    assert Settings(dev_dir=tmp_path).detect_hypervisor() == "mshv"
    assert Settings(dev_dir=tmp_path, hypervisor="kvm").detect_hypervisor() == "kvm"


# --- ListAndWatch: tasks, stream bound, no backlog (issue 11 #4 and #6) -------------------------


async def test_streams_the_kubelet_cancels_leave_no_task_behind() -> None:
    plugin = make_plugin(healthy_tracker())
    async with served(plugin) as stub:
        first = stub.ListAndWatch(pb.Empty())
        await first.read()  # the server side is up and its tasks exist
        baseline = len(asyncio.all_tasks())
        for _ in range(300):
            call = stub.ListAndWatch(pb.Empty())
            await call.read()
            call.cancel()
        await wait_until(lambda: plugin.open_streams == 1)
        # Each cancelled stream used to leave a pending wait on the tracker until the next
        # health transition; none may outlive its stream.
        await wait_until(lambda: len(asyncio.all_tasks()) <= baseline)
        first.cancel()
        await wait_until(lambda: plugin.open_streams == 0)


async def test_streams_past_the_bound_are_refused_with_resource_exhausted(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hlplugin.deviceplugin.servicer"):
        plugin = make_plugin(healthy_tracker())
        async with served(plugin) as stub:
            calls = [stub.ListAndWatch(pb.Empty()) for _ in range(MAX_STREAMS)]
            for call in calls:
                await call.read()
            assert plugin.open_streams == MAX_STREAMS
            for _ in range(20):
                extra = stub.ListAndWatch(pb.Empty())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await extra.read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"{MAX_STREAMS} ListAndWatch streams are open already" in (
                    refused.value.details() or "")
            assert plugin.open_streams == MAX_STREAMS
            calls[0].cancel()
            await wait_until(lambda: plugin.open_streams == MAX_STREAMS - 1)
            again = stub.ListAndWatch(pb.Empty())
            assert len((await again.read()).devices) == 4
            for call in [*calls, again]:
                call.cancel()
    # A client retrying in a loop is logged once while the bound holds, not once per attempt.
    assert [r.getMessage() for r in caplog.records] == [
        f"refused a ListAndWatch stream: {MAX_STREAMS} are open already (at most {MAX_STREAMS})"]


STALLING_CLIENT = """
import os, signal, sys
import grpc
from hlplugin.api import deviceplugin_pb2 as pb, deviceplugin_pb2_grpc as pb_grpc
with grpc.insecure_channel("unix://" + sys.argv[1]) as channel:
    stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
    print(next(stream).devices[0].health, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a reader that stops reading, until SIGCONT
    for response in stream:
        print(response.devices[0].health, flush=True)
"""


async def test_a_reader_that_stops_reading_gets_the_latest_state_not_a_backlog() -> None:
    """A stopped process, not an in-process client: gRPC's client reads the socket eagerly into
    its own memory, which only a stopped reader does not."""

    tracker = healthy_tracker()
    plugin = make_plugin(tracker, count=2000)  # ~40 KB a list: the transport fills quickly
    async with served_at(plugin) as (_, path):
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STALLING_CLIENT, str(path), stdout=subprocess.PIPE)
        assert client.stdout is not None
        try:
            seen = [(await client.stdout.readline()).decode().strip()]
            assert seen == ["Healthy"]
            transitions = 41
            for n in range(transitions):
                tracker.set_condition("device", n % 2 == 1, "flap")
                await asyncio.sleep(0.01)  # pacing: each state has a chance to be written
            assert not tracker.state.healthy
            queued = plugin.lists_sent
            assert queued < transitions // 2, f"{queued} lists sent to a reader that stopped"
            client.send_signal(signal.SIGCONT)

            async def read() -> None:
                assert client.stdout is not None
                async for line in client.stdout:
                    seen.append(line.decode().strip())

            reader = asyncio.create_task(read())
            await wait_until(lambda: seen[-1] == "Unhealthy" and len(seen) == plugin.lists_sent)
            assert plugin.lists_sent < transitions // 2
            reader.cancel()
        finally:
            client.kill()
            await client.wait()


# --- Allocate bounds (issue 11 #5) ---------------------------------------------------------------


def allocate_request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])


async def refused_with(stub: pb_grpc.DevicePluginStub, request: pb.AllocateRequest,
                       code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Allocate(request, timeout=10)
    assert refused.value.code() == code, refused.value.details()
    details = refused.value.details() or ""
    assert len(details) < 300, details[:300]
    return details


async def test_allocate_containers_per_request_at_and_past_the_bound() -> None:
    async with served(make_plugin(healthy_tracker())) as stub:
        ok = await stub.Allocate(allocate_request(*[["kvm-0"]] * MAX_CONTAINERS), timeout=10)
        assert len(ok.container_responses) == MAX_CONTAINERS
        details = await refused_with(stub, allocate_request(*[["kvm-0"]] * (MAX_CONTAINERS + 1)))
        assert f"{MAX_CONTAINERS + 1} container requests" in details
        assert f"at most {MAX_CONTAINERS}" in details
        # 200,000 containers in one request (1.8 MB): refused before it is even parsed.
        await refused_with(stub, allocate_request(*[["kvm-0"]] * 200_000),
                           grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_allocate_ids_per_container_at_and_past_the_bound() -> None:
    plugin = make_plugin(healthy_tracker(), count=3)
    async with served(plugin) as stub:
        everything = sorted(plugin.device_ids)
        ok = await stub.Allocate(allocate_request(everything), timeout=10)
        assert len(ok.container_responses) == 1
        details = await refused_with(stub, allocate_request([*everything, "kvm-0"]))
        assert "names 4 device IDs; this plugin advertises 3" in details


async def test_device_access_plugin_applies_the_same_bounds(tmp_path: Path) -> None:
    rechecks: list[None] = []

    async def recheck() -> bool:
        rechecks.append(None)
        return True

    plugin = DeviceAccessPlugin("kvm", healthy_tracker(), recheck)
    async with served(plugin) as stub:
        details = await refused_with(
            stub, allocate_request(["device-access-kvm", "device-access-kvm"]))
        assert "names 2 device IDs; this plugin advertises 1" in details
        await refused_with(stub, allocate_request(*[["device-access-kvm"]] * (MAX_CONTAINERS + 1)))
        details = await refused_with(stub, allocate_request(["x" * 50_000]))
        assert "50000 bytes" in details
    assert not rechecks  # the bounds refuse before the node is looked at


async def test_allocate_id_length_at_and_past_the_bound() -> None:
    tracker = healthy_tracker()

    async def gate() -> HealthState:
        return tracker.state

    hypervisor = "k" * (MAX_ID_BYTES - 2)  # IDs "<hypervisor>-0": exactly MAX_ID_BYTES
    plugin = HypervisorPlugin(hypervisor, 1, tracker, gate)
    async with served(plugin) as stub:
        (longest,) = plugin.device_ids
        assert len(longest) == MAX_ID_BYTES
        await stub.Allocate(allocate_request([longest]), timeout=10)
        details = await refused_with(stub, allocate_request([longest + "0"]))
        assert f"longer than {MAX_ID_BYTES} bytes" in details
        assert f"... ({MAX_ID_BYTES + 1} bytes)" in details


async def test_refusals_quote_a_short_escaped_prefix(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hlplugin.deviceplugin.servicer"):
        async with served(make_plugin(healthy_tracker())) as stub:
            huge = "\x1b[2J" + "A" * 60_000
            details = await refused_with(stub, allocate_request([huge]))
            assert "\x1b" not in details and "\\x1b[2J" in details
            assert "60004 bytes" in details
            details = await refused_with(stub, allocate_request(["kvm-9\x00\x07"]))
            assert "'kvm-9\\x00\\x07'" in details and "\x00" not in details
            details = await refused_with(stub, allocate_request([f"bad-{i}" for i in range(4)],
                                                                [f"bad-{i}" for i in range(4, 8)]))
            assert "and 3 more" in details
    refusals = [r.getMessage() for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert len(refusals) == 3
    assert all(len(m) < 400 and "\x1b" not in m and "\x00" not in m for m in refusals)


async def test_requests_larger_than_the_receive_limit_never_reach_the_plugin() -> None:
    plugin = make_plugin(healthy_tracker(), count=4)
    limit = plugin.max_request_bytes

    def of_size(size: int) -> pb.AllocateRequest:
        n = size
        while allocate_request(["x" * n]).ByteSize() > size:
            n -= 1
        request = allocate_request(["x" * n])
        assert request.ByteSize() == size
        return request

    async with served(plugin) as stub:
        # At the limit the plugin itself answers (the ID is too long); one byte more and
        # gRPC refuses the message before it is parsed.
        details = await refused_with(stub, of_size(limit))
        assert "longer than" in details
        await refused_with(stub, of_size(limit + 1), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await refused_with(stub, allocate_request(["x" * 4_000_000]),
                           grpc.StatusCode.RESOURCE_EXHAUSTED)
