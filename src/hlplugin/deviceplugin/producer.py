"""One shape for every condition producer: what wakes a pass, how it is bounded, how its watchers
are kept alive.

A producer runs one *pass* (an async function of its trigger that returns whether its condition
holds) when a watched name changes (inotify through DirWatcher, polling where inotify is missing),
every ``interval`` seconds (with capped exponential backoff while failing, if asked), and on
demand (``ensure(max_age)``: a pass that began at most ``max_age`` before the call, in flight or
done, is shared, so a burst of callers costs one pass, and a caller that gives up never stops
it). Passes that block (file systems, ioctls) run in the producer's BoundedRunner: past the
budget the pass reports its condition failing with the timeout as the reason, and the event loop,
a lock or a caller never waits longer than that.

Watchers run supervised: one that dies is logged once and restarted; the periodic pass covers the
gap, so a dead watcher never silently leaves a producer on polling alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import select
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NoReturn

from hlplugin.deviceplugin.bounded import BoundedRunner
from hlplugin.deviceplugin.conditions import MIN_PERIOD
from hlplugin.deviceplugin.watch import DirWatcher, wait_event

log = logging.getLogger(__name__)

FIRST_BACKOFF = 0.1


async def supervise(name: str, child: Callable[[], Awaitable[object]], *,
                    restart_after: float = 1.0) -> NoReturn:
    """Run ``child()`` for ever: when it raises or returns, log that once (later failures at
    debug level) and start it again after ``restart_after`` seconds. Cancellation ends it."""
    failures = 0
    while True:
        try:
            await child()
            problem = "it ended"
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        failures += 1
        log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                "%s failed (%s); restarting it, periodic checks cover the gap", name, problem,
                extra={"task": name})
        await asyncio.sleep(max(restart_after, MIN_PERIOD))


class Wakeup:
    """Watchers turned into a wake-up that is safe to wait on with a timeout.

    Take ``pulse()`` before looking at the filesystem, then ``wait(pulse, timeout)``: an event
    that lands between the look and the wait still wakes the waiter. ``running()`` keeps the
    watchers alive (supervised) for as long as its block lasts.
    """

    def __init__(self, *watchers: DirWatcher) -> None:
        self.watchers = watchers
        self._event = asyncio.Event()

    def pulse(self) -> asyncio.Event:
        return self._event

    async def wait(self, pulse: asyncio.Event, limit: float) -> bool:
        """True when woken, False when ``limit`` passed first."""
        return await wait_event(pulse, limit)

    def live(self) -> bool:
        """Every watcher is live on inotify: a change cannot pass unseen (a poll would add nothing)."""
        return bool(self.watchers) and all(w.live_fd is not None for w in self.watchers)

    def quiet_since(self, pulse: asyncio.Event) -> bool:
        """No watched change since ``pulse`` was taken, as far as the kernel knows right now:
        not woken since, every watcher live on inotify, and no event waiting unread. Polls the
        inotify fds; never touches the watched file systems."""
        if pulse.is_set() or not self.watchers:
            return False
        fds = [w.live_fd for w in self.watchers if w.live_fd is not None]
        if len(fds) < len(self.watchers):
            return False
        readable, _, _ = select.select(fds, [], [], 0)
        return not readable

    def fire(self) -> None:
        """Wake the waiters now, as a watched change would (for changes seen elsewhere)."""
        fired, self._event = self._event, asyncio.Event()
        fired.set()

    async def _feed(self, watcher: DirWatcher) -> None:
        async for _ in watcher.changes():
            self.fire()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Wakeup]:
        tasks = [asyncio.create_task(
            supervise(f"watching {w.directory}", functools.partial(self._feed, w),
                      restart_after=w.poll_interval),
            name=f"watch {w.directory}") for w in self.watchers]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)  # never swallows a cancellation of our own


Pass = Callable[[str], Awaitable[bool]]


class Producer:
    """Runs ``step(trigger)`` on its triggers; see the module docstring. ``step`` runs blocking
    work through ``self.runner`` and records its own outcome (conditions, metrics, logs).

    ``trigger`` is "start" for the first pass of run(), "watch" after a watched change,
    "periodic" (or "retry" while failing) after a timeout, and ``ensure``'s own for one on demand.
    """

    def __init__(self, name: str, step: Pass, *, watch: Sequence[DirWatcher] = (),
                 interval: float = 10.0, max_backoff: float | None = None, budget: float = 2.0,
                 linger: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval = interval
        self.max_backoff = max_backoff
        self.runner = BoundedRunner(budget, name=f"producer-{name}", linger=linger)
        self.wakeup = Wakeup(*watch)
        self.ok = False
        self.completed_at: float | None = None  # clock() when the latest pass finished
        self._completed_began: float | None = None  # clock() when that pass began
        self._began = 0.0  # clock() when the latest pass (maybe in flight) began
        self.passes = 0
        self._step = step
        self._clock = clock
        self._latest: asyncio.Task[bool] | None = None
        self._tasks: set[asyncio.Task[bool]] = set()

    @property
    def in_flight(self) -> asyncio.Task[bool] | None:
        latest = self._latest
        return latest if latest is not None and not latest.done() else None

    async def check(self, trigger: str) -> bool:
        """A pass now, as its own task: it survives the caller's cancellation, and its result is
        recorded either way. Passes that overlap queue in the runner, within their budgets."""
        self._began = began = self._clock()
        task = asyncio.create_task(self._once(trigger, began), name=f"producer-{self.name}-pass")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._latest = task
        return await asyncio.shield(task)

    async def ensure(self, max_age: float, trigger: str = "ensure") -> bool:
        """The result of a pass that began at most ``max_age`` before this call: the pass in
        flight or the latest one if it qualifies, else a new one. A success from a pass in flight
        that began earlier is not trusted (it may have looked before a change): the callers it
        held share the one pass after it. Its failure stands, since refusing on it is safe (and
        a stuck check then costs a caller one budget, not two)."""
        since = self._clock() - max_age
        while (latest := self.in_flight) is not None:
            began = self._began
            ok = await asyncio.shield(latest)
            if began >= since or not ok:
                return ok
        if self._completed_began is not None and self._completed_began >= since:
            return self.ok
        return await self.check(trigger)

    async def _once(self, trigger: str, began: float) -> bool:
        ok = await self._step(trigger)
        self.ok, self.completed_at, self._completed_began = ok, self._clock(), began
        self.passes += 1
        return ok

    async def run(self) -> None:
        """Pass now (unless one already ran), then on every trigger, until cancelled."""
        async with self.wakeup.running():
            backoff = FIRST_BACKOFF
            pulse = self.wakeup.pulse()
            ok = self.ok if self.completed_at is not None else await self.check("start")
            while True:
                if ok or self.max_backoff is None:
                    delay, backoff = max(self.interval, MIN_PERIOD), FIRST_BACKOFF
                else:
                    delay = min(backoff, self.max_backoff)
                    backoff = min(backoff * 2, self.max_backoff)
                woken = await self.wakeup.wait(pulse, delay)
                pulse = self.wakeup.pulse()  # before the pass: a change during it runs another
                ok = await self.check("watch" if woken else "periodic" if ok else "retry")
