"""The hypervisor device's conditions ``device`` and ``host_identity``, fed into a HealthTracker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hlplugin.config import HYPERVISORS, Settings
from hlplugin.deviceplugin.conditions import MIN_PERIOD, HealthState, HealthTracker
from hlplugin.deviceplugin.watch import DirWatcher, wait_event
from hlplugin.probe import BoundedRunner, ProbeError, check_host_identity, probe_device

if TYPE_CHECKING:
    from hlplugin.metrics import Metrics

log = logging.getLogger(__name__)
_DEVICE = "device"
_IDENTITY = "host_identity"


class DeviceMonitor:
    """Feeds conditions "device" and "host_identity" of a HealthTracker.

    Checks run periodically, at once when the device node or its host twin changes, and before an
    Allocate (``ensure_fresh``). Every check runs in one BoundedRunner, so a hung kernel costs at
    most one stuck thread and a "timed out" condition, never a hung daemon. Checks run as their own
    tasks: a caller that gives up (a cancelled Allocate) neither stops a check nor fails the device;
    the result is recorded either way.
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
        self.dev_dir = dev_dir
        self.host_dev_dir = host_dev_dir
        self.interval = interval
        self.budget = budget
        self.metrics = metrics
        self.runner = BoundedRunner(budget, name=f"hlplugin-probe-{hypervisor}")
        self._clock = clock
        self._device_probe = device_probe or functools.partial(
            probe_device, hypervisor, dev_dir, guest_check)
        self._identity_probe = identity_probe
        if identity_probe is None and host_dev_dir is not None:
            self._identity_probe = functools.partial(
                check_host_identity, dev_dir / hypervisor, host_dev_dir / hypervisor)
        self._latest: asyncio.Task[HealthState] | None = None
        self._completed_at: float | None = None
        self._tasks: set[asyncio.Task[HealthState]] = set()
        self.checks = 0  # completed checks, for tests and debugging

    async def check(self) -> HealthState:
        """Run one full check now and record it; the check survives the caller's cancellation."""
        task = asyncio.create_task(self._check_once(), name="hlplugin-device-check")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._latest = task
        return await asyncio.shield(task)

    async def ensure_fresh(self, max_age: float = 1.0) -> HealthState:
        """Health no older than ``max_age``: reuse a recent or in-flight check, else run one.

        A burst of Allocates costs one probe; a cancelled caller leaves the shared check running.
        """
        latest = self._latest
        if latest is not None and not latest.done():
            return await asyncio.shield(latest)
        if self._completed_at is not None and self._clock() - self._completed_at < max_age:
            return self.tracker.state
        return await self.check()

    async def _check_once(self) -> HealthState:
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
        except ProbeError as exc:
            # Timed out: the probe it hung in fails, the ones never reached keep their last state.
            # Stuck before starting: nothing ran, the device is not proven usable.
            stuck = running[-1] if running and exc.step == "timeout" else _DEVICE
            results.setdefault(stuck, (time.monotonic() - started, exc))
        for name, _ in probes:
            if name in results:
                self._record(name, *results[name])
        if self._identity_probe is None:
            self.tracker.set_condition(_IDENTITY, True)
        self._completed_at = self._clock()
        self.checks += 1
        return self.tracker.state

    def _record(self, name: str, duration: float, error: BaseException | None) -> None:
        if self.metrics is not None:
            self.metrics.probe_duration.labels(check=name).observe(duration)
        if error is None:
            self.tracker.set_condition(name, True)
            return
        if isinstance(error, ProbeError):
            reason, text = error.reason, str(error)
        else:  # an injected or unexpected failure: still a failed check, never a crash
            reason, text = "error", f"{type(error).__name__}: {error}"
        if self.metrics is not None:
            self.metrics.probe_failures.labels(reason=reason).inc()
        self.tracker.set_condition(name, False, text)

    async def run(self) -> None:
        """Check now, then every ``interval`` and whenever the node changes, until cancelled."""
        wake = asyncio.Event()
        watchers = [DirWatcher(self.dev_dir, {self.hypervisor})]
        if self.host_dev_dir is not None:
            watchers.append(DirWatcher(self.host_dev_dir, {self.hypervisor}))

        async def feed(watcher: DirWatcher) -> None:
            async for _ in watcher.changes():
                wake.set()

        feeders = [asyncio.create_task(feed(w), name=f"hlplugin-watch-{w.directory}")
                   for w in watchers]
        try:
            while True:
                wake.clear()  # events from here on cause another check after this one
                await self.check()
                await wait_event(wake, max(self.interval, MIN_PERIOD))
        finally:
            for feeder in feeders:
                feeder.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)


def _timed(probe: Callable[[], None]) -> tuple[float, BaseException | None]:
    """Run ``probe`` in the helper thread; its duration and what it raised, if anything."""
    started = time.monotonic()
    try:
        probe()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None
async def wait_for_hypervisor(settings: Settings) -> str:
    """``auto`` with no device yet: stay up (not ready) until /dev/mshv or /dev/kvm appears."""
    found = settings.detect_hypervisor()
    if found is not None:
        return found
    log.warning("no hypervisor device under %s (looked for mshv and kvm); waiting for one",
                settings.dev_dir)
    # aclosing: leaving the loop early must close the watcher now, not whenever the garbage
    # collector finalizes the generator (by then its inotify fd number may belong to another).
    async with contextlib.aclosing(DirWatcher(settings.dev_dir, HYPERVISORS).changes()) as changes:
        async for _ in changes:
            found = settings.detect_hypervisor()
            if found is not None:
                log.info("hypervisor device %s appeared", settings.dev_dir / found)
                return found
    raise AssertionError("unreachable: the watcher never ends")
