"""Repeated log lines, aggregated: a fault that repeats is logged when it first happens, then at
most once per cause per interval, with how many times it happened since its last line.

A file overwritten 100 times a second, or a condition that flaps, is right to repair or
report every time, and the metrics count every event; the log says it once and then counts.
Each cause (a key the caller chooses: a repair's cause, a condition's state and reason) has a
line of its own: one that happened once is logged at once, plainly; a repeat within ``interval``
of its cause's last line waits, counted, for the interval's end (a timer on the running event
loop, or the next line of any cause), and is then logged as the latest such event with
``(N times in the last S s)`` and the field ``repeated=N``. Lines that wait are written oldest
first, so the last one says what happened last.

Use it on the event loop (or one thread): it keeps no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

# How often at most one cause is logged. Prometheus counters see every event at once.
INTERVAL = 60.0
# Causes remembered at once; past it, a new cause shares one line with the others past it.
MAX_CAUSES = 64
_OTHERS = object()
_NOBODY = object()  # no cause's event is happening now (a timer's flush)


@dataclass
class _Cause:
    level: int = logging.INFO
    message: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    waiting: int = 0  # events since the last line, not logged yet
    seen: float = 0.0  # clock() at the latest event
    logged: float | None = None  # clock() at the last line


class RepeatedLines:
    """Writes lines to ``logger`` as the module docstring says; ``clock`` is injectable."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL, *,
                 clock: Callable[[], float] = time.monotonic, max_causes: int = MAX_CAUSES) -> None:
        self.logger = logger
        self.interval = interval
        self.max_causes = max_causes
        self._clock = clock
        self._causes: dict[Hashable, _Cause] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def log(self, key: Hashable, level: int, msg: str, *args: object,
            extra: Mapping[str, Any] | None = None) -> None:
        """One event of cause ``key``, as ``logger.log(level, msg, *args, extra=extra)`` would
        write it: now if its cause is quiet, else counted into the cause's next line."""
        now = self._clock()
        cause = self._causes.get(key)
        if cause is None:
            self._forget_quiet(now)
            if len(self._causes) >= self.max_causes:
                key = _OTHERS
            cause = self._causes.setdefault(key, _Cause())
        cause.level, cause.message, cause.extra = level, msg % args if args else msg, extra or {}
        cause.waiting += 1
        cause.seen = now
        self._write_due(now, fresh=key)
        if cause.waiting:
            self._arm(now)

    def flush(self) -> None:
        """Write the lines whose interval has ended (the timer calls this)."""
        now = self._clock()
        self._write_due(now)
        self._forget_quiet(now)
        if any(c.waiting for c in self._causes.values()):
            self._arm(now)

    def _write_due(self, now: float, fresh: Hashable = _NOBODY) -> None:
        due = [(key, c) for key, c in self._causes.items()
               if c.waiting and (c.logged is None or now - c.logged >= self.interval)]
        for key, cause in sorted(due, key=lambda item: item[1].seen):
            if key == fresh and cause.waiting == 1:  # happening now, first since its last line
                # stacklevel: the record names the line that called log(), as logger.log would.
                self.logger.log(cause.level, "%s", cause.message, extra=cause.extra, stacklevel=3)
            else:
                since = now - (cause.logged if cause.logged is not None else cause.seen)
                self.logger.log(cause.level, "%s (%d %s in the last %.0f s)", cause.message,
                                cause.waiting, "time" if cause.waiting == 1 else "times", since,
                                extra={**cause.extra, "repeated": cause.waiting})
            cause.logged, cause.waiting = now, 0

    def _forget_quiet(self, now: float) -> None:
        """Drop causes with nothing waiting whose interval has ended: their next event is a
        first one again, as it would be if they were kept."""
        for key in [key for key, c in self._causes.items()
                    if not c.waiting and c.logged is not None and now - c.logged >= self.interval]:
            del self._causes[key]

    def _arm(self, now: float) -> None:
        """A timer for the earliest interval to end, on the running loop (none outside one:
        the next line of any cause then writes what is due)."""
        due = min(c.logged for c in self._causes.values() if c.waiting and c.logged is not None)
        due += self.interval
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            if self._timer_loop is loop and self._timer_due <= due:
                return  # one that ends earlier is set
            self._timer.cancel()
        self._timer_due, self._timer_loop = due, loop
        self._timer = loop.call_later(max(due - now, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.flush()
