"""A bare device plugin of the tests' own (a gRPC server that registers once and records what
happens to its stream), so that nothing of ours decides what a kubelet, the emulator or the real
one, shows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc

ACCESS = "hyperlight.dev/device-access"


class BarePlugin(pb_grpc.DevicePluginServicer):
    """One device; records when its stream ends and whether its socket was still there then."""

    def __init__(self, plugin_dir: Path, name: str = "bare.sock", health: str = "Healthy") -> None:
        self.socket = plugin_dir / name
        self.kubelet = plugin_dir / "kubelet.sock"
        self.health = health
        self.streams = 0
        self.ended: list[tuple[float, bool]] = []  # (loop time, our socket still on disk)
        self.allocations = 0
        self.server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, self.server)

    async def GetDevicePluginOptions(self, request: pb.Empty, context: object) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request: pb.Empty,
                           context: object) -> AsyncIterator[pb.ListAndWatchResponse]:
        self.streams += 1
        try:
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID="d0", health=self.health)])
            await asyncio.Event().wait()
        finally:
            self.streams -= 1
            self.ended.append((asyncio.get_running_loop().time(), self.socket.exists()))

    async def Allocate(self, request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        self.allocations += 1
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse()])

    async def serve_and_register(self) -> None:
        self.socket.unlink(missing_ok=True)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet}") as channel:
            await pb_grpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                version="v1beta1", endpoint=self.socket.name, resource_name=ACCESS), timeout=10)
