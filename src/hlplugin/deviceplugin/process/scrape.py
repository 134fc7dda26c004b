"""/metrics kept behind the kubelet's calls: scrapes are answered at a pace, on the daemon's loop.

50 clients scraping in a loop (800 scrapes/s) took the main daemon's Allocate p99 from 5 to 151 ms:
a render costs about 1.5 ms of the event loop (the process collector reads /proc), the loop that
also answers the kubelet. Measured alternatives: rendering at most once a second let the storm
make 2,300 requests a second, and accepting, parsing and answering those filled the loop (p99
91 ms); HTTP on a thread and loop of its own left the two fighting over the interpreter (p99
12-35 ms). Pacing the answers does what neither does: each scraper waits for its answer, so a
storm slows to the pace and costs the loop next to nothing (p99 2-9 ms), /healthz and /readyz are
answered at once, and the loop still proves it turns. Prometheus scrapes a target every 15 s or
more, far under the pace, and a render is always fresh. A scrape's wait for its turn is the
storm's doing, so it does not count against the request's deadline (http.py): with 100 clients
in a loop it is about 5 s, and counted it dropped most of a Prometheus' scrapes unanswered.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable


class Pacer:
    """Runs callbacks at most ``per_second`` a second, ``burst`` at once (a token bucket), in the
    order they came; the rest wait. A small burst spreads renders out: 20 back to back held the
    loop for 30 ms. A callback returns False when it had nothing left to do (its client went),
    and then costs no turn; ``cancel`` forgets one at once, so at most as many wait as
    connections are open (kept till their turn, clients that sent a scrape and left at once held
    64 MiB after 15 s beside a storm)."""

    def __init__(self, per_second: float, burst: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.refilled = clock()
        # Insertion-ordered, and O(1) to forget any one: a bound method is equal to another of
        # the same object and function, so the caller cancels with the callback it ran.
        self.waiting: collections.OrderedDict[Callable[[], bool], None] = collections.OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    def run(self, callback: Callable[[], bool]) -> None:
        self.waiting[callback] = None
        if self._timer is None:
            self._drain()

    def cancel(self, callback: Callable[[], bool]) -> None:
        """``callback`` is not to run after all (its client went)."""
        self.waiting.pop(callback, None)

    def _drain(self) -> None:
        self._timer = None
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.refilled) * self.per_second)
        self.refilled = now
        while self.waiting and self.tokens >= 1:
            if self.waiting.popitem(last=False)[0]():
                self.tokens -= 1
        if self.waiting:
            delay = (1 - self.tokens) / self.per_second
            self._timer = asyncio.get_running_loop().call_later(delay, self._drain)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.waiting.clear()
