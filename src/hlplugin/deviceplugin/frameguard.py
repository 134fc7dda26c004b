"""A frame guard in front of a gRPC server: what grpc core lets one HTTP/2 client make it hold,
bounded before grpc sees it (docs/security.md, "The CONTINUATION flood").

A client that sends HEADERS without END_HEADERS and then CONTINUATION frames for ever makes grpc
core buffer the header block whole before it decodes any of it: 16 KiB frames on 4 raw
connections took an empty grpc.aio server from 33 to 135 MiB, and the daemons past their memory
limits (OOM-killed, the node's capacity gone until they are back). No grpc option bounds it (its
16 KiB SETTINGS_MAX_HEADER_LIST_SIZE applies to the decoded list, once the block is whole).

So the public unix socket is ours: each connection accepted there is forwarded, byte for byte
and untouched, to the gRPC server listening on a private address, and the client's bytes are read
as HTTP/2 frames on the way. Only the 9-byte frame headers are looked at (length, type, flags,
stream); payloads are skipped by count, so a 4 MiB message costs one comparison per 16 KiB
frame. A header block past ``MAX_HEADER_BLOCK`` bytes or ``MAX_CONTINUATIONS`` CONTINUATION
frames closes the connection (both sides) before the bytes that pass the bound are forwarded, so
grpc holds at most one bound's worth per connection, and its connection bound
(``grpc.max_allowed_incoming_connections``) caps the connections. The next frame-level bound
goes in ``FrameReader._frame`` (h2frames.py).

The server's bytes are read the same way, headers only, for one fact: which of the streams the
client opened the server has ended, with that end written to the client. Without the guard a
stream's end is with the client once gRPC wrote it; behind it, only once this process's loop has
forwarded it, which a process busy stopping does late. A hand-over waits on that (forwarded())
before its socket goes: the kubelet must see the old stream end before the standby registers.

The offender is closed, not sent GOAWAY: the server-to-client direction is copied untouched, so
a frame of ours could land inside one of grpc's; gRPC clients treat a closed connection like a
GOAWAY (they reconnect).

Everything runs on the event loop as asyncio protocols: no thread and no task per connection
(one task while the upstream connection is made). Backpressure is the transports' own: when one
side's write buffer passes its high-water mark, reading from the other side pauses until it
drains, so a peer that stops reading holds a bounded buffer, never an unbounded one. A half-close
(EOF) is passed on as one (``write_eof``); a connection lost on one side is closed on the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections.abc import Sequence
from pathlib import Path

from hlplugin.deviceplugin.h2frames import (  # noqa: F401  (the guard's bounds, re-exported)
    MAX_CONTINUATIONS,
    MAX_HEADER_BLOCK,
    MAX_STREAMS,
    PREFACE,
    FrameReader,
    ServerFrames,
)

log = logging.getLogger(__name__)

LOG_EVERY = 10.0  # seconds between warnings about closed connections (a flood opens thousands)


def abstract_address(prefix: str = "grpc-behind-guard") -> str:
    """A fresh abstract unix socket address for the private gRPC server, in grpc's spelling
    (``prefix``, then this process's pid and 64 random bits, so that instances never collide).

    It needs no writable directory (the pods' root filesystem is read-only) and leaves nothing to
    remove. Abstract sockets have no permissions: anyone in the network namespace may connect, so
    it suits a pod with its own (hostNetwork: false, as deploy/ runs them), not a host daemon,
    which should pass ``unix:`` and a path in a directory only its user can enter."""
    return f"unix-abstract:{prefix}-{os.getpid()}-{os.urandom(8).hex()}"


def _connect_path(address: str) -> str:
    """The path ``socket.connect`` takes for grpc's ``unix:`` or ``unix-abstract:`` address."""
    if address.startswith("unix-abstract:"):
        return "\0" + address.removeprefix("unix-abstract:")
    if address.startswith("unix://"):
        return address.removeprefix("unix://")
    if address.startswith("unix:"):
        return address.removeprefix("unix:")
    raise ValueError(f"not a unix socket address: {address!r}")


class _End(asyncio.Protocol):
    """One side of a forwarded connection: what it reads goes to the other side."""

    def __init__(self, pair: _Pair, client: bool) -> None:
        self.pair = pair
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.eof = False  # this side half-closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.client:
            # Not paused here: on Python 3.11.2 (Debian bookworm's, the image's) reading starts
            # after connection_made() even when it paused the transport, and a pause_reading()
            # after that one is then ignored. What arrives first is kept (_Pair.forward).
            self.pair.guard._accepted(self.pair)

    def data_received(self, data: bytes) -> None:
        self.pair.forward(self, data)

    def eof_received(self) -> bool:
        self.eof = True
        self.pair.half_closed()
        return True  # keep writing the other way until it ends too

    def pause_writing(self) -> None:
        self.pair.other(self).pause_reading()

    def resume_writing(self) -> None:
        self.pair.other(self).resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.lost(self, exc)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class _Pair:
    """A client's connection and its upstream connection to the gRPC server."""

    def __init__(self, guard: FrameGuard) -> None:
        self.guard = guard
        self.streams: set[int] = set()  # opened by the client, not yet ended by the server
        self.reader = FrameReader(self.streams)
        self.server = ServerFrames(self.streams)
        self.client = _End(self, client=True)
        self.upstream = _End(self, client=False)
        self.connecting: asyncio.Task[None] | None = None
        self.ended = False
        self.early: list[bytes] = []  # the client's bytes read before the upstream connection

    def other(self, end: _End) -> _End:
        return self.upstream if end is self.client else self.client

    async def connect(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_unix_connection(lambda: self.upstream, address)
        except OSError as exc:
            log.debug("frame guard: cannot reach the gRPC server at %s: %s", address, exc)
            self.abort()
            return
        if self.ended:  # the client went while we connected
            self.abort()
            return
        early, self.early = self.early, []
        if early and self.upstream.transport is not None:
            self.upstream.transport.write(b"".join(early))
        if self.client.eof:
            self.half_closed()
        else:
            self.client.resume_reading()

    def forward(self, end: _End, data: bytes) -> None:
        if end.client:
            if refusal := self.reader.feed(data):
                self.guard._refused(refusal)
                self.abort()
                return
        else:
            self.server.feed(data)
        target = self.other(end).transport
        if target is not None and not target.is_closing():
            target.write(data)
        elif target is None and end.client and not self.ended:
            # The kubelet writes its preface the moment it connects, before the upstream
            # connection is made: kept (one read: reading pauses) and sent once it is. Dropped,
            # gRPC closed the connection and the kubelet's dial failed (EOF).
            self.early.append(data)
            end.pause_reading()
        if not end.client:
            self.guard._progress()

    def half_closed(self) -> None:
        """Pass an EOF on; once both sides sent theirs, the connection is done."""
        for end in (self.client, self.upstream):
            target = self.other(end).transport
            if end.eof and target is not None and not target.is_closing() and target.can_write_eof():
                with contextlib.suppress(RuntimeError, OSError):  # written already
                    target.write_eof()
        if self.client.eof and self.upstream.eof:
            self.close()

    def lost(self, end: _End, exc: Exception | None) -> None:
        """One side is gone. Closed cleanly, what the other side holds is still written to it;
        lost to an error (a peer gone with bytes unread), nothing more can be passed on, so the
        other side ends at once: its peer may be waiting for us to read, as we for it."""
        end.transport = None
        self.ended = True
        other = self.other(end).transport
        if other is not None:
            if exc is None:
                other.close()
            else:
                other.abort()
        self._stop_connecting()
        self._forget()

    def close(self) -> None:
        self.ended = True
        for end in (self.client, self.upstream):
            if end.transport is not None:
                end.transport.close()

    def abort(self) -> None:
        self.ended = True
        self._stop_connecting()
        for end in (self.client, self.upstream):
            if end.transport is not None:
                end.transport.abort()
        self._forget()

    def _stop_connecting(self) -> None:
        task = self.connecting
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def open(self, ids: frozenset[int]) -> bool:
        """Any of ``ids`` still open: not ended by the server, and the client still there."""
        return self.client.transport is not None and not self.streams.isdisjoint(ids)

    def holding(self) -> bool:
        """Bytes the server sent not yet written to the client: unread upstream, or buffered."""
        client, upstream = self.client.transport, self.upstream.transport
        if client is not None and client.get_write_buffer_size():
            return True
        sock = upstream.get_extra_info("socket") if upstream is not None else None
        if sock is None:
            return False
        with contextlib.suppress(OSError):
            return bool(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0])
        return False

    def _forget(self) -> None:
        """Both sides are gone: the guard no longer holds this pair (a connecting task was
        cancelled, and close() awaits it)."""
        if self.client.transport is None and self.upstream.transport is None:
            self.guard._forget(self)
            self.guard._progress()


Streams = Sequence[tuple[_Pair, frozenset[int]]]  # FrameGuard.streams(): per connection


class FrameGuard:
    """Accepts connections on a unix socket and forwards each to the gRPC server at
    ``upstream`` (grpc's ``unix:`` or ``unix-abstract:`` address), within the frame bounds.

    ``refusals`` counts connections closed for a bound (for a metric)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._connect = _connect_path(upstream)
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[Path, int, int] | None = None  # the path we bound, its device and inode
        self._pairs: set[_Pair] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self._emptied: asyncio.Future[None] | None = None  # set when the last pair is forgotten
        self._changed: asyncio.Event | None = None  # set on what the server sent, for forwarded()
        self.refusals = 0
        self._unlogged = 0
        self._logged_at = -LOG_EVERY

    async def listen(self, path: Path, backlog: int = 128) -> None:
        """Listen at ``path`` (a fresh name: an existing file is an error). The caller publishes
        it as the endpoint does gRPC's; close() removes it while it is still ours."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            st = os.stat(path)
            self._bound = (path, st.st_dev, st.st_ino)
            sock.listen(backlog)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Pair(self).client, sock=sock)
        except BaseException:
            sock.close()
            self._unlink()
            raise

    @property
    def connections(self) -> int:
        """Client connections being forwarded."""
        return len(self._pairs)

    def _accepted(self, pair: _Pair) -> None:
        self._pairs.add(pair)
        pair.connecting = task = asyncio.get_running_loop().create_task(pair.connect(self._connect))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    def _forget(self, pair: _Pair) -> None:
        self._pairs.discard(pair)
        if not self._pairs and self._emptied is not None and not self._emptied.done():
            self._emptied.set_result(None)

    def _progress(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _refused(self, why: str) -> None:
        self.refusals += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            log.warning("closed %d connection(s) on the gRPC socket: %s (an HTTP/2 CONTINUATION "
                        "flood; a gRPC client's are a few hundred bytes)", self._unlogged, why)
            self._logged_at, self._unlogged = now, 0

    def streams(self) -> Streams:
        """The streams open now on each connection (opened by the client, not yet ended by the
        server): what a hand-over, having ended its ListAndWatch streams, gives forwarded()."""
        return [(pair, frozenset(pair.streams)) for pair in self._pairs if pair.streams]

    async def forwarded(self, timeout: float, streams: Streams = ()) -> None:
        """Return once what the server has sent so far is written to its clients, and each of
        ``streams`` (from streams()) has been ended by the server and that end written to its
        client (or its connection is gone); or after ``timeout`` seconds (a client that does
        not read, a server that does not end them). Without the guard gRPC writes to the
        client's socket itself: a hand-over waits on this before its socket goes, so that the
        stream ends are with the kubelet before the standby registers, however late this
        process's loop forwards them (the kubelet keeps one client per resource, and an old
        stream's end seen after the new Register disconnects the new instance). The bytes are in
        the client's socket when this returns: its reads need this process no more."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        await asyncio.sleep(0)  # the reads already due run first
        while (left := until - loop.time()) > 0:
            if any(pair.open(ids) for pair, ids in streams):
                # Woken by what the server sends next (each read is forwarded before it wakes us).
                if self._changed is None or self._changed.is_set():
                    self._changed = asyncio.Event()
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await changed.wait()
                continue
            if not any(p.holding() for p in self._pairs):
                return
            await asyncio.sleep(0.001)  # a write buffer draining: nothing tells us when

    def stop_listening(self) -> None:
        """Refuse new connections at once, as a stopping gRPC server does; forwarded ones go on."""
        if self._server is not None:
            self._server.close()  # closes the listening socket at once

    async def close(self, drain: float = 0.0) -> None:
        """Stop accepting, remove our path, give the connections up to ``drain`` seconds to end by
        themselves, then end the rest at once. Stop the gRPC server first: each connection it
        closes the guard closes once what it sent is written, so its goodbyes reach the clients.
        A cancellation during the drain ends them at once; the ending is done before any later
        await, so a cancellation then (the daemon re-cancels while stopping) cuts short only the
        wait for their clean-up."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._unlink()
        try:
            if self._pairs and drain > 0:
                self._emptied = asyncio.get_running_loop().create_future()
                await asyncio.wait({self._emptied}, timeout=drain)
        finally:
            for pair in list(self._pairs):
                pair.abort()
        if self._connecting:
            await asyncio.wait(set(self._connecting))
        if server is not None:
            await server.wait_closed()
        await asyncio.sleep(0)  # the aborted transports' connection_lost callbacks run

    def _unlink(self) -> None:
        bound, self._bound = self._bound, None
        if bound is None:
            return
        path, dev, ino = bound
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
