"""The process's signals, for the whole life of a daemon: none but SIGKILL ends it without its stop.

Every signal whose default action would end the process (and leave our socket behind for the
kubelet to find dead) is taken: a stop signal asks the running daemon to stop gracefully, SIGUSR1
logs where every task waits, and the rest are ignored, each logged once by name with its sender.

- Stop: SIGTERM (the kubelet's, at pod deletion) and SIGINT (Ctrl-C); SIGHUP (the terminal or
  session of a daemon run by hand went away; there is nothing to reload: the settings are the
  command line's and the environment's, which cannot change); SIGQUIT (a user asking it to quit,
  by default with a core dump); SIGXCPU (past the soft CPU-time limit; the kernel sends SIGKILL
  at the hard one, so stop while we can remove our socket).
- Ignored: SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF (we set no timers), SIGXFSZ (a write past the
  file-size limit then fails with EFBIG, which its writer reports), SIGIO (no O_ASYNC),
  SIGPWR, SIGSTKFLT and SIGRTMIN..SIGRTMAX: nothing of ours sends or expects them.

How: ``install`` blocks them all in the main thread before any other thread starts (each thread
inherits the mask, gRPC's included), and one thread takes them with ``sigwaitinfo``. No handler
runs asynchronously: a Python handler runs on the main thread between the event loop's steps (a
flood delays its work), C-level handlers of different signals nest on faulthandler's small
alternate stack (with a handler per signal, 31 real-time signals at once crashed a daemon with
SIGSEGV), and asyncio's wakeup pipe closes with its loop before its handlers are unset. A blocked
signal is never discarded by the kernel, also where the daemon is PID 1 of a pod (there the kernel
drops a signal whose action is the default). After the first stop signal the thread stops taking
stop signals: they stay blocked, and every later one merges into the one pending (a standard signal
is one bit), so a flood costs the daemon nothing while it stops, and after it has stopped nothing
can kill it with them: a process waiting in the kernel for a helper stuck on a hung filesystem
exits once it can. A stop signal that comes before the daemon runs makes it stop as soon as it
starts. A child process would inherit the mask: a daemon that ever starts one must unblock them in
it (posix_spawn's setsigmask); none does today.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGXCPU)
DUMP_SIGNAL = signal.SIGUSR1
IGNORED_SIGNALS = (signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXFSZ,
                   signal.SIGIO, signal.SIGPWR, signal.SIGSTKFLT,
                   *range(signal.SIGRTMIN, signal.SIGRTMAX + 1))
TAKEN = frozenset((*STOP_SIGNALS, DUMP_SIGNAL, *IGNORED_SIGNALS))


def signal_name(signum: int) -> str:
    """``SIGHUP``; a real-time signal as ``SIGRTMIN+n`` (the kernel's numbers: glibc's own two
    below SIGRTMIN are never ours)."""
    if signal.SIGRTMIN < signum < signal.SIGRTMAX:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """The process's signals, taken by one thread; ``connect`` routes them to a running daemon."""

    def __init__(self) -> None:
        self.received = 0  # stop signals
        self._stop: Callable[[], None] | None = None
        self._dump: Callable[[], None] | None = None
        self._ignored: set[int] = set()
        self._thread: threading.Thread | None = None

    def install(self) -> StopSignals:
        """Take every signal in TAKEN for good: in the main thread, before any other starts."""
        signal.pthread_sigmask(signal.SIG_BLOCK, TAKEN)
        self._thread = threading.Thread(target=self._take, name="signals", daemon=True)
        self._thread.start()
        return self

    def connect(self, stop: Callable[[], None], dump: Callable[[], None] | None = None) -> None:
        """Call ``stop`` for a stop signal from now on, and at once for one that came before;
        ``dump`` for SIGUSR1. Both are called from the signals' thread: they must be thread-safe
        (e.g. ``loop.call_soon_threadsafe``)."""
        self._dump = dump
        self._stop = stop
        if self.received:
            stop()

    def disconnect(self) -> None:
        self._stop = self._dump = None

    def ignore(self) -> None:
        """The daemon has stopped: from now until the process is gone, stop signals do nothing."""
        self.disconnect()

    def _take(self) -> None:
        waiting = set(TAKEN)
        while True:
            signum = signal.sigwaitinfo(waiting).si_signo
            if signum in STOP_SIGNALS:
                # Left blocked from now on, never taken again: see the module's docstring.
                waiting.difference_update(STOP_SIGNALS)
                self._call(self._on_stop, signum)
            elif signum == DUMP_SIGNAL and self._dump is not None:
                self._call(self._dump)
            elif signum not in self._ignored:
                self._ignored.add(signum)
                log.warning("ignored %s: this daemon acts on SIGTERM, SIGINT, SIGHUP, SIGQUIT and "
                            "SIGXCPU (stop) and SIGUSR1 (log every task); later %s are ignored "
                            "without a line", signal_name(signum), signal_name(signum),
                            extra={"signal": signal_name(signum)})

    def _on_stop(self, signum: int) -> None:
        self.received += 1
        log.info("received %s: stopping", signal_name(signum), extra={"signal": signal_name(signum)})
        stop = self._stop
        if stop is not None:
            stop()

    @staticmethod
    def _call(function: Callable[..., None], *args: int) -> None:
        """The thread must go on taking signals whatever a callback raises (a loop that closed)."""
        try:
            function(*args)
        except Exception:
            log.exception("handling a signal failed")
