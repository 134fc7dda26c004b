"""One HTTP/1.1 exchange with the API server: asyncio streams, TLS from ``ssl``, parsed by h11.

One connection per request (``Connection: close``), which is what step 1 needs: the driver makes
a handful of calls a minute and keeps one watch open, so a TLS handshake per call (about a
millisecond of CPU against a server in the cluster) costs less than a pool's code and its
failure modes (a pooled connection the server half-closed). A pool can come later behind
``exchange`` without changing a caller.

Bounds, so a broken or hostile server cannot stall or swell a node's daemon:

- connect (TCP and TLS) within ``connect_timeout`` (5 s); every read within ``read_timeout``
  (30 s; a watch's reads within its own server-side timeout plus that);
- a response's head within 16 KiB (h11's bound), its body within ``max_body``: 4 MiB, above any
  one object the API server can store (etcd refuses a request over 1.5 MiB, and an object's JSON
  is at most a few times its stored protobuf) and far above our lists (one node's slices, a few
  KiB each), while the dicts parsed from 4 MiB of JSON (some ten times that) still fit in the
  daemon's memory limit. A list that could pass it must page (``limit``/``continue``). A watch
  bounds each event (one JSON line, one object) by the same figure, not the endless stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import h11

from hlplugin.kubeapi.config import Config
from hlplugin.kubeapi.errors import ResponseTooLarge, Unreachable

READ_CHUNK = 64 * 1024
MAX_HEAD = 16 * 1024


@dataclass(frozen=True)
class Request:
    method: str
    target: str  # path and query
    headers: list[tuple[str, str]]
    body: bytes = b""


class Stream:
    """A response being read: its status and headers at once, its body as it comes."""

    def __init__(self, connection: h11.Connection, reader: asyncio.StreamReader,
                 read_timeout: float, max_body: int) -> None:
        self._connection, self._reader = connection, reader
        self._read_timeout, self.max_body = read_timeout, max_body
        self.status = 0
        self.headers: dict[str, str] = {}

    async def head(self) -> None:
        event = await self._next()
        if not isinstance(event, h11.Response):
            raise Unreachable(f"the API server answered no response head ({type(event).__name__})")
        self.status = event.status_code
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's data as it arrives, until the message ends."""
        while True:
            event = await self._next()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise Unreachable(f"the API server's response broke off ({type(event).__name__})")

    async def body(self) -> bytes:
        """The whole body, refused past ``max_body`` (a Content-Length over it before a byte)."""
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise ResponseTooLarge(f"the API server's answer of {declared} bytes is over the "
                                   f"client's bound of {self.max_body}")
        data = bytearray()
        async for chunk in self.chunks():
            data += chunk
            if len(data) > self.max_body:
                raise ResponseTooLarge(f"the API server's answer is over the client's bound of "
                                       f"{self.max_body} bytes")
        return bytes(data)

    async def lines(self) -> AsyncIterator[bytes]:
        """Newline-separated records (a watch's events), each within ``max_body``."""
        pending = bytearray()
        async for chunk in self.chunks():
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                line = self._bounded(pending[:end])
                del pending[:end + 1]
                if line:
                    yield line
            if len(pending) > self.max_body:  # nor may a line still coming
                self._bounded(pending)
        if line := self._bounded(pending):
            yield line

    def _bounded(self, line: bytearray) -> bytes:
        if len(line) > self.max_body:
            raise ResponseTooLarge(f"a watch event is over the client's bound of {self.max_body} bytes")
        return bytes(line).strip()

    async def _next(self) -> object:
        try:
            while True:
                event = self._connection.next_event()
                if event is not h11.NEED_DATA:
                    return event
                async with asyncio.timeout(self._read_timeout):
                    data = await self._reader.read(READ_CHUNK)
                self._connection.receive_data(data)  # b"" is the end of the stream
        except TimeoutError as exc:
            raise Unreachable(f"the API server sent nothing for {self._read_timeout:g} s") from exc
        except (OSError, h11.ProtocolError) as exc:
            raise Unreachable(f"the API server's response broke off: {exc}") from exc


@contextlib.asynccontextmanager
async def exchange(config: Config, request: Request,
                   read_timeout: float | None = None) -> AsyncIterator[Stream]:
    """Send ``request`` on a connection of its own; the response's head is read on entry, the
    connection closed on exit."""
    try:
        async with asyncio.timeout(config.connect_timeout):
            reader, writer = await asyncio.open_connection(
                config.host, config.port, ssl=config.tls, limit=READ_CHUNK)
    except TimeoutError as exc:
        raise Unreachable(f"cannot connect to the API server at {authority(config)} within "
                          f"{config.connect_timeout:g} s") from exc
    except OSError as exc:  # refused, unreachable, a certificate not verified (ssl.SSLError)
        raise Unreachable(f"cannot connect to the API server at {authority(config)}: {exc}") from exc
    try:
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        headers = [("Host", authority(config)), ("Connection", "close"), *request.headers]
        if request.body:
            headers.append(("Content-Length", str(len(request.body))))
        writer.write(_bytes(connection, h11.Request(method=request.method, target=request.target,
                                                     headers=headers)))
        if request.body:
            writer.write(_bytes(connection, h11.Data(data=request.body)))
        writer.write(_bytes(connection, h11.EndOfMessage()))
        stream = Stream(connection, reader, read_timeout or config.read_timeout, config.max_body)
        try:
            async with asyncio.timeout(config.read_timeout):
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            raise Unreachable(f"cannot send to the API server: {exc}") from exc
        await stream.head()
        yield stream
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(config.connect_timeout):
                await writer.wait_closed()


def authority(config: Config) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{config.port}"


def _bytes(connection: h11.Connection, event: h11.Request | h11.Data | h11.EndOfMessage) -> bytes:
    return connection.send(event) or b""
