"""/healthz, /readyz and /metrics over HTTP for both daemons, on the daemon's own event loop.

The port is reachable from the pod network, so every resource a client can make us hold is
bounded (docs/security.md lists the bounds and why): connections (an eighth of the fd limit, at
most 256; the oldest is closed to admit a new one, so clients that got there first cannot lock a
probe out), the request head (8 KiB), the body (4 KiB, discarded) and the whole exchange
(5 s from accept to the last byte written, but for a scrape's wait for its turn in the pace,
which is bounded by the connections open over the pace). No threads: h11 (a small, well-kept sans-IO HTTP/1.1
parser) parses, asyncio's transports do the I/O, and a request is answered only once it has
arrived whole, so one cut off by EOF is never served. One request per connection.

Answers come from state, never from I/O: /healthz from what the daemon's self-check last found (a
request may start the next check, not wait for it: daemon.SelfCheck),
/readyz from the health conditions, /metrics from the registry, at a pace (see scrape.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client.registry import CollectorRegistry

from hlplugin.deviceplugin.process import lazymodule, lazyprom
from hlplugin.deviceplugin.process.probeclearance import ProbeClearance
from hlplugin.deviceplugin.process.scrape import Pacer

if TYPE_CHECKING:
    import h11
else:  # parses the first request: not loaded before the daemon registers
    h11 = lazymodule.load("h11")

log = logging.getLogger(__name__)

# (ok, reason) per readiness condition; a callable so every request sees the current state.
Readiness = Callable[[], Mapping[str, tuple[bool, str]]]
Liveness = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class Limits:
    """What one client, or all of them together, can make the server hold."""

    max_connections: int = 256
    max_head: int = 8 * 1024
    max_body: int = 4 * 1024
    deadline: float = 5.0  # accept to the whole request, and its turn to the answer written
    accept_batch: int = 32  # connections asyncio accepts per loop turn (its "backlog")
    # Connections the kernel completes and queues before we accept them: they hold no fd of
    # ours, and a burst larger than the queue would leave clients waiting on SYN retries.
    listen_queue: int = 1024
    # /metrics answers a second (2 at once); more wait their turn (scrape.py).
    scrapes_per_second: float = 20.0


def connection_cap(fd_limit: int | None = None, ceiling: int = 256) -> int:
    """An eighth of the fd limit, at most 256, at least 4 (so probes get in). asyncio accepts a
    batch of connections per loop turn and a closed one frees its fd a turn or two later,
    so clients can briefly hold the cap plus a few batches (32 each): at most a quarter of the
    fds, and three quarters stay for the daemon's own work (gRPC, inotify, the producers'
    checks) whatever clients do."""
    if fd_limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        fd_limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(4, min(ceiling, fd_limit // 8))


def format_address(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


def _text(status: HTTPStatus, text: str = "") -> Answer:
    return Answer(int(status), (text or status.phrase).encode() + b"\n")


class App:
    """Routes a complete request to an answer built from in-memory state."""

    def __init__(self, readiness: Readiness, liveness: Liveness, registry: CollectorRegistry,
                 details: Mapping[str, object] | None = None) -> None:
        self.readiness = readiness
        self.liveness = liveness
        self.registry = registry
        # Fixed at start, in every /readyz answer; a callable's value is read at each answer.
        self.details = dict(details or {})

    def __call__(self, method: str, target: str, headers: Mapping[str, str]) -> Answer:
        if method not in ("GET", "HEAD"):
            return Answer(405, b"method not allowed\n", headers=(("Allow", "GET"),))
        path = urlsplit(target).path
        if path == "/metrics":
            lazyprom.complete()  # the exposition code, loaded at the first scrape
            from prometheus_client.exposition import choose_encoder

            encoder, content_type = choose_encoder(headers.get("accept", ""))
            return Answer(200, encoder(self.registry), content_type)
        if path == "/healthz":
            ok, reason = self.liveness()
            return self._json(ok, {"status": "ok" if ok else "failing", "reason": reason})
        if path == "/readyz":
            conditions = self.readiness()
            ready = all(ok for ok, _ in conditions.values())
            return self._json(ready, {
                **{name: value() if callable(value) else value for name, value in self.details.items()},
                "status": "ready" if ready else "not ready",
                "conditions": {name: {"ok": ok, "reason": reason}
                               for name, (ok, reason) in conditions.items()},
            })
        return Answer(404, b"not found: try /healthz, /readyz or /metrics\n")

    @staticmethod
    def _json(ok: bool, body: object) -> Answer:
        data = json.dumps(body, sort_keys=True).encode() + b"\n"
        return Answer(200 if ok else 503, data, "application/json")


class _Connection(asyncio.Protocol):
    """One client: fed to h11 as bytes arrive, answered once, then closed."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.parser = h11.Connection(h11.SERVER,
                                     max_incomplete_event_size=server.limits.max_head + 1)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.request: h11.Request | None = None
        self.head_bytes = 0
        self.body = 0
        self.line_ended = False  # has the request line ended (414 vs 431)?
        self.done = False
        self.eof = False
        self.complete = False  # the whole request arrived (its end, or EOF)
        self.paced = False  # a whole scrape request, waiting for its turn (scrape.py)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(self.limits.deadline, self._expire)
        self.server._admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if self.paced:  # if it still waits for its turn, it holds nothing meanwhile
            self.server.scrapes.cancel(self._answer_scrape)
        self.server._forget(self)

    def data_received(self, data: bytes) -> None:
        if self.paced:
            return  # past the one request a connection gets: dropped, never buffered
        while data and not self.done:
            if self.request is None:
                # At most one byte past the limit of the head: if h11 has no request in that
                # much, the head is too large, whatever size the reads came in.
                room = self.limits.max_head + 1 - self.head_bytes
                chunk, data = data[:room], data[room:]
                self.head_bytes += len(chunk)
                self.line_ended = self.line_ended or b"\n" in chunk
            else:
                chunk, data = data, b""
            self.parser.receive_data(chunk)
            self._pump()
            if self.request is None and self.head_bytes > self.limits.max_head and not self.done:
                self._answer(_text(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE if self.line_ended
                                   else HTTPStatus.REQUEST_URI_TOO_LONG))

    def eof_received(self) -> bool:
        self.eof = True
        if self.paced and not self.done:
            self.close()  # the scraper went: its turn goes to the next
            return False
        if not self.done:
            self.parser.receive_data(b"")
            self._pump()
        if not self.done:
            self.close()
        return False  # the transport closes once an answer already written is sent

    def _pump(self) -> None:
        """Take every event h11 has; answer at the end of a whole request or at an error."""
        try:
            while not self.done:
                event = self.parser.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if isinstance(event, h11.Request):
                    self.request = event
                elif isinstance(event, h11.Data):
                    self.body += len(event.data)
                    if self.body > self.limits.max_body:
                        self._answer(_text(HTTPStatus.REQUEST_ENTITY_TOO_LARGE))
                elif isinstance(event, h11.EndOfMessage):
                    self.complete = True
                    self._respond()
                elif isinstance(event, h11.ConnectionClosed):
                    self.close()
        except h11.RemoteProtocolError as exc:
            if self.eof:  # cut off: nobody is waiting for an answer, and none is owed
                self.close()
                return
            status = exc.error_status_hint
            if status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE and not self.line_ended:
                status = HTTPStatus.REQUEST_URI_TOO_LONG
            self._answer(_text(HTTPStatus(status)))

    def _respond(self) -> None:
        """Answer now, but a scrape when the pace allows (scrape.py): a storm of them waits
        (a scraper that goes meanwhile is forgotten), and the kubelet's probes and calls do not.
        The wait for the pace is the storm's, not this client's: the deadline stops meanwhile,
        and starts again at its turn for the answer's writing."""
        assert self.request is not None and self.transport is not None
        if urlsplit(self.request.target).path != b"/metrics":
            self._answer(self._route())
            return
        self.paced = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.server.scrapes.run(self._answer_scrape)

    def _answer_scrape(self) -> bool:
        if self.done:  # closed while it waited: an eviction, or the client
            return False
        self.timer = asyncio.get_running_loop().call_later(self.limits.deadline, self._expire)
        self._answer(self._route())
        return True

    def _route(self) -> Answer:
        request = self.request
        assert request is not None
        if request.http_version not in (b"1.0", b"1.1"):
            return _text(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED)
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in request.headers}
        if urlsplit(request.target.decode("ascii", "replace")).path == "/readyz":
            self.server.probes.seen(headers.get("user-agent", ""))
        try:
            return self.server.app(request.method.decode("ascii"),
                                   request.target.decode("ascii"), headers)
        except Exception:
            log.exception("http: error answering %s", request.target[:100].decode("ascii", "replace"))
            return _text(HTTPStatus.INTERNAL_SERVER_ERROR)

    def _answer(self, answer: Answer) -> None:
        self.done = True
        assert self.transport is not None
        head = self.request is not None and self.request.method == b"HEAD"
        headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body))),
                   ("Connection", "close"), *answer.headers]
        try:
            out = self.parser.send(h11.Response(
                status_code=answer.status, headers=headers,
                reason=HTTPStatus(answer.status).phrase.encode()))
            if not head:
                out = (out or b"") + (self.parser.send(h11.Data(data=answer.body)) or b"")
            out = (out or b"") + (self.parser.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # h11 has no state left to answer from
            self.close()
            return
        if not (self.complete or self.eof):
            # Answered before the whole request arrived (too large, malformed): send it and a
            # FIN, then read and drop the rest until the client closes (or the deadline). A
            # close with unread bytes would reset the connection, and a reset can discard the
            # answer before the client reads it.
            self.transport.write(out)
            self.transport.write_eof()
            return
        self.transport.pause_reading()
        self.transport.write(out)
        self.transport.close()  # after the buffer is written; the deadline aborts a non-reader
        if not self.transport.get_write_buffer_size():
            # All sent: the fd closes at the next loop turn. Not a connection to evict (that
            # would reset it, and a reset can discard the answer before the client reads it).
            self.server._forget(self)

    def _expire(self) -> None:
        """The whole-request deadline: the connection goes now, unanswered (as nginx does),
        whatever is still buffered for a client that stopped reading."""
        self.timer = None
        self.close()

    def close(self) -> None:
        self.done = True
        if self.transport is not None:
            self.transport.abort()


class HttpServer:
    """The HTTP port of one daemon; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, readiness: Readiness, liveness: Liveness, registry: CollectorRegistry,
                 limits: Limits | None = None, clock: Callable[[], float] = time.monotonic,
                 details: Mapping[str, object] | None = None) -> None:
        self.probes = ProbeClearance()
        self.app = App(readiness, liveness, registry, details)
        self.limits = limits if limits is not None else Limits(max_connections=connection_cap())
        self.clock = clock
        self.port = 0
        self._open: dict[_Connection, None] = {}  # insertion order: oldest first
        self._server: asyncio.Server | None = None
        self.scrapes = Pacer(self.limits.scrapes_per_second)
        self._warned_at: float | None = None
        self.evicted = 0

    async def start(self, address: tuple[str, int]) -> None:
        """Bind ``address``; OSError (socket.gaierror included) when it cannot be bound."""
        sock = await self._bind(address)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock,
                                                backlog=self.limits.accept_batch)
        sock.listen(self.limits.listen_queue)  # asyncio listened with its batch size
        self.port = sock.getsockname()[1]
        log.info("serving /healthz, /readyz and /metrics on %s (at most %d connections)",
                 format_address((address[0], self.port)), self.limits.max_connections)

    async def _bind(self, address: tuple[str, int]) -> socket.socket:
        """One socket on the first address ``host`` resolves to; ``::`` is dual-stack (IPv4 too)
        where the kernel allows it, as asyncio's own binding would make it IPv6-only."""
        host, port = address
        try:  # an IP address (the defaults are) needs no lookup: no thread to start for it
            # (as bytes: a str host is IDNA-encoded first, which loads that codec)
            infos = socket.getaddrinfo(host.encode(), port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
        except socket.gaierror:  # a name: looked up off the loop
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        dual = family == socket.AF_INET6 and sockaddr[0] == "::" and socket.has_dualstack_ipv6()
        sock = socket.create_server(sockaddr, family=family, backlog=self.limits.listen_queue,
                                    reuse_port=False, dualstack_ipv6=dual)
        sock.setblocking(False)
        return sock

    async def stop(self) -> None:
        """Close the port, after the next readiness probe if it is due soon (probeclearance.py).
        A cancellation meanwhile (the daemon re-cancels while stopping) does not cut that wait."""
        waiting = asyncio.ensure_future(self.probes.wait())
        while not waiting.done():
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                continue  # bounded: at most PROBE_CLEARANCE + PROBE_SLACK
        self.scrapes.close()
        if self._server is not None:
            self._server.close()
        for conn in list(self._open):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _admit(self, conn: _Connection) -> None:
        """At the cap, the oldest connection goes: a legitimate client is answered within
        milliseconds, so a client still open after the others arrived is the one to drop."""
        while len(self._open) >= self.limits.max_connections:
            oldest = next(iter(self._open))
            self._forget(oldest)
            oldest.close()
            self.evicted += 1
            now = self.clock()
            if self._warned_at is None or now - self._warned_at >= 60:
                self._warned_at = now
                log.warning("http: %d connections open, the most allowed; closing the oldest for "
                            "each new one (%d so far)", self.limits.max_connections, self.evicted)
        self._open[conn] = None

    def _forget(self, conn: _Connection) -> None:
        self._open.pop(conn, None)
