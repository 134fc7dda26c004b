"""The one owner of a plugin's socket path: bind, publish, hold, remove (and, with the cluster
issue's hand-over, hand over). Nothing else in the package creates, replaces or unlinks it.

One server per unix socket path: ask who answers there before taking it. A gRPC server binding a
unix socket path removes whatever socket is there first, so two servers started on one path would
take it from each other in turn, for ever. Asking the path first tells the cases apart:

- nothing there, or a socket file that nobody answers on (its server died, e.g. SIGKILLed:
  connect() is refused): free, to be taken at once;
- a socket that a live process listens on (connect() succeeds, or fails only because its backlog
  is full): held. The newcomer leaves it alone and waits. The kernel names the listener
  (SO_PEERCRED: its pid, 0 when that is in another pid namespace, and its uid), and the
  connection kept open to it ends the moment that process exits or stops serving, so a holder
  that dies is noticed at once, not at the next poll. (A gRPC server closes a connection that
  never speaks HTTP/2 after about a minute; the wait then looks again: a waiting instance costs
  the holder one idle connection and one reconnect a minute, and nothing in its log.)

A server must not bind the path itself, though: gRPC removes whatever socket is at its address
when it stops, so a server stopping after another took the path over would remove the other's
socket. Its socket is bound under a private name beside the path (private_path) and then publish()
links that into place, atomically and never over a live holder's socket, so clean-up only ever
removes the private name. ``Endpoint`` remembers which socket it published (its identity), so it
removes the path only while the socket there is still that one.

With ``guard`` (a daemon's setting), the socket published is not gRPC's own but a frame
guard's (frameguard.py, docs/security.md "The CONTINUATION flood"): it forwards each connection to
the gRPC server, listening on a fresh abstract address, and closes one whose HTTP/2 header block
grows past its bound before grpc core buffers it. Every server of ours is published here, so the
setting covers every one. It is off by default: its hop costs about 0.1 ms a call, past the
budget at 16 calls at once, and the memory limit contains the flood instead. The abstract
address needs no file: a private socket file in the kubelet's device-plugin directory would be
removed by the kubelet's start, which removes every file it does not know there. ``stop()`` stops
the server, then the guard, so that the server's goodbyes (stream ends, GOAWAY) still reach its
clients through the guard, when and as they did without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from hlplugin.deviceplugin.frameguard import FrameGuard, Streams, abstract_address
from hlplugin.deviceplugin.kubelet.grpcserver import stop_server, to_completion

Identity = tuple[int, int, int]

# Seconds the guard waits, once the server has stopped, for the connections the server closed to
# end on the client's side too (what the server sent written first); then it ends the rest.
GUARD_DRAIN = 0.1


def socket_identity(path: Path) -> Identity | None:
    """(device, inode, ctime) of a unix socket at ``path``; None when missing or not a socket.
    The ctime tells a new socket from an old one whose inode number the filesystem reused."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_FREE = (errno.ECONNREFUSED, errno.ENOENT)  # a stale socket file; the path removed meanwhile
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)


class Held(Exception):
    """The path is served by another live process."""

    def __init__(self, holder: Holder) -> None:
        super().__init__(f"{holder.path} is served by {holder.describe()}")
        holder.close()
        self.holder = holder


