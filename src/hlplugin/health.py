"""The hypervisor device's conditions ``device`` and ``host_identity``, fed into a HealthTracker.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hlplugin.deviceplugin.bounded import CheckFailed
from hlplugin.deviceplugin.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.producer import Producer
from hlplugin.deviceplugin.watch import DirWatcher
from hlplugin.probe import check_host_identity, probe_device

if TYPE_CHECKING:
    from hlplugin.metrics import Metrics

log = logging.getLogger(__name__)
_DEVICE = "device"
_IDENTITY = "host_identity"


class DeviceMonitor:
    """Feeds conditions "device" and "host_identity" of a HealthTracker: a pass on a Producer.

    Checks run periodically, at once when the device node or its host twin changes, and before an
    Allocate (``ensure_fresh``). Every check runs in the producer's BoundedRunner, so a hung kernel
    costs at most one stuck thread and a "timed out" condition, never a hung daemon. Checks run as
    their own tasks: a caller that gives up (a cancelled Allocate) neither stops a check nor fails
    the device; the result is recorded either way.
    """

    def __init__(
        self,
        tracker: HealthTracker,
        hypervisor: str,
        dev_dir: Path,
        host_dev_dir: Path | None,
        *,
        interval: float = 10.0,
        budget: float = 2.0,
        guest_check: bool = True,
        metrics: Metrics | None = None,
        device_probe: Callable[[], None] | None = None,
        identity_probe: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.hypervisor = hypervisor
        self.metrics = metrics
        self._device_probe = device_probe or functools.partial(
            probe_device, hypervisor, dev_dir, guest_check)
        self._identity_probe = identity_probe
        if identity_probe is None and host_dev_dir is not None:
            self._identity_probe = functools.partial(
                check_host_identity, dev_dir / hypervisor, host_dev_dir / hypervisor)
        watch = [DirWatcher(dev_dir, {hypervisor})]
        if host_dev_dir is not None:
            watch.append(DirWatcher(host_dev_dir, {hypervisor}))
        self.producer = Producer(f"probe-{hypervisor}", self._pass, watch=watch,
                                 interval=interval, budget=budget, clock=clock)
        self.runner = self.producer.runner

    @property
    def checks(self) -> int:
        """Completed checks, for tests and debugging."""
        return self.producer.passes

    async def check(self) -> HealthState:
        """Run one full check now and record it; the check survives the caller's cancellation."""
        await self.producer.check("demand")
        return self.tracker.state

    async def ensure_fresh(self, max_age: float = 1.0) -> HealthState:
        """Health from a check that began at most ``max_age`` ago: a recent or in-flight one,
        else a new one (a success that began earlier is not trusted; see Producer.ensure).

        A burst of Allocates costs one probe; a cancelled caller leaves the shared check running.
        """
        await self.producer.ensure(max_age)
        return self.tracker.state

    async def run(self) -> None:
        """Check now (unless a check already ran), then every ``interval`` and whenever the node
        changes, until cancelled."""
        await self.producer.run()

    async def _pass(self, trigger: str) -> bool:
        probes: list[tuple[str, Callable[[], None]]] = []
        # Identity first: a stat does not hang, so it is known even when the device probe does.
        if self._identity_probe is not None:
            probes.append((_IDENTITY, self._identity_probe))
        probes.append((_DEVICE, self._device_probe))
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
        for name, _ in probes:
            if name in results:
                self._record(name, *results[name])
        if self._identity_probe is None:
            self.tracker.set_condition(_IDENTITY, True)
        return self.tracker.state.healthy

    def _record(self, name: str, duration: float, error: BaseException | None) -> None:
        if self.metrics is not None:
            self.metrics.probe_duration.labels(check=name).observe(duration)
        if error is None:
            self.tracker.set_condition(name, True)
            return
        if isinstance(error, CheckFailed):
            reason, text = error.reason, str(error)
        else:  # an injected or unexpected failure: still a failed check, never a crash
            reason, text = "error", f"{type(error).__name__}: {error}"
        if self.metrics is not None:
            self.metrics.probe_failures.labels(reason=reason).inc()
        self.tracker.set_condition(name, False, text)


def _timed(probe: Callable[[], None]) -> tuple[float, BaseException | None]:
    """Run ``probe`` in the helper thread; its duration and what it raised, if anything."""
    started = time.monotonic()
    try:
        probe()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None
