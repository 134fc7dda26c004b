"""The DRA resource-health stream (dra-health v1alpha1, KEP-4680): the kubelet opens
NodeWatchResources on a registered plugin's endpoint (gate ResourceHealthStatus, beta and on by
default in 1.36) and shows what it hears in the status of the pods using each device.

The health is the daemon's HealthTracker's: a device is HEALTHY while every condition holds, else
UNHEALTHY with the failing conditions as the message. Each stream sends the complete list at once,
on every change, and at least every ``refresh`` seconds (the kubelet turns a device it has heard
nothing about for ``timeout`` seconds to Unknown, which is what a hung driver should show).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from hlplugin.api import dra_health_v1alpha1_pb2 as health_pb
from hlplugin.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.context import Context

Devices = Callable[[], Sequence[tuple[str, str]]]  # (pool, device) of every device published


class HealthStream(health_grpc.DRAResourceHealthServicer):
    def __init__(self, tracker: HealthTracker, devices: Devices, *, refresh: float = 10.0,
                 clock: Callable[[], float] = time.time,
                 on_streams: Callable[[int], None] | None = None) -> None:
        """``on_streams``: told how many streams are open whenever that changes (a gauge)."""
        self.tracker = tracker
        self.devices = devices
        self.refresh = refresh
        # Three refreshes missed: the driver is hung or gone, and the kubelet says Unknown.
        self.timeout = max(1, round(3 * refresh))
        self.clock = clock
        self._on_streams = on_streams
        self._streams = 0

    def response(self, state: HealthState) -> health_pb.NodeWatchResourcesResponse:
        healthy = state.healthy
        health = health_pb.HealthStatus.HEALTHY if healthy else health_pb.HealthStatus.UNHEALTHY
        message = "" if healthy else state.describe()
        now = int(self.clock())
        return health_pb.NodeWatchResourcesResponse(devices=[
            health_pb.DeviceHealth(
                device=health_pb.DeviceIdentifier(pool_name=pool, device_name=device),
                health=health, last_updated_time=now, health_check_timeout_seconds=self.timeout,
                message=message)
            for pool, device in self.devices()])

    async def NodeWatchResources(self, request: health_pb.NodeWatchResourcesRequest,
                                 context: Context) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        self._count(+1)
        try:
            state = self.tracker.state
            while True:
                yield self.response(state)
                try:
                    async with asyncio.timeout(self.refresh):
                        state = await self.tracker.wait_for_change(state.generation)
                except TimeoutError:
                    state = self.tracker.state
        finally:
            self._count(-1)

    def _count(self, change: int) -> None:
        self._streams += change
        if self._on_streams is not None:
            self._on_streams(self._streams)
