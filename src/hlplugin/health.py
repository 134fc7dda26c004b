"""Shared health state: one source of truth for ListAndWatch, Allocate, readiness and metrics.

Conditions are named (``cdi``, ``device``, ``host_identity``, ...). Each producer owns its own
condition and sets it; consumers read one immutable snapshot or wait for the next generation.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from hlplugin.probe import BoundedRunner, ProbeError, check_host_identity, probe_device
from hlplugin.watch import DirWatcher, wait_event

if TYPE_CHECKING:
    from hlplugin.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Condition:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class HealthState:
    """An immutable snapshot; ``generation`` grows by one on every transition."""

    conditions: Mapping[str, Condition] = field(default_factory=dict)
    generation: int = 0

    @property
    def healthy(self) -> bool:
        return bool(self.conditions) and all(c.ok for c in self.conditions.values())

    @property
    def reasons(self) -> dict[str, str]:
        """Failing conditions and why; a condition never reported counts as unknown."""
        return {name: c.reason for name, c in self.conditions.items() if not c.ok}

    def describe(self) -> str:
        """One line a person can act on, e.g. for a FAILED_PRECONDITION message."""
        if self.healthy:
            return "healthy"
        if not self.conditions:
            return "no health check has completed yet"
        return "; ".join(f"{name}: {reason}" for name, reason in sorted(self.reasons.items()))


Listener = Callable[[HealthState, HealthState], None]


class HealthTracker:
    """Holds the conditions; wakes every waiter at once when any of them changes.

    ``required`` conditions start as not ok ("not checked yet"), so nothing is handed out before
    every producer has reported once.
    """

    def __init__(self, required: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        initial = {name: Condition(False, "not checked yet") for name in required}
        self._state = HealthState(MappingProxyType(initial), 0)
        self._changed = asyncio.Event()
        self._listeners: list[Listener] = []
        self.last_check: dict[str, float] = {}

    @property
    def state(self) -> HealthState:
        return self._state

    def add_listener(self, listener: Listener) -> None:
        """Called synchronously with (old, new) on every transition (metrics, logs)."""
        self._listeners.append(listener)

    def set_condition(self, name: str, ok: bool, reason: str = "") -> None:
        """Record a completed check; only a real change bumps the generation and wakes waiters."""
        self.last_check[name] = self._clock()
        new = Condition(ok, "" if ok else (reason or "unknown failure"))
        old_state = self._state
        if old_state.conditions.get(name) == new:
            return
        conditions = dict(old_state.conditions)
        conditions[name] = new
        self._state = HealthState(MappingProxyType(conditions), old_state.generation + 1)
        if ok:
            log.info("condition %s is healthy", name, extra={"condition": name})
        else:
            log.warning(
                "condition %s is unhealthy: %s", name, new.reason,
                extra={"condition": name, "reason": new.reason},
            )
        for listener in self._listeners:
            listener(old_state, self._state)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, generation: int) -> HealthState:
        """Return the first state whose generation differs from ``generation``."""
        while self._state.generation == generation:
            await self._changed.wait()
        return self._state


_DEVICE = "device"
_IDENTITY = "host_identity"

# Periodic loops never run more often than this, whatever interval they are given: the CLI's
# floor is higher (config.INTERVAL_RANGE), this one keeps an in-process caller from a busy loop.
MIN_PERIOD = 0.1


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
