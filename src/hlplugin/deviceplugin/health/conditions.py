"""Health conditions: one source of truth for ListAndWatch, Allocate, readiness and metrics.

Conditions are named; each producer owns its own condition and sets it; consumers read one
immutable snapshot or wait for the next generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hlplugin.deviceplugin.health import repeats

log = logging.getLogger(__name__)

# Periodic loops never run more often than this, whatever interval they are given: the CLI's
# floor is higher, this one keeps an in-process caller from a busy loop.
MIN_PERIOD = 0.1


def until_tick(period: float, now: float) -> float:
    """Seconds from ``now`` to the next multiple of ``period`` (at least MIN_PERIOD away).

    Periodic work waits for these ticks of the loop's clock instead of ``period`` after its last
    pass, so one process's periodic checks of the same period share one wake-up: on an idle node
    the wake-ups, not the checks, are most of what a daemon costs (docs/benchmarks.md).
    """
    delay = period - now % period
    return delay if delay >= MIN_PERIOD else delay + period


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

    def __init__(self, required: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic,
                 *, log_interval: float = repeats.INTERVAL) -> None:
        self._clock = clock
        self.lines = repeats.RepeatedLines(log, log_interval, clock=clock)
        # Names kept as plain strings: a daemon's names may be an enum's members, whose repr
        # would otherwise reach log fields and label values.
        initial = {str(name): Condition(False, "not checked yet") for name in required}
        self._state = HealthState(MappingProxyType(initial), 0)
        self._changed = asyncio.Event()
        self._listeners: list[Listener] = []

    @property
    def state(self) -> HealthState:
        return self._state

    def add_listener(self, listener: Listener) -> None:
        """Called synchronously with (old, new) on every transition (metrics, logs)."""
        self._listeners.append(listener)

    def set_condition(self, name: str, ok: bool, reason: str = "", *, off: str = "") -> None:
        """Record a completed check; only a real change bumps the generation and wakes waiters.
        ``off`` says why a condition is switched off: it holds, and its reason says so."""
        name = str(name)
        if off:
            ok, reason = True, f"off: {off}"
        new = Condition(ok, reason if off else "" if ok else (reason or "unknown failure"))
        old_state = self._state
        if old_state.conditions.get(name) == new:
            return
        conditions = dict(old_state.conditions)
        conditions[name] = new
        self._state = HealthState(MappingProxyType(conditions), old_state.generation + 1)
        # Each state (and reason) its own cause: a flap is logged when it first happens, then
        # counted, at most one line per state and interval; the listeners see every transition.
        if off:
            log.info("condition %s is off: %s", name, off, extra={"condition": name})
        elif ok:
            self.lines.log((name, True), logging.INFO, "condition %s is healthy", name,
                           extra={"condition": name})
        else:
            self.lines.log(
                (name, False, new.reason), logging.WARNING, "condition %s is unhealthy: %s", name,
                new.reason, extra={"condition": name, "reason": new.reason},
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
