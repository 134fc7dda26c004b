"""What a test can leave in the process for the tests after it: an event loop that still holds a
closed file descriptor, and threads, sockets or signal handlers that outlive their module.

A socket closed while a reader is still registered on it leaves the loop's selector a stale key:
the next socket opened under the same fd number is then "registered" without reaching epoll and
never sees an event (the emulator came back deaf this way after a reset, in 3 of 3 full runs, once
another module had shifted the process's fd numbers)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass

from hlplugin.deviceplugin.health.bounded import BoundedRunner

# Sockets enough to take any fd number a closed socket just freed (the lowest free numbers).
_PROBES = 16


async def new_sockets_hear(timeout: float = 10.0) -> bool:
    """Do sockets opened now, under the lowest free fd numbers, get their events? Each of
    ``_PROBES`` socket pairs registers a reader and is written to; all must be read."""
    loop = asyncio.get_running_loop()
    pairs = [socket.socketpair() for _ in range(_PROBES)]
    heard: list[asyncio.Future[None]] = []
    try:
        for ours, _ in pairs:
            ours.setblocking(False)
            future: asyncio.Future[None] = loop.create_future()
            loop.add_reader(ours, _settle, future)
            heard.append(future)
        for _, theirs in pairs:
            theirs.send(b"x")
        done, _ = await asyncio.wait(heard, timeout=timeout)
        return len(done) == len(heard)
    finally:
        for ours, theirs in pairs:
            loop.remove_reader(ours)
            ours.close()
            theirs.close()


def _lingers(thread: threading.Thread) -> bool:
    """``thread`` is a BoundedRunner helper that lingers by design (its target, which Thread keeps
    while it runs, is the runner's serve loop)."""
    target = getattr(thread, "_target", None)
    return getattr(target, "__func__", None) is BoundedRunner._serve


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class ProcessState:
    """What one module's tests must give back: the threads, open sockets and signal handlers."""

    threads: frozenset[str]
    sockets: int
    handlers: tuple[object, ...]

    @classmethod
    def now(cls) -> ProcessState:
        """Threads that may outlive their test by design are left out: a health check's helper
        that lingers, idle and holding no file, for its producer's next pass (bounded.py)."""
        sockets = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                sockets += stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode)
            except OSError:
                continue  # the listing's own fd, closed since
        return cls(frozenset(f"{t.name} ({t.ident})" for t in threading.enumerate()
                             if not _lingers(t)), sockets,
                   tuple(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                       signal.SIGHUP, signal.SIGPIPE)))

    @classmethod
    def settled(cls, before: ProcessState, wait: float = 10.0) -> ProcessState:
        """The state once garbage is collected (a socket in a reference cycle is not left) and
        the threads started since ``before`` had up to ``wait`` seconds in all to end (a helper
        finishing its last call is not left either)."""
        gc.collect()
        deadline = time.monotonic() + wait
        for thread in threading.enumerate():
            # A lingering helper is not waited for: it ends only when its runner is collected,
            # and waiting for it cost each module that used one the whole ``wait`` (10 s).
            if f"{thread.name} ({thread.ident})" not in before.threads and not _lingers(thread):
                thread.join(max(0.0, deadline - time.monotonic()))
        gc.collect()
        return cls.now()

    def left_since(self, before: ProcessState) -> list[str]:
        """What is here now that was not ``before``, in words; empty when nothing."""
        left = [f"thread {t}" for t in sorted(self.threads - before.threads)]
        if self.sockets > before.sockets:
            left.append(f"{self.sockets - before.sockets} open socket(s)")
        if self.handlers != before.handlers:
            left.append(f"signal handlers {before.handlers} -> {self.handlers}")
        return left
