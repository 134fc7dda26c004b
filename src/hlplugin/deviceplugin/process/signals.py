"""SIGTERM and SIGINT as a request to stop, for the whole life of a daemon's process.

asyncio's own signal handlers last as long as its loop: closing the loop puts back the default
action, and a SIGTERM after that kills the process. A daemon whose helper thread is stuck in the
kernel (a hung filesystem) cannot exit until the kernel lets that thread go, so a second SIGTERM
then (the kubelet's, or a test's) would turn a clean stop into death by signal. These handlers are
installed once, before the daemon starts: the first signal asks the running daemon to stop, and
one that comes before it runs makes it stop as soon as it starts. Once the daemon has stopped,
``ignore`` swaps them for SIG_IGN in one step each (no moment with the default action between):
the interpreter's finalization puts back the default action for Python handlers, not for
SIG_IGN, and the process may still wait in the kernel for a stuck thread after that.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The process's SIGTERM and SIGINT handlers; ``connect`` routes them to a running daemon."""

    def __init__(self) -> None:
        self.received = 0
        self._stop: Callable[[], None] | None = None

    def install(self) -> StopSignals:
        """Take over both signals, in the main thread, before the daemon starts."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def connect(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` (from the main thread, between bytecodes: it must only schedule work) for
        each signal from now on, and at once for one that came before."""
        self._stop = stop
        if self.received:
            stop()

    def disconnect(self) -> None:
        self._stop = None

    def ignore(self) -> None:
        """The daemon has stopped: from now until the process is gone, stop signals do nothing."""
        self._stop = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self._stop is not None:
            self._stop()
