"""Every gRPC server of ours, whichever kubelet protocol it serves (device plugin, DRA, plugin
registration): what a client can make it hold, a stop no client holds up, clean-up that a
cancellation cannot cut short, and the one way we ask our own server whether it answers.

Bounds (docs/security.md, "Bounds on the device-plugin socket"; the DRA sockets take the same,
with their own request size), measured with tests/h2flood.py:
20,000 HEADERS + RST_STREAM pairs (the HTTP/2 rapid reset, CVE-2023-44487) over 4 connections
grew the main daemon's peak memory by 31-45 MiB with gRPC's defaults and failed some of the
kubelet's Allocates (CANCELLED); with the bounds below, by 2-5 MiB over 4 to 300 connections,
and none failed.

- ``grpc.max_concurrent_streams``: streams one connection may have open at once. Above the
  ListAndWatch streams a plugin serves (8, servicer.MAX_STREAMS), so a client opening a ninth is
  told so (RESOURCE_EXHAUSTED) rather than kept waiting. The kubelet holds one ListAndWatch and
  calls Allocate and its siblings one at a time.
- ``grpc.http2.max_deallocating_streams``: streams the client has ended (a reset one, or a call
  answered) that the server may still be finishing, beyond the open ones; past it gRPC refuses
  new streams (REFUSED_STREAM). This is what holds a reset flood back, since its client never
  has a stream open. With gRPC's default for it and the stream bound, hundreds of 1,000
  concurrent Allocates on one connection were refused (tests/test_faults.py); at 10 none, at
  50 a flood over 64 connections grew memory by 18 MiB.
- ``grpc.max_allowed_incoming_connections``: connections open at once; gRPC closes one more at
  once. The kubelet keeps the one it dialled at registration, the self-check one, and at most 8
  ListAndWatch readers one each. Without it a flood spread over 200 connections grew memory
  by 7 MiB where over 4 it grew 1.3 MiB. The socket lives in the kubelet's root-only directory,
  so whoever can fill the cap could as well remove the socket. Every user of it is UID 0, so
  the kubelet cannot be told apart to be given a slot of its own; the liveness self-check needs
  none (``transport_answers``).

``grpc.aio.server``'s ``maximum_concurrent_rpcs`` is not used: past it gRPC refuses calls
(RESOURCE_EXHAUSTED), and a flood would then fail the kubelet's Allocate instead of delaying it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

MAX_STREAMS_PER_CONNECTION = 10
MAX_CONNECTIONS = 12
MAX_DEALLOCATING_STREAMS = 10
STOP_GRACE = 0.2  # seconds calls in progress get to finish before they are cancelled
STOP_DEADLINE = 0.5  # seconds a stop may take, grace included, before the server is left behind

# Servers left running by a stop past its deadline: held until they end, never collected while
# the loop runs (a collected server schedules its own shutdown, on a loop that may be closed).
_abandoned: set[asyncio.Task[None]] = set()


async def to_completion(work: Coroutine[Any, Any, None]) -> None:
    """Finish bounded clean-up even when cancelled meanwhile, then re-raise the cancellation.

    The daemon re-cancels every 0.25 s while stopping (see Daemon.stop); a server.stop() cut short
    leaves a running server that the garbage collector shuts down after the loop has closed,
    printing a traceback, and leaves its socket behind.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


# An HTTP/2 client's connection preface, then its (empty) SETTINGS frame; a frame header is 9
# bytes: length (3), type (1), flags (1), stream (4).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_FRAME_HEAD = 9
_SETTINGS = 0x4


# Given a channel, one cheap unary call of a protocol's, made with a timeout (seconds).
ChannelCall = Callable[[grpc.aio.Channel], Callable[[float], Awaitable[object]]]


