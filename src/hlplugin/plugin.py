"""DevicePlugin servers: a base that streams a HealthTracker as a device list, and the main plugin.

The base holds everything both daemons share (ListAndWatch, stream bookkeeping, the empty options
and answers); a concrete plugin adds only its device IDs and its Allocate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from hlplugin import cdi
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.config import Settings
from hlplugin.daemon import (
    RootTasks,
    plugin_readiness,
    run_daemon,
    track_health_metrics,
    wait_for_hypervisor,
)
from hlplugin.health import DeviceMonitor, HealthState, HealthTracker
from hlplugin.lifecycle import Context, PluginLifecycle, PluginServicer
from hlplugin.metrics import Metrics

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
RESOURCE = "hyperlight.dev/hypervisor"
SOCKET = "hyperlight.sock"

Gate = Callable[[], Awaitable[HealthState]]


class TrackedDevicePlugin(PluginServicer):
    """Advertises ``device_ids``, all Healthy or all Unhealthy as the tracker says."""

    def __init__(self, device_ids: Sequence[str], tracker: HealthTracker,
                 metrics: Metrics | None = None) -> None:
        self.device_ids = frozenset(device_ids)
        self.tracker = tracker
        self.metrics = metrics
        self.open_streams = 0
        self._closed = asyncio.Event()
        # Built once: a 2,000-device list is the same message on every transition.
        self._lists = {
            ok: pb.ListAndWatchResponse(
                devices=[pb.Device(ID=i, health=HEALTHY if ok else UNHEALTHY) for i in device_ids])
            for ok in (True, False)
        }

    def close_streams(self) -> None:
        self._closed.set()

    async def GetDevicePluginOptions(self, request: pb.Empty,
                                     context: Context) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False,
                                      get_preferred_allocation_available=False)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Context
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse()

    async def PreStartContainer(self, request: pb.PreStartContainerRequest,
                                context: Context) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    async def ListAndWatch(self, request: pb.Empty,
                           context: Context) -> AsyncIterator[pb.ListAndWatchResponse]:
        self._stream_opened(+1)
        closed = asyncio.create_task(self._closed.wait())
        try:
            state = self.tracker.state
            while not self._closed.is_set():
                self._publish(state)
                yield self._lists[state.healthy]
                change = asyncio.create_task(self.tracker.wait_for_change(state.generation))
                await asyncio.wait({change, closed}, return_when=asyncio.FIRST_COMPLETED)
                if not change.done():
                    change.cancel()
                    break
                state = change.result()
        finally:
            closed.cancel()
            self._stream_opened(-1)

    def unknown_ids(self, request: pb.AllocateRequest) -> list[str]:
        return sorted({i for c in request.container_requests for i in c.devices_ids
                       if i not in self.device_ids})

    def _stream_opened(self, delta: int) -> None:
        self.open_streams += delta
        if self.metrics is not None:
            self.metrics.streams.inc(delta)

    def _publish(self, state: HealthState) -> None:
        if self.metrics is not None:
            self.metrics.devices_advertised.set(len(self.device_ids))
            self.metrics.devices_healthy.set(len(self.device_ids) if state.healthy else 0)

    async def _refuse(self, context: Context, code: grpc.StatusCode, message: str,
                      result: str) -> None:
        if self.metrics is not None:
            self.metrics.allocations.labels(result=result).inc()
        log.warning("refused Allocate: %s", message, extra={"result": result})
        await context.abort(code, message)


def device_ids(hypervisor: str, count: int) -> list[str]:
    return [f"{hypervisor}-{i}" for i in range(count)]


def annotation_key(device_id: str) -> str:
    """The key the CDI library's AnnotationKey("hyperlight.dev", id) spells, for old kubelets."""
    return f"cdi.k8s.io/hyperlight.dev_{device_id.replace('/', '_')}"


class HypervisorPlugin(TrackedDevicePlugin):
    """hyperlight.dev/hypervisor: N shareable slots, each a CDI reference to the one device."""

    def __init__(self, hypervisor: str, count: int, tracker: HealthTracker, gate: Gate, *,
                 cdi_annotations: bool = False, metrics: Metrics | None = None) -> None:
        super().__init__(device_ids(hypervisor, count), tracker, metrics)
        self.hypervisor = hypervisor
        self._gate = gate
        self._cdi_name = cdi.qualified_name(hypervisor)
        self._annotations = cdi_annotations

    async def Allocate(self, request: pb.AllocateRequest,
                       context: Context) -> pb.AllocateResponse:
        unknown = self.unknown_ids(request)
        if unknown:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"unknown device IDs {', '.join(unknown[:5])}; this plugin "
                               f"advertises {self.hypervisor}-0..{self.hypervisor}-"
                               f"{len(self.device_ids) - 1}", "invalid")
        state = await self._gate()
        if not state.healthy:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"{RESOURCE} is not usable on this node: {state.describe()}",
                               "refused")
        response = pb.AllocateResponse()
        for container in request.container_requests:
            entry = response.container_responses.add()
            entry.cdi_devices.add(name=self._cdi_name)
            if self._annotations and container.devices_ids:
                entry.annotations[annotation_key(container.devices_ids[0])] = self._cdi_name
        if self.metrics is not None:
            self.metrics.allocations.labels(result="success").inc()
        return response


async def serve(settings: Settings) -> None:
    """The main daemon: CDI reconciler, device monitor and the hyperlight.dev/hypervisor plugin."""
    metrics = Metrics()
    tracker = HealthTracker(required=("cdi", "device", "host_identity"))
    track_health_metrics(tracker, metrics)
    holder: list[PluginLifecycle] = []
    hypervisor: list[str] = []

    def current() -> PluginLifecycle | None:
        return holder[0] if holder else None

    def readiness() -> dict[str, tuple[bool, str]]:
        conditions = plugin_readiness(current, tracker)()
        if not hypervisor:
            conditions["hypervisor"] = (False, f"no mshv or kvm device under {settings.dev_dir}")
        return conditions

    async def setup() -> RootTasks:
        hv = await wait_for_hypervisor(settings)
        hypervisor.append(hv)
        reconciler = cdi.CdiReconciler(
            settings.cdi_dir, cdi.render_spec(hv, settings.device_uid, settings.device_gid),
            tracker=tracker, metrics=metrics, interval=settings.cdi_interval)
        monitor = DeviceMonitor(
            tracker, hv, settings.dev_dir, settings.host_dev_dir,
            interval=settings.health_interval, budget=settings.probe_timeout,
            guest_check=settings.guest_check, metrics=metrics)
        await reconciler.reconcile("start")
        await monitor.check()

        async def gate() -> HealthState:
            await reconciler.ensure()
            await monitor.ensure_fresh(1.0)
            return tracker.state

        lifecycle = PluginLifecycle(
            settings.plugin_dir, SOCKET, RESOURCE,
            lambda: HypervisorPlugin(hv, settings.device_count, tracker, gate,
                                     cdi_annotations=settings.cdi_annotations, metrics=metrics),
            register_timeout=settings.register_timeout, metrics=metrics)
        holder.append(lifecycle)
        log.info("advertising %d %s slots for %s", settings.device_count, RESOURCE, hv)
        return {"cdi": reconciler.run(), "device-health": monitor.run(), "plugin": lifecycle.run()}

    await run_daemon("hlplugin serve", settings.http_address, readiness, current, metrics, setup)
