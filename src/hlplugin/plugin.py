"""The main daemon: the hyperlight.dev/hypervisor plugin, its CDI reconciler and device monitor.

Built on the generic device plugin (hlplugin.deviceplugin) like its sibling bootstrap.py; this
module adds only the device IDs, the Allocate that hands out CDI references, and serve().
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from hlplugin import cdi_spec
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import DeviceList, NumberedIds
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.kubelet.deviceplugin.standing import UNREGISTERED
from hlplugin.deviceplugin.kubelet.role import Role
from hlplugin.deviceplugin.metrics import DevicePluginMetrics
from hlplugin.deviceplugin.process.daemon import Daemon, Launch, Started
from hlplugin.metrics import Metrics
from hlplugin.names import HYPERVISOR_RESOURCE as RESOURCE
from hlplugin.names import HYPERVISOR_SOCKET as SOCKET
from hlplugin.names import PLUGIN_DIR_FLAG
from hlplugin.proofs import Proofs
from hlplugin.settings import ServeSettings

log = logging.getLogger(__name__)

Gate = Callable[[], Awaitable[HealthState]]
SWITCH_INTERVAL = 0.0005  # seconds (CPython's default: 0.005); see serve()


def slots(hypervisor: str, count: int) -> DeviceList:
    """``<hv>-0`` .. ``<hv>-<count-1>``, serialized at the first list or when serve() says. serve()
    makes one per process and hands it to every registration's servicer, so all send the same
    bytes (50,000 devices are 1.2 MiB on the wire, 8 MiB as objects)."""
    return DeviceList(NumberedIds(hypervisor, count), serialized=False)


def annotation_key(device_id: str) -> str:
    """The key the CDI library's AnnotationKey("hyperlight.dev", id) spells, for old kubelets."""
    return f"cdi.k8s.io/hyperlight.dev_{device_id.replace('/', '_')}"


class HypervisorPlugin(TrackedDevicePlugin):
    """hyperlight.dev/hypervisor: N shareable slots, each a CDI reference to the one device."""

    def __init__(self, hypervisor: str, devices: DeviceList, tracker: HealthTracker, gate: Gate, *,
                 cdi_annotations: bool = False, metrics: DevicePluginMetrics | None = None,
                 first: asyncio.Future[Any] | None = None) -> None:
        super().__init__(devices, tracker, metrics, first=first)
        self.hypervisor = hypervisor
        self._gate = gate
        self._cdi_name = cdi_spec.qualified_name(hypervisor)
        self._annotations = cdi_annotations
        self.advertised_hint = (f"; this plugin advertises {hypervisor}-0.."
                                f"{hypervisor}-{len(self.device_ids) - 1}")

    async def gate(self) -> str | None:
        state = await self._gate()
        return None if state.healthy else f"{RESOURCE} is not usable on this node: {state.describe()}"

    def grant(self, container: pb.ContainerAllocateRequest,
              answer: pb.ContainerAllocateResponse) -> None:
        answer.cdi_devices.add(name=self._cdi_name)
        if self._annotations and container.devices_ids:
            answer.annotations[annotation_key(container.devices_ids[0])] = self._cdi_name


async def serve(settings: ServeSettings, launch: Launch | None = None) -> None:
    """The main daemon: CDI reconciler, device monitor and the hyperlight.dev/hypervisor plugin."""
    # Every Allocate waits for a device check in a helper thread, which takes the GIL back after
    # each of its syscalls; while the event loop is busy (concurrent Allocates), each of those
    # would wait out the interpreter's 5 ms switch interval. A shorter one bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL)
    metrics = Metrics()
    proofs = Proofs(settings.cdi, settings.health, metrics.daemon, metrics.proofs)

    async def setup(hv: str) -> Started:
        # A standby (another instance serves our socket: a surge rollout) leaves the CDI spec
        # alone until it takes over; the role is known before the reconciler's first pass.
        role = Role()
        checks = proofs.build(hv, role=role)
        role.look(settings.kubelet.plugin_dir / SOCKET)
        # The first pass of each, at once, while the plugin starts serving and registers; its
        # first list waits for both, so the kubelet's first list is true.
        first = checks.first()
        # The lists that first list sends, serialized once the passes are done: by then the
        # plugin is serving, usually waiting for the kubelet to answer Register.
        devices = slots(hv, settings.device_count)
        first.add_done_callback(lambda _: devices.serialize())
        lifecycle = PluginLifecycle(
            settings.kubelet, SOCKET, RESOURCE,
            lambda: HypervisorPlugin(hv, devices, proofs.tracker, checks.gate, first=first,
                                     cdi_annotations=settings.cdi.annotations,
                                     metrics=metrics.plugin),
            dir_setting=PLUGIN_DIR_FLAG, metrics=metrics.plugin, role=role, guard=settings.frame_guard)
        return Started(lifecycle, {**checks.tasks(), "plugin": lifecycle.run()})

    await Daemon(proofs.spec("hlplugin serve", settings.http, setup, launch,
                             unstarted=UNREGISTERED)).run()
