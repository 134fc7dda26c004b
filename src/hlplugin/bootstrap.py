"""The bootstrap daemon: hyperlight.dev/device-access slots that grant the hypervisor node.

The main plugin's pod requests this resource, so the kubelet gives it /dev/<hv> read/write without
privilege or a read-write host /dev. Allocate grants that one node and nothing else: no mknod
permission, no mounts, no environment, no CDI. Three slots (SLOTS): during a surge rollout the
old main pod holds one while the new one, standing by, takes another (docs/architecture.md,
"Upgrades"); the third is for a pod of the rollout before, still terminating (it answers the
kubelet's next readiness probe before it exits) when a rollback or the next upgrade surges
before that rollout finished: the scheduler counts a terminating pod until it has ended, and
`kubectl rollout status` waits for that. The admission policy still reserves all three for the
main DaemonSet.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Awaitable, Callable
from pathlib import Path

from hlplugin import hvnode
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.detect import pending, wait_for_hypervisor
from hlplugin.deviceplugin.health.bounded import CheckFailed
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.health.fresh import Fresh
from hlplugin.deviceplugin.health.producer import Producer, Trigger
from hlplugin.deviceplugin.health.watch import DirWatcher
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.kubelet.deviceplugin.standing import UNREGISTERED
from hlplugin.deviceplugin.metrics import DevicePluginMetrics
from hlplugin.deviceplugin.process.daemon import Daemon, DaemonSpec, Launch, Started
from hlplugin.metrics import daemon_metrics
from hlplugin.names import DEVICE_ACCESS_RESOURCE as RESOURCE
from hlplugin.names import DEVICE_ACCESS_SOCKET as SOCKET
from hlplugin.names import PLUGIN_DIR_FLAG, ConditionName
from hlplugin.settings import BootstrapSettings

SLOTS = 3  # a consumer's pods on one node at once: a terminating one, the old one, its surge pod


def slot_ids(hypervisor: str, slots: int = SLOTS) -> list[str]:
    """``device-access-<hv>``, then ``device-access-<hv>-1`` ...: the first keeps the name a
    single-slot release advertised, so a kubelet's checkpoint of it stays valid."""
    return [f"device-access-{hypervisor}" + (f"-{n}" if n else "") for n in range(slots)]


class DeviceAccessPlugin(TrackedDevicePlugin):
    """Grants /dev/<hv> after ``recheck()`` (the node watch's bounded pass, off the event loop, so
    a hung /dev times out in its budget instead of freezing the loop) found the node usable."""

    def __init__(self, hypervisor: str, tracker: HealthTracker,
                 recheck: Callable[[], Awaitable[bool]],
                 metrics: DevicePluginMetrics | None = None) -> None:
        super().__init__(slot_ids(hypervisor), tracker, metrics)
        self.device_path = f"/dev/{hypervisor}"
        self._recheck = recheck

    async def gate(self) -> str | None:
        if await self._recheck():
            return None
        return f"cannot grant {self.device_path}: {self.tracker.state.describe()}"

    def grant(self, container: pb.ContainerAllocateRequest,
              answer: pb.ContainerAllocateResponse) -> None:
        answer.devices.add(container_path=self.device_path, host_path=self.device_path,
                           permissions="rw")


NODE_WATCH_CONDITIONS = (ConditionName.DEVICE,)  # what node_watch keeps


def node_watch(tracker: HealthTracker, node: Path, recheck: float = 10.0,
               budget: float = 2.0, sys_dir: Path = hvnode.SYS_DIR) -> Producer:
    """Keeps condition "device" equal to "the node is the hypervisor's": a character device (no
    symlink) with the numbers the kernel gave the hypervisor named like it (hvnode: sysfs, else
    /proc/misc), not merely some character device. A pass on changes to the node's name, every
    ``recheck`` seconds, in a runner (a hung /dev times out)."""
    problem_of = functools.partial(hvnode.node_problem, node, node.name, sys_dir)

    async def check(trigger: Trigger) -> bool:
        try:
            problem = await producer.runner.run(problem_of)
        except CheckFailed as exc:
            problem = f"{node}: {exc}"
        tracker.set_condition(ConditionName.DEVICE, not problem, problem)
        return not problem

    producer = Producer(f"node-{node.name}", check, watch=[DirWatcher(node.parent, {node.name})],
                        interval=recheck, budget=budget)
    return producer


async def bootstrap(settings: BootstrapSettings, launch: Launch | None = None, *,
                    sys_dir: Path = hvnode.SYS_DIR) -> None:
    metrics = DevicePluginMetrics(daemon_metrics())  # no proofs' families: it has no prober, no CDI
    tracker = HealthTracker(required=NODE_WATCH_CONDITIONS)

    async def setup(hv: str) -> Started:
        watch = node_watch(tracker, settings.health.dev_dir / hv,
                           budget=settings.health.probe_timeout, sys_dir=sys_dir)
        await watch.check(Trigger.START)  # before registering; run() goes on from here
        # Each Allocate: a node check begun after it arrived, shared by a burst; a failure in
        # flight answers at once (refusing on it is safe).
        gate = Fresh(functools.partial(watch.check, Trigger.ALLOCATE), name="node-check",
                     settles=operator.not_)
        lifecycle = PluginLifecycle(
            settings.kubelet, SOCKET, RESOURCE,
            lambda: DeviceAccessPlugin(hv, tracker, gate.fresh, metrics),
            dir_setting=PLUGIN_DIR_FLAG, metrics=metrics, guard=settings.frame_guard)
        return Started(lifecycle, {"device-health": watch.run(),
                                   "plugin": lifecycle.run()})

    # What auto looks for and where, as the main daemon says it.
    await Daemon(DaemonSpec(
        "hlplugin bootstrap", settings.http, tracker, metrics.daemon,
        functools.partial(wait_for_hypervisor, settings.health), setup,
        pending=pending(settings.health),
        launch=launch or Launch(), unstarted=UNREGISTERED)).run()
