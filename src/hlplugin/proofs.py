"""The node's proofs, built in one place for every daemon that hands the hypervisor out (`hlplugin
serve`, `hlplugin dra`): the CDI reconciler (condition ``cdi``), the device monitor (``device``,
``host_identity``), the tracker that holds them, the CDI directory's exposure notes for /readyz,
and the gate every Allocate and every Prepare passes.

The DRA driver was first assembled by copying the main daemon's setup, and the copy lost two of
its parts (the CDI role and the exposure warnings: issue 38). Each daemon now composes these
instead: ``Proofs`` is what exists before the hypervisor is known (the tracker and the warnings a
DaemonSpec takes, so /readyz cannot forget them), ``Proofs.build`` what a daemon's setup makes
once it is (``Checks``). What differs between daemons is only who may write the CDI spec.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from hlplugin import cdi, cdi_spec
from hlplugin.detect import pending, wait_for_hypervisor
from hlplugin.deviceplugin.health.conditions import Condition, HealthState, HealthTracker
from hlplugin.deviceplugin.health.producer import Trigger
from hlplugin.deviceplugin.kubelet.role import Role
from hlplugin.deviceplugin.metrics import DaemonMetrics
from hlplugin.deviceplugin.process.daemon import DaemonSpec, Launch, Started
from hlplugin.deviceplugin.settings import HttpSettings
from hlplugin.health import DeviceMonitor
from hlplugin.metrics import ProofMetrics
from hlplugin.settings import CdiSettings, HealthSettings

CONDITIONS = (*cdi.CdiReconciler.CONDITIONS, *DeviceMonitor.CONDITIONS)


class Checks:
    """The proofs of one hypervisor: the reconciler and the monitor, their first passes, the gate
    and the root tasks that keep them going."""

    def __init__(self, reconciler: cdi.CdiReconciler, monitor: DeviceMonitor) -> None:
        self.reconciler = reconciler
        self.monitor = monitor

    def first(self) -> asyncio.Future[tuple[Condition, HealthState]]:
        """Start the first pass of each now: independent, each in a helper thread of its own, so
        the daemon can serve meanwhile; the future is done when both are."""
        return asyncio.gather(asyncio.ensure_future(self.reconciler.reconcile(Trigger.START)),
                              asyncio.ensure_future(self.monitor.check()))

    async def gate(self) -> HealthState:
        """Before every Allocate and Prepare: the CDI spec by its inotify-vouched read, then the
        device by a check that began after the call arrived."""
        await self.reconciler.ensure()
        return await self.monitor.for_allocate()

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The root tasks: each run() goes on from its first pass (Producer.run waits for the
        one in flight)."""
        return {"cdi": self.reconciler.run(), "device-health": self.monitor.run()}


class Proofs:
    """What a daemon that hands the device out needs before the hypervisor is known; ``spec``
    makes its DaemonSpec, ``build`` its Checks."""

    def __init__(self, cdi_settings: CdiSettings, health: HealthSettings, daemon: DaemonMetrics,
                 metrics: ProofMetrics) -> None:
        """``daemon``: the daemon's own metrics group (its spec's); ``metrics``: the proofs',
        in the same registry."""
        self.cdi = cdi_settings
        self.health = health
        self.daemon_metrics = daemon
        self.metrics = metrics
        self.tracker = HealthTracker(required=CONDITIONS)
        self.warnings: list[str] = []  # /readyz's: how the CDI directory is exposed, if it is

    def build(self, hypervisor: str, *, role: Role | None = None,
              turn: cdi.Turn | None = None) -> Checks:
        """The reconciler and the monitor of ``hypervisor``. Who writes the CDI spec: ``role``,
        the main daemon's (a standby writes none); ``turn``, the DRA driver's (the instance the
        kubelet registered last: deviceplugin/kubelet/dra/writer.py)."""
        settings = self.cdi
        reconciler = cdi.CdiReconciler(
            settings, cdi_spec.render_spec(hypervisor, settings.device_uid, settings.device_gid),
            tracker=self.tracker, metrics=self.metrics, warnings=self.warnings, role=role,
            turn=turn)
        return Checks(reconciler, DeviceMonitor(self.tracker, hypervisor, self.health,
                                                metrics=self.metrics))

    def spec(self, name: str, http: HttpSettings, setup: Callable[[str], Awaitable[Started]],
             launch: Launch | None, *, unstarted: Mapping[str, tuple[bool, str]],
             advisory: Mapping[str, tuple[bool, str]] | None = None) -> DaemonSpec[str]:
        """The daemon's spec: it waits for the hypervisor, says so in /readyz meanwhile, and
        lists the exposure warnings. ``unstarted``: its kubelet side's conditions meanwhile;
        ``advisory``: conditions shown, not gating (see DaemonSpec)."""
        return DaemonSpec(
            name, http, self.tracker, self.daemon_metrics,
            functools.partial(wait_for_hypervisor, self.health), setup,
            pending=pending(self.health),
            launch=launch or Launch(), unstarted=unstarted, warnings=self.warnings,
            advisory=advisory)
