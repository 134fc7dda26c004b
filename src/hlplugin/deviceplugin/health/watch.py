"""Directory watching for asyncio: inotify when the kernel gives it, polling when it does not.

Consumers never trust an event's details: an event only says "look again at these names", and the
consumer re-reads the filesystem. That keeps the polling fallback and inotify equivalent, and makes
a flood of events cost one re-check per batch. ``Wakeup`` turns watchers into one wake-up that is
safe to wait on with a timeout, and keeps them running (``supervise``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import logging
import os
import select
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import NoReturn

import inotify_simple

from hlplugin.deviceplugin.health.conditions import MIN_PERIOD

log = logging.getLogger(__name__)

# inotify_simple finds libc with ctypes.util.find_library("c"), which runs `ldconfig -p` in a
# subprocess at the first INotify: milliseconds on the event loop, before a daemon registers.
# The process has libc loaded already: it gets that one (as ownedfile's renameat2 does).
if getattr(inotify_simple, "_libc", False) is None:
    inotify_simple._libc = ctypes.CDLL(None, use_errno=True)

# Entries created, removed, renamed or re-permissioned. Enough for sockets and device nodes, and
# it leaves out open/close/write, which every user of a device node causes.
NODE_EVENTS = (
    inotify_simple.flags.CREATE
    | inotify_simple.flags.DELETE
    | inotify_simple.flags.MOVED_FROM
    | inotify_simple.flags.MOVED_TO
    | inotify_simple.flags.ATTRIB
)
# Regular files we own: also writes, so in-place tampering is seen at once.
FILE_EVENTS = NODE_EVENTS | inotify_simple.flags.MODIFY | inotify_simple.flags.CLOSE_WRITE
_SELF = inotify_simple.flags.DELETE_SELF | inotify_simple.flags.MOVE_SELF
_GONE = inotify_simple.flags.IGNORED | inotify_simple.flags.DELETE_SELF | inotify_simple.flags.MOVE_SELF
# add_watch failures that mean "no directory there (yet)"; any other is logged and polled past.
_MISSING = frozenset({errno.ENOENT, errno.ENOTDIR})
_HINTS = {errno.ENOSPC: " (the user's inotify watches are used up: fs.inotify.max_user_watches)"}


def _signature(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns, st.st_rdev)


class DirWatcher:
    """Yields sets of changed names among ``names`` (all names when ``names`` is None) in ``directory``.

    A directory that is missing, deleted or replaced is waited for (the watch is tried again every
    ``poll_interval``) and watched again; its (re)appearance reports every name, since anything in
    it may be new.
    """

    def __init__(
        self,
        directory: Path,
        names: Collection[str] | None = None,
        *,
        poll_interval: float = 1.0,
        use_inotify: bool = True,
        events: int = NODE_EVENTS,
    ) -> None:
        self.directory = directory
        self.events = events | _SELF
        self.names = frozenset(names) if names is not None else None
        self.poll_interval = poll_interval
        self.use_inotify = use_inotify
        # The inotify fd while a watch on the directory is in place (else None): readable when
        # the kernel holds events not yet read, which lets a caller tell "nothing changed since"
        # without touching the file system.
        self.live_fd: int | None = None

    def _all(self) -> set[str]:
        if self.names is not None:
            return set(self.names)
        with contextlib.suppress(OSError):
            return set(os.listdir(self.directory)) | {""}
        return {""}

    async def changes(self) -> AsyncGenerator[set[str], None]:
        if self.use_inotify:
            try:
                inotify = inotify_simple.INotify(nonblocking=True)
            except OSError as exc:
                log.warning("inotify unavailable (%s); polling %s every %.1fs", exc, self.directory,
                            self.poll_interval)
            else:
                # Closed in this order: the inner generator removes its reader from the event loop
                # before the inotify fd closes (a closed fd left registered deafens the next file
                # opened under its number).
                with inotify:
                    async with contextlib.aclosing(self._inotify(inotify)) as batches:
                        async for batch in batches:
                            yield batch
                # Ended: the kernel would not add the watch (and said so once). Poll instead.
        async for batch in self._poll():
            yield batch

    async def _inotify(self, inotify: inotify_simple.INotify) -> AsyncGenerator[set[str], None]:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = inotify.fileno()  # kept: the file may be closed before this generator is finalized
        loop.add_reader(fd, readable.set)
        try:
            while True:
                try:
                    wd = inotify.add_watch(self.directory, self.events)
                except OSError as exc:
                    if exc.errno in _MISSING:  # wait cheaply until the directory exists
                        await asyncio.sleep(self.poll_interval)
                        continue
                    # Watches used up (ENOSPC), no permission (EACCES), ...: no event will come.
                    log.warning("cannot watch %s with inotify: %s%s; polling it every %.1fs",
                                self.directory, exc, _HINTS.get(exc.errno or 0, ""),
                                self.poll_interval, extra={"errno": exc.errno})
                    return
                self.live_fd = fd
                yield self._all()
                alive = True
                while alive:
                    await readable.wait()
                    readable.clear()
                    changed: set[str] = set()
                    for event in inotify.read(timeout=0):
                        if event.mask & inotify_simple.flags.Q_OVERFLOW:
                            changed |= self._all()
                        elif event.wd == wd and event.mask & _GONE:
                            alive = False
                        elif self.names is None or event.name in self.names:
                            changed.add(event.name)
                    if not alive:
                        self.live_fd = None
                        with contextlib.suppress(OSError):
                            inotify.rm_watch(wd)
                        changed |= self._all()
                    if changed:
                        yield changed
        finally:
            self.live_fd = None
            loop.remove_reader(fd)

    async def _poll(self) -> AsyncIterator[set[str]]:
        seen: dict[str, tuple[int, ...] | None] = {}
        first = True
        while True:
            names = self._all()
            current = {name: _signature(self.directory / name) for name in names | set(seen)}
            changed = {name for name, sig in current.items() if first or seen.get(name) != sig}
            seen = current
            first = False
            if changed:
                yield changed
            await asyncio.sleep(self.poll_interval)


async def wait_event(event: asyncio.Event, limit: float) -> bool:
    """Wait for ``event`` at most ``limit`` seconds; True when it fired.

    Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races the event,
    which would leave a daemon unable to stop.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            await event.wait()
    return event.is_set()


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