@dataclass
class Holder:
    """A live process listening on ``path``, and our connection to it (None when its backlog was
    full: then there is nothing to wait on but a change of the path, or time)."""

    path: Path
    pid: int
    uid: int
    conn: socket.socket | None

    def describe(self) -> str:
        """Who it is, for a message: its pid when we can see it."""
        if self.conn is None:
            return "a process whose listen backlog is full"
        if self.pid:
            return f"pid {self.pid} (uid {self.uid})"
        return f"a process in another pid namespace (uid {self.uid})"

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def gone(self) -> bool:
        """Drain what the holder sent us (gRPC's SETTINGS, its GOAWAY when it stops); True once
        our connection has ended: it exited or stopped serving, so look again."""
        if self.conn is None:
            return False
        try:
            while self.conn.recv(65536):
                pass
        except BlockingIOError:
            return False
        except OSError:
            pass
        return True

    async def wait_gone(self, change: asyncio.Future[None]) -> None:
        """Wait until our connection ends or ``change`` is done."""
        if self.conn is None:
            await asyncio.wait({change})
            return
        loop = asyncio.get_running_loop()
        fd = self.conn.fileno()
        while not change.done() and not self.gone():
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _settle, readable)
            try:
                await asyncio.wait({change, readable}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                loop.remove_reader(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def find_holder(path: Path) -> Holder | None:
    """The live process listening on the unix socket at ``path``; None when nothing is there, the
    file is not a socket (the caller decides about that), or nobody answers (a stale file).
    Raises OSError when it cannot tell (e.g. EACCES): a socket we may not even connect to is not
    ours to remove."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return None
    except FileNotFoundError:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.setblocking(False)  # a unix connect never waits: it succeeds, or is refused, or EAGAIN
    try:
        conn.connect(os.fsdecode(path))
    except OSError as exc:
        conn.close()
        if exc.errno in _FREE:
            return None
        if exc.errno == errno.EAGAIN:  # listening, with a full backlog: alive and busy
            return Holder(path, 0, -1, None)
        raise
    pid, uid, _ = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Holder(path, pid, uid, conn)


def private_path(path: Path) -> Path:
    """A fresh name beside ``path`` for a server to bind before publish(); never longer than
    ``path``, so it fits wherever a unix socket at ``path`` fits."""
    return path.with_name("." + os.urandom(len(path.name)).hex()[:max(len(path.name) - 1, 1)])


def publish(bound: Path, path: Path) -> None:
    """Give the socket listening at ``bound`` the name ``path`` and remove ``bound``. Never over a
    live holder's socket (raises Held); a stale socket there is replaced. Raises OSError when
    something else is in the way, or the link cannot be made."""
    for attempt in range(2):
        try:
            os.link(bound, path)  # atomic, and never replaces: EEXIST
        except FileExistsError:
            holder = find_holder(path)
            if holder is not None:
                raise Held(holder) from None
            if attempt or not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise
            os.unlink(path)  # a stale socket: nobody answers on it
            continue
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            # A filesystem without hard links: look, then rename (not atomic with the look).
            holder = find_holder(path)
            if holder is not None:
                raise Held(holder) from None
            os.replace(bound, path)
            return
        os.unlink(bound)
        return


async def wait_until_free(path: Path, changed: Callable[[], Awaitable[None]],
                          held: Callable[[Holder], None]) -> bool:
    """Return once no live process holds ``path``; True when one did on the way.

    ``changed()`` is called before each look (so no change between the look and the wait is
    missed) and gives an awaitable that ends when the path may have changed, or after a while (a
    poll); ``held`` is told of every holder found. A holder's connection ending or receiving
    anything but data (gRPC sends SETTINGS, then GOAWAY when it stops) also ends the wait.
    """
    waited = False
    while True:
        change = asyncio.ensure_future(changed())
        try:
            holder = find_holder(path)
            if holder is None:
                return waited
            waited = True
            with contextlib.closing(holder):
                held(holder)
                await holder.wait_gone(change)
        finally:
            change.cancel()


class Endpoint:
    """``server`` published at ``path``, from bind() to stop(): ``identity`` is the socket we
    published there (None before, and once removed), so "still ours" is a stat, never a guess."""

    def __init__(self, path: Path, server: grpc.aio.Server, *, guard: bool = False) -> None:
        self.path = path
        self.server = server
        self.guarded = guard
        self.identity: Identity | None = None
        self._bound: Path | None = None  # the private name serve() bound
        self._guard: FrameGuard | None = None

    def ours(self) -> bool:
        """The socket at the path is the one we published (not replaced, not removed)."""
        return self.identity is not None and socket_identity(self.path) == self.identity

    def remove_stale(self) -> None:
        """A socket left at our name by a previous run is ours to remove; anything else is not."""
        if socket_identity(self.path) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        elif os.path.lexists(self.path):
            raise RuntimeError(f"{self.path} exists and is not a socket; refusing to replace it")

    async def bind(self) -> None:
        """Start the server on a private name and publish it at the path. Raises Held when a live
        instance published first, OSError when the path cannot be taken: the caller then calls
        stop(), and nothing of ours is left at the path or the private name."""
        await self.serve()
        self.take()

    async def serve(self) -> None:
        """Start the server, behind its frame guard if guarded, listening on a private name beside
        the path (a standby does this while it waits, so that taking over is one link). Raises
        OSError when it cannot bind there (e.g. a read-only directory): the caller calls stop()."""
        self._bound = bound = private_path(self.path)
        if not self.guarded:  # gRPC's own socket; its stop removes the private name only
            self.server.add_insecure_port(f"unix://{bound}")
            await to_completion(self.server.start())
            return
        address = abstract_address()
        self.server.add_insecure_port(address)
        self._guard = guard = FrameGuard(address)
        # start() binds the socket in a task of gRPC's own that a cancellation does not stop, so
        # it runs to completion, and so does the guard's listen: then, cancelled or not, stop()
        # knows what there is to stop and remove.
        await to_completion(self.server.start())
        await to_completion(guard.listen(bound))

    def take(self) -> None:
        """Publish the served private name at the path (see publish(): Held, OSError)."""
        assert self._bound is not None, "serve() first"
        publish(self._bound, self.path)
        self.identity = socket_identity(self.path)

    def streams(self) -> Streams:
        """The streams open now at the guard (FrameGuard.streams), for forwarded()."""
        return self._guard.streams() if self._guard is not None else []

    async def forwarded(self, timeout: float, streams: Streams = ()) -> None:
        """Wait (at most ``timeout``) until what the server has sent is with its clients, and
        ``streams`` have been ended and their ends too (FrameGuard.forwarded): before a
        hand-over's remove()."""
        if self._guard is not None:
            await self._guard.forwarded(timeout, streams)

    def remove(self) -> None:
        """Unlink the path if the socket there is still the one we published, then forget it.
        The server goes on serving the connections it has (a hand-over removes first)."""
        identity, self.identity = self.identity, None
        if identity is not None and socket_identity(self.path) == identity:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def stop(self) -> bool:
        """Stop the server (within grpcserver.stop_server's deadline), then its guard, then remove
        the path while ours; False when the server had to be left running. The server first:
        its last bytes pass through the guard as they are sent, and each connection the server
        closes the guard closes in turn, so clients see the ends they saw without the guard;
        the guard then ends whatever is left (a client that does not read). A cancellation
        meanwhile is re-raised once all of it is done."""
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.stop_listening()  # new connections refused at once, as by gRPC's stop
        try:
            return await stop_server(self.server)
        finally:
            try:
                if guard is not None:
                    await to_completion(guard.close(drain=GUARD_DRAIN))
            finally:
                self.remove()
