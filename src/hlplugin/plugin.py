"""The main daemon: the hyperlight.dev/hypervisor plugin, its CDI reconciler and device monitor.

Built on the generic device plugin (hlplugin.deviceplugin) like its sibling bootstrap.py; this
module adds only the device IDs, the Allocate that hands out CDI references, and serve().
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hlplugin import cdi, cdi_spec
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.config import Settings, show
from hlplugin.detect import wait_for_hypervisor
from hlplugin.deviceplugin.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.daemon import Daemon, DaemonSpec, Launch, Started
from hlplugin.deviceplugin.devicelist import DeviceList, NumberedIds
from hlplugin.deviceplugin.interfaces import Context
from hlplugin.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.producer import Trigger
from hlplugin.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.health import DeviceMonitor
from hlplugin.metrics import Metrics
from hlplugin.names import HYPERVISOR_RESOURCE as RESOURCE
from hlplugin.names import HYPERVISOR_SOCKET as SOCKET
from hlplugin.names import PLUGIN_DIR_FLAG

log = logging.getLogger(__name__)

Gate = Callable[[], Awaitable[HealthState]]
SWITCH_INTERVAL = 0.0005  # seconds (CPython's default: 0.005); see serve()


@functools.lru_cache(maxsize=2)
def device_list(hypervisor: str, count: int) -> DeviceList:
    """``<hv>-0`` .. ``<hv>-<count-1>``, serialized once per process (at the first list, or as
    serve() says): every registration's servicer sends the same bytes (50,000 devices are
    1.2 MiB on the wire, 8 MiB as objects)."""
    return DeviceList(NumberedIds(hypervisor, count), serialized=False)


def annotation_key(device_id: str) -> str:
    """The key the CDI library's AnnotationKey("hyperlight.dev", id) spells, for old kubelets."""
    return f"cdi.k8s.io/hyperlight.dev_{device_id.replace('/', '_')}"


class HypervisorPlugin(TrackedDevicePlugin):
    """hyperlight.dev/hypervisor: N shareable slots, each a CDI reference to the one device."""

    def __init__(self, hypervisor: str, count: int, tracker: HealthTracker, gate: Gate, *,
                 cdi_annotations: bool = False, metrics: Metrics | None = None,
                 first: asyncio.Future[Any] | None = None) -> None:
        super().__init__(device_list(hypervisor, count), tracker, metrics, first=first)
        self.hypervisor = hypervisor
        self._gate = gate
        self._cdi_name = cdi_spec.qualified_name(hypervisor)
        self._annotations = cdi_annotations

    async def Allocate(self, request: pb.AllocateRequest,
                       context: Context) -> pb.AllocateResponse:
        await self.check_request(request, context, f"; this plugin advertises {self.hypervisor}-0.."
                                 f"{self.hypervisor}-{len(self.device_ids) - 1}")
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


async def serve(settings: Settings, launch: Launch | None = None) -> None:
    """The main daemon: CDI reconciler, device monitor and the hyperlight.dev/hypervisor plugin."""
    # Every Allocate waits for a device check in a helper thread, which takes the GIL back after
    # each of its syscalls; while the event loop is busy (concurrent Allocates), each of those
    # would wait out the interpreter's 5 ms switch interval. A shorter one bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL)
    metrics = Metrics()
    tracker = HealthTracker(required=("cdi", "device", "host_identity"))

    async def setup(hv: str) -> Started:
        reconciler = cdi.CdiReconciler(
            settings.cdi_dir, cdi_spec.render_spec(hv, settings.device_uid, settings.device_gid),
            tracker=tracker, metrics=metrics, interval=settings.cdi_interval)
        monitor = DeviceMonitor(
            tracker, hv, settings.dev_dir, settings.host_dev_dir,
            interval=settings.health_interval, budget=settings.probe_timeout,
            guest_check=settings.guest_check, metrics=metrics)
        # The first pass of each: independent, in helper threads of their own, at once, while
        # the plugin starts serving and registers; its first list waits for both, so the
        # kubelet's first list is true.
        cdi_first = asyncio.ensure_future(reconciler.reconcile(Trigger.START))
        device_first = asyncio.ensure_future(monitor.check())
        first = asyncio.gather(cdi_first, device_first)
        # The lists that first list sends, serialized once the passes are done: by then the
        # plugin is serving, usually waiting for the kubelet to answer Register.
        devices = device_list(hv, settings.device_count)
        first.add_done_callback(lambda _: devices.serialize())

        async def gate() -> HealthState:
            # CDI: the inotify-vouched read. The device: a check that began after this Allocate.
            await reconciler.ensure()
            return await monitor.for_allocate()

        lifecycle = PluginLifecycle(
            settings.plugin_dir, SOCKET, RESOURCE,
            lambda: HypervisorPlugin(hv, settings.device_count, tracker, gate, first=first,
                                     cdi_annotations=settings.cdi_annotations, metrics=metrics),
            register_timeout=settings.register_timeout, dir_setting=PLUGIN_DIR_FLAG, metrics=metrics)
        # Each run() goes on from its first pass (Producer.run waits for the one in flight).
        return Started(lifecycle, {"cdi": reconciler.run(), "device-health": monitor.run(),
                                   "plugin": lifecycle.run()})

    await Daemon(DaemonSpec(
        "hlplugin serve", settings.http_address, tracker, metrics,
        functools.partial(wait_for_hypervisor, settings), setup,
        pending={"hypervisor": f"no mshv or kvm device under {show(settings.dev_dir)}"},
        launch=launch or Launch())).run()
