"""One shape for every condition producer: what wakes a pass, how it is bounded, how its watchers
are kept alive.

A producer runs one *pass* (an async function of its trigger that returns whether its condition
holds) when a watched name changes (inotify through DirWatcher, polling where inotify is missing),
at every tick of ``interval`` seconds (conditions.until_tick: the periodic passes of a process
share a wake-up; with capped exponential backoff while failing, if asked), and on demand
(``check(trigger)``; a gate that needs a fresh answer shares passes through health/fresh.py).
What a pass does that blocks (file systems, ioctls) runs in the producer's BoundedRunner: past
the budget the pass reports its condition failing with the timeout as the reason, and the event
loop, a lock or a caller never waits longer than that.

One vocabulary: a *pass* is one call of the producer's pass function, for one Trigger; a *check*
is the blocking work a pass hands its runner.

Watchers run supervised: one that dies is logged once and restarted; the periodic pass covers the
gap, so a dead watcher never silently leaves a producer on polling alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum

from hlplugin.deviceplugin.health.bounded import BoundedRunner
from hlplugin.deviceplugin.health.conditions import MIN_PERIOD, until_tick
from hlplugin.deviceplugin.health.watch import DirWatcher, Wakeup

log = logging.getLogger(__name__)

FIRST_BACKOFF = 0.1


class Trigger(StrEnum):
    """Why a pass runs (log text and label values: the member's value)."""

    START = "start"  # the first pass of run()
    WATCH = "watch"  # a watched name changed
    PERIODIC = "periodic"  # the interval passed while the condition held
    RETRY = "retry"  # the backoff passed while it failed
    DEMAND = "demand"  # a caller wants a pass now, whatever ran before
    ALLOCATE = "allocate"  # on demand, for an Allocate call


Pass = Callable[[Trigger], Awaitable[bool]]


class Producer:
    """Runs ``one_pass(trigger)`` on its triggers; see the module docstring. ``one_pass`` runs
    its check through ``self.runner`` and records its own outcome (conditions, metrics, logs).

    ``trigger`` says why a pass runs (see ``Trigger``).
    """

    def __init__(self, name: str, one_pass: Pass, *, watch: Sequence[DirWatcher] = (),
                 interval: float = 10.0, max_backoff: float | None = None, budget: float = 2.0,
                 linger: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval = interval
        self.max_backoff = max_backoff
        # The helper waits for the next periodic pass rather than ending and being started
        # again for it: on an idle node a thread start costs more than the pass it runs.
        self.runner = BoundedRunner(budget, name=f"producer-{name}",
                                    linger=max(linger, 2 * interval))
        self.wakeup = Wakeup(*watch)
        self.ok = False
        self.completed_at: float | None = None  # clock() when the latest pass finished
        self._one_pass = one_pass
        self._clock = clock
        self._latest: asyncio.Task[bool] | None = None
        self._tasks: set[asyncio.Task[bool]] = set()

    @property
    def in_flight(self) -> asyncio.Task[bool] | None:
        latest = self._latest
        return latest if latest is not None and not latest.done() else None

    async def check(self, trigger: Trigger) -> bool:
        """A pass now, as its own task: it survives the caller's cancellation, and its result is
        recorded either way. Passes that overlap queue in the runner, within their budgets."""
        task = asyncio.create_task(self._once(trigger), name=f"producer-{self.name}-pass")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._latest = task
        return await asyncio.shield(task)

    async def _once(self, trigger: Trigger) -> bool:
        ok = await self._one_pass(trigger)
        self.ok, self.completed_at = ok, self._clock()
        return ok

    async def run(self) -> None:
        """Pass now (unless one already ran, or runs: then from its result), then on every
        trigger, until cancelled."""
        async with self.wakeup.running():
            backoff = FIRST_BACKOFF
            pulse = self.wakeup.pulse()
            if (first := self.in_flight) is not None:  # e.g. a start's first pass, begun early
                ok = await asyncio.shield(first)
            else:
                ok = self.ok if self.completed_at is not None else await self.check(Trigger.START)
            while True:
                if ok or self.max_backoff is None:  # on the interval's ticks (until_tick)
                    now = asyncio.get_running_loop().time()
                    delay, backoff = until_tick(max(self.interval, MIN_PERIOD), now), FIRST_BACKOFF
                else:
                    delay = min(backoff, self.max_backoff)
                    backoff = min(backoff * 2, self.max_backoff)
                woken = await self.wakeup.wait(pulse, delay)
                pulse = self.wakeup.pulse()  # before the pass: a change during it runs another
                ok = await self.check(Trigger.WATCH if woken else Trigger.PERIODIC if ok else Trigger.RETRY)
