"""The DevicePlugin servers in-process over a real unix socket, with an injected health state."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from harness import eventually, run

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.config import Settings
from hlplugin.health import HealthState, HealthTracker
from hlplugin.metrics import Metrics
from hlplugin.plugin import HypervisorPlugin


@asynccontextmanager
async def served(plugin: HypervisorPlugin) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    with tempfile.TemporaryDirectory(prefix="hlp-") as directory:
        path = Path(directory) / "p.sock"
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            try:
                yield pb_grpc.DevicePluginStub(channel)
            finally:
                plugin.close_streams()
                await server.stop(grace=1)


def healthy_tracker() -> HealthTracker:
    tracker = HealthTracker(required=("device",))
    tracker.set_condition("device", True)
    return tracker


def make_plugin(tracker: HealthTracker, count: int = 4) -> HypervisorPlugin:
    async def gate() -> HealthState:
        return tracker.state

    return HypervisorPlugin("kvm", count, tracker, gate, metrics=Metrics())


def test_allocate_gate_refuses_with_the_reason_while_unhealthy() -> None:
    async def body() -> None:
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
            tracker.set_condition("device", True)
            await stub.Allocate(request, timeout=5)

    run(body())


def test_unknown_ids_are_invalid_argument_even_when_unhealthy() -> None:
    async def body() -> None:
        tracker = HealthTracker(required=("device",))
        async with served(make_plugin(tracker, count=2)) as stub:
            request = pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["kvm-2"])])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Allocate(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(body())


def test_every_stream_gets_every_transition_and_ends_cleanly() -> None:
    async def body() -> None:
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
            await eventually(lambda: all(seen) and plugin.open_streams == 5)
            for ok in (False, True, False, True):
                tracker.set_condition("device", ok, "flap")
                want = "Healthy" if ok else "Unhealthy"
                await eventually(lambda w=want: all(s[-1] == w for s in seen))  # type: ignore[misc]
            plugin.close_streams()
            codes = await asyncio.gather(*readers)
            assert codes == [grpc.StatusCode.OK] * 5
            for history in seen:
                assert history == ["Healthy", "Unhealthy", "Healthy", "Unhealthy", "Healthy"]
            assert plugin.open_streams == 0

    run(body())


def test_options_and_empty_answers() -> None:
    async def body() -> None:
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

    run(body())


def test_auto_prefers_mshv_over_kvm(tmp_path: Path) -> None:
    assert Settings(dev_dir=tmp_path).detect_hypervisor() is None
    (tmp_path / "kvm").touch()
    assert Settings(dev_dir=tmp_path).detect_hypervisor() == "kvm"
    (tmp_path / "mshv").touch()
    assert Settings(dev_dir=tmp_path).detect_hypervisor() == "mshv"
    assert Settings(dev_dir=tmp_path, hypervisor="kvm").detect_hypervisor() == "kvm"