class SelfCall:
    """"Does our own gRPC server answer?", asked the one way every daemon asks it: one cheap
    unary call of its protocol (``call``) to the server at a unix socket, over one channel kept
    open while the path stays the same (reconnecting within a second of the server coming back,
    not after gRPC's backoff), or over one dialled for the question (``fresh``). One unary call is
    the least that proves the server answers: it runs our handler on the event loop."""

    def __init__(self, call: ChannelCall) -> None:
        self._call = call
        self._channel: grpc.aio.Channel | None = None
        self._target = ""
        self._kept_call: Callable[[float], Awaitable[object]] | None = None  # made once per channel
        self._closed = False

    async def ask(self, path: Path, timeout: float, *, fresh: bool = False
                  ) -> grpc.StatusCode | None:
        """None when the server at ``path`` answered within ``timeout``, else the call's status.
        Once closed, every question is asked over a channel of its own."""
        target = f"unix://{path}"
        try:
            if fresh or self._closed:
                async with grpc.aio.insecure_channel(target) as channel:
                    await self._call(channel)(timeout)
            else:
                await (await self._kept(target))(timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return None

    async def _kept(self, target: str) -> Callable[[float], Awaitable[object]]:
        if self._channel is None or self._kept_call is None or target != self._target:
            await self._close_channel()
            self._channel = grpc.aio.insecure_channel(target, options=[
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
            self._target = target
            self._kept_call = self._call(self._channel)
        return self._kept_call

    async def aclose(self) -> None:
        """Close the kept channel; later questions dial their own."""
        self._closed = True
        await self._close_channel()

    async def _close_channel(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)


async def server_answers(ask: SelfCall, path: Path, ours: Callable[[], bool],
                         timeout: float) -> bool:
    """Liveness of the gRPC server at ``path``, within ``2 * timeout``: it answers a call over its
    own socket (a channel dialled now), or, when it closes the connection at once (UNAVAILABLE:
    others hold every connection it admits, and as every user of the socket is UID 0 the kubelet
    cannot be given a slot of its own), its transport still takes connections. A failure while
    the socket is no longer ``ours`` (just replaced) proves nothing about our server."""
    code = await ask.ask(path, timeout, fresh=True)
    if code is None or not ours():
        return True
    # A server that hangs fails the call by its deadline, never as UNAVAILABLE.
    return code == grpc.StatusCode.UNAVAILABLE and await transport_answers(path, timeout)


async def transport_answers(path: Path, timeout: float) -> bool:
    """Does a gRPC server's transport take connections at ``path``, even one past its connection
    bound? It needs no slot, and holds none: it connects, sends an HTTP/2 client's preface, and
    reads. Under the bound the server answers with its SETTINGS frame; at the bound gRPC accepts
    the connection and closes it at once (EOF, or a reset as our preface went unread). Either
    needs the server's own threads to have accepted it (the kernel completes a unix connect
    alone): a server that stopped accepting leaves us queued until the timeout, and a refused
    connect (nothing listens, or its queue is full) fails at once. Only a listener that closes
    with us queued (its process exiting) passes wrongly, for as long as it takes to exit."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, str(path))
                try:
                    await loop.sock_sendall(sock, _PREFACE)
                    head = b""
                    while len(head) < _FRAME_HEAD:
                        chunk = await loop.sock_recv(sock, _FRAME_HEAD - len(head))
                        if not chunk:
                            return not head  # closed by the server, at its bound
                        head += chunk
                except (BrokenPipeError, ConnectionResetError):
                    return True  # closed by the server, at its bound, before it read our preface
        except (TimeoutError, OSError):
            return False
        return head[3] == _SETTINGS


def bounded_server(max_request_bytes: int) -> grpc.aio.Server:
    """A gRPC server within the bounds above, requests larger than ``max_request_bytes`` refused
    before they are parsed (RESOURCE_EXHAUSTED): every gRPC server of ours, whichever kubelet
    protocol it serves, is built here (tests/test_layers.py)."""
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.http2.max_deallocating_streams", MAX_DEALLOCATING_STREAMS),
        ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
    ])


async def stop_server(server: grpc.aio.Server, grace: float = STOP_GRACE,
                      deadline: float = STOP_DEADLINE) -> bool:
    """Stop ``server`` within ``deadline`` seconds; False when it had to be left running.

    gRPC's stop waits until every connection has written what it holds, and a client that stops
    reading a ListAndWatch stream (a stopped process) holds a write for as long as it likes: the
    daemon would outlive its pod's grace and be SIGKILLed with its socket left behind. Past the
    deadline the server is left to end with its clients or the process. A cancellation meanwhile
    (the daemon re-cancels while stopping) is re-raised once the stop is done or abandoned.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.ensure_future(server.stop(grace))
    until = loop.time() + deadline
    cancelled = False
    while not stopping.done() and (left := until - loop.time()) > 0:
        try:
            await asyncio.wait({stopping}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    stopped = stopping.done()
    if stopped:
        stopping.result()
    else:
        _abandoned.add(stopping)
        stopping.add_done_callback(_abandoned.discard)
        log.warning("the gRPC server did not stop within %g s (a client is not reading what it "
                    "was sent); leaving it behind", deadline)
    if cancelled:
        raise asyncio.CancelledError
    return stopped
