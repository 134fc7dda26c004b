"""The hypervisor device's conditions ``device`` and ``host_identity``, fed into a HealthTracker.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hlplugin.deviceplugin.health.bounded import CheckFailed
from hlplugin.deviceplugin.health.conditions import Condition, HealthState, HealthTracker
from hlplugin.deviceplugin.health.fresh import Fresh
from hlplugin.deviceplugin.health.producer import Producer, Trigger
from hlplugin.deviceplugin.health.watch import DirWatcher
from hlplugin.names import ConditionName
from hlplugin.probe import check_host_identity, close_deferred, probe_device
from hlplugin.settings import HealthSettings

if TYPE_CHECKING:
    from hlplugin.metrics import ProofMetrics

log = logging.getLogger(__name__)
_DEVICE = ConditionName.DEVICE
_IDENTITY_OFF = "the host identity check is off (--host-dev-dir is empty)"
_IDENTITY = ConditionName.HOST_IDENTITY


class DeviceMonitor:
    """Feeds conditions "device" and "host_identity" of a HealthTracker: a pass on a Producer.

    Checks run periodically, at once when the device node or its host twin changes, and in every
    Allocate (``for_allocate``: without the guest run). Every check runs in the producer's
    BoundedRunner (the periodic and the Allocate checks alike, one helper), so a hung kernel
    costs at most one stuck thread and a "timed out" condition, never a hung daemon. Checks run as
    their own tasks: a caller that gives up (a cancelled Allocate) neither stops a check nor fails
    the device; the result is recorded either way.
    """

    CONDITIONS = (ConditionName.DEVICE, ConditionName.HOST_IDENTITY)

    def __init__(
        self,
        tracker: HealthTracker,
        hypervisor: str,
        settings: HealthSettings,
        *,
        metrics: ProofMetrics | None = None,
        device_probe: Callable[[], None] | None = None,
        identity_probe: Callable[[], None] | None = None,
        allocate_probe: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.hypervisor = hypervisor
        self.metrics = metrics
        dev_dir, host_dev_dir, guest_check = settings.dev_dir, settings.host_dev_dir, settings.guest_check
        self._device_probe = device_probe or functools.partial(
            probe_device, hypervisor, dev_dir, guest_check)
        # Allocate's own check: the upstream one (no guest run), injectable like the others.
        self._allocate_probe = allocate_probe or (
            device_probe if device_probe is not None
            else functools.partial(probe_device, hypervisor, dev_dir, False, close_later=True))
        self._identity_probe = identity_probe
        if identity_probe is None and host_dev_dir is not None:
            self._identity_probe = functools.partial(
                check_host_identity, dev_dir / hypervisor, host_dev_dir / hypervisor)
        watch = [DirWatcher(dev_dir, {hypervisor})]
        if host_dev_dir is not None:
            watch.append(DirWatcher(host_dev_dir, {hypervisor}))
        # A helper thread lingers between checks, so one check per Allocate starts no thread.
        self.producer = Producer(f"probe-{hypervisor}", self._pass, watch=watch,
                                 interval=settings.interval, budget=settings.probe_timeout,
                                 linger=1.0, clock=clock)
        self.runner = self.producer.runner
        self.runner.after = close_deferred  # the Allocate check's VM closes after its answer
        self._allocate_checks = Fresh(self._allocate_check, name="hlplugin-allocate-check")
        if metrics is not None:  # looked up once: two observations per Allocate
            self._durations: dict[str, Any] = {name: metrics.probe_duration.labels(check=name)
                                               for name in (_DEVICE, _IDENTITY)}

    async def check(self) -> HealthState:
        """Run one full check now and record it; the check survives the caller's cancellation."""
        await self.producer.check(Trigger.DEMAND)
        return self.tracker.state

    async def for_allocate(self) -> HealthState:
        """The device (and host identity) as a check that began after this call finds them: the
        upstream check (no guest run; the periodic check runs the guest). Concurrent callers share
        the check in flight if it began after they called, else the next one; a caller that gives
        up leaves it running. The answer is that check's own, never a later or earlier one's.

        A failure is recorded at once (every stream goes Unhealthy). A success while a condition
        is failing (the guest failed, or an earlier Allocate's check did) runs the full check, so
        the device comes back only as the periodic check would bring it back."""
        return await self._allocate_checks.fresh()

    async def run(self) -> None:
        """Check now (unless a check already ran), then every ``interval`` and whenever the node
        changes, until cancelled."""
        await self.producer.run()

    def _probes(self, device_probe: Callable[[], None]) -> list[tuple[str, Callable[[], None]]]:
        probes: list[tuple[str, Callable[[], None]]] = []
        # Identity first: a stat does not hang, so it is known even when the device probe does.
        if self._identity_probe is not None:
            probes.append((_IDENTITY, self._identity_probe))
        probes.append((_DEVICE, device_probe))
        return probes

    async def _allocate_check(self) -> HealthState:
        results = await self._run(self._probes(self._allocate_probe))
        conditions = self.tracker.state.conditions
        if all(error is None for _, error in results.values()) and not all(
                conditions[name].ok for name in (_DEVICE, _IDENTITY) if name in conditions):
            results = await self._run(self._probes(self._device_probe))
        for name, (duration, error) in results.items():
            self._record(name, duration, error)
        if self._identity_probe is None:
            self.tracker.set_condition(_IDENTITY, True, off=_IDENTITY_OFF)
        # This check's own answer, whatever else was recorded while it ran.
        answer = dict(self.tracker.state.conditions)
        answer.update({name: Condition(error is None, "" if error is None else _reason(error)[1])
                       for name, (_, error) in results.items()})
        return HealthState(answer, self.tracker.state.generation)

    async def _pass(self, trigger: Trigger) -> bool:
        for name, (duration, error) in (await self._run(self._probes(self._device_probe))).items():
            self._record(name, duration, error)
        if self._identity_probe is None:
            self.tracker.set_condition(_IDENTITY, True, off=_IDENTITY_OFF)
        return self.tracker.state.healthy

    async def _run(self, probes: list[tuple[str, Callable[[], None]]]
                   ) -> dict[str, tuple[float, BaseException | None]]:
        """Run ``probes`` in order in one helper of the runner: each one's duration and error."""
        results: dict[str, tuple[float, BaseException | None]] = {}
        running: list[str] = []

        def helper() -> None:  # in the runner's thread: only fills ``results``
            for name, probe in probes:
                running.append(name)
                results[name] = _timed(probe)

        started = time.monotonic()
        try:
            await self.runner.run(helper)
        except CheckFailed as exc:
            # Timed out: the probe it hung in fails, the ones never reached keep their last state.
            # Stuck before starting: nothing ran, the device is not proven usable.
            stuck = running[-1] if running and exc.step == "timeout" else _DEVICE
            results.setdefault(stuck, (time.monotonic() - started, exc))
        return {name: results[name] for name, _ in probes if name in results}

    def _record(self, name: str, duration: float, error: BaseException | None) -> None:
        if self.metrics is not None:
            self._durations[name].observe(duration)
        if error is None:
            self.tracker.set_condition(name, True)
            return
        reason, text = _reason(error)
        if self.metrics is not None:
            self.metrics.probe_failures.labels(reason=reason).inc()
        self.tracker.set_condition(name, False, text)


def _reason(error: BaseException) -> tuple[str, str]:
    """A failed check's metric reason and message."""
    if isinstance(error, CheckFailed):
        return error.reason, str(error)
    # An injected or unexpected failure: still a failed check, never a crash.
    return "error", f"{type(error).__name__}: {error}"


def _timed(probe: Callable[[], None]) -> tuple[float, BaseException | None]:
    """Run ``probe`` in the helper thread; its duration and what it raised, if anything."""
    started = time.monotonic()
    try:
        probe()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None
