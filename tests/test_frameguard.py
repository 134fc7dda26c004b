"""The frame guard (src/hlplugin/deviceplugin/frameguard.py): a real grpc.aio DevicePlugin server
behind it on unix sockets answers real clients, large messages included; the CONTINUATION flood
is cut off per connection and the server's peak memory stays within 8 MiB of where it was (the
server a child process, so that the figure is its own) while a legitimate client keeps being
answered; half-closes, backpressure and shutdown are those of a plain socket.

Floods are bounded in bytes and to about a second.
"""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import contextlib
import fcntl
import logging
import os
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest
from frameguard_server import (
    CONTINUATION,
    FRAME,
    MAX_MESSAGE,
    UPDATES,
    flood,
    flood_opening,
    frame,
    serving,
)

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin import frameguard
from hlplugin.deviceplugin.frameguard import (
    MAX_CONTINUATIONS,
    MAX_HEADER_BLOCK,
    MAX_STREAMS,
    PREFACE,
    FrameGuard,
    FrameReader,
    ServerFrames,
)
from hlplugin.tools.drive import proc_status

SERVER = Path(__file__).with_name("frameguard_server.py")
GROWTH_KIB = 8 * 1024
ANSWER_WITHIN = 2.0
# Bytes the kernel takes from a writer before the guard's reader sees them (socket buffers on
# both hops, the guard's 64 KiB write buffer): a flood connection is cut off well before this.
SLACK = 2 * 1024 * 1024


@contextlib.contextmanager
def child_server(public: Path, guarded: bool) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(SERVER), str(public),
                             *([] if guarded else ["--no-guard"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def hwm_kib(proc: subprocess.Popen[str]) -> int:
    return proc_status(proc.pid)["VmHWM"]


@contextlib.asynccontextmanager
async def stub(path: Path) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE),
               ("grpc.max_send_message_length", MAX_MESSAGE)]
    async with grpc.aio.insecure_channel(f"unix://{path}", options=options) as channel:
        yield pb_grpc.DevicePluginStub(channel)


def allocate(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


# The reader alone: where a header block is counted and where it is not.

def headers(length: int, end: bool, stream: int = 1) -> bytes:
    return frame(0x1, 0x4 if end else 0, stream, b"h" * length)


def continuation(length: int, end: bool, stream: int = 1) -> bytes:
    return frame(0x9, 0x4 if end else 0, stream, b"c" * length)


def feed_split(data: bytes, step: int) -> str | None:
    """The whole of ``data`` through one reader, ``step`` bytes at a time."""
    reader = FrameReader()
    for at in range(0, len(data), step):
        if refusal := reader.feed(data[at:at + step]):
            return refusal
    return None


@pytest.mark.parametrize("step", [1, 7, 9, 4096, 1 << 20])
def test_reader_bounds_a_header_block_however_the_bytes_arrive(step: int) -> None:
    opening = PREFACE + frame(0x4, 0, 0, b"")
    # Exactly at the bound passes, one byte over is refused, in HEADERS and CONTINUATIONs.
    at_bound = headers(1000, False) + continuation(MAX_HEADER_BLOCK - 1000, True)
    assert feed_split(opening + at_bound, step) is None
    over = headers(1000, False) + continuation(MAX_HEADER_BLOCK - 999, False)
    assert "header block of 65537 bytes" in (feed_split(opening + over, step) or "")
    # Blocks are counted one at a time: END_HEADERS ends one.
    many = b"".join(headers(FRAME, False, s) + continuation(FRAME, True, s) for s in range(1, 40, 2))
    assert feed_split(opening + many, step) is None
    # DATA, however large, is never a header block, nor does it end one's count (grpc refuses it).
    data = frame(0x0, 0x1, 1, b"d" * (4 << 20))
    assert feed_split(opening + headers(100, True) + data + data, step) is None
    # Empty CONTINUATIONs grow no block but are counted.
    empties = headers(10, False) + continuation(0, False) * (MAX_CONTINUATIONS - 1)
    assert feed_split(opening + empties + continuation(0, True), step) is None
    assert "CONTINUATION" in (feed_split(opening + empties + continuation(0, False) * 2, step) or "")


def test_reader_counts_a_push_promise_and_only_a_continuation_extends_a_block() -> None:
    opening = PREFACE + frame(0x4, 0, 0, b"")
    assert feed_split(opening + frame(0x5, 0, 1, b"p" * 100)
                      + continuation(MAX_HEADER_BLOCK, False), 4096)
    # A frame in the middle of a block is grpc's protocol error; the next CONTINUATION opens none.
    cut = headers(MAX_HEADER_BLOCK - 10, False) + frame(0x8, 0, 0, b"w" * 4) + continuation(100, False)
    assert feed_split(opening + cut, 4096) is None
    # So is a CONTINUATION after END_HEADERS: the block it would extend is over.
    stray = headers(MAX_HEADER_BLOCK - 10, True) + continuation(100, False)
    assert feed_split(opening + stray, 4096) is None


def test_the_streams_the_server_ended_leave_once_their_end_passed_whole() -> None:
    """What a hand-over waits on: a stream the client opened is open until the frame carrying the
    server's END_STREAM (or its header block's last CONTINUATION) or a reset has passed whole,
    however the bytes arrive."""
    for step in (1, 7, 4096):
        streams: set[int] = set()
        client, server = FrameReader(streams), ServerFrames(streams)

        def feed(reader: FrameReader | ServerFrames, data: bytes, step: int = step) -> None:
            for at in range(0, len(data), step):
                assert reader.feed(data[at:at + step]) is None

        feed(client, PREFACE + frame(0x4, 0, 0, b"") + headers(50, True, 1) + headers(50, True, 3)
             + headers(50, True, 5) + frame(0x0, 0x1, 1, b"request"))
        assert streams == {1, 3, 5}  # the client's END_STREAM ends nothing the server owes
        feed(server, frame(0x4, 0, 0, b"") + headers(30, True, 1) + frame(0x0, 0, 1, b"list"))
        assert streams == {1, 3, 5}
        trailers = frame(0x1, 0x1 | 0x4, 1, b"t" * 40)
        feed(server, trailers[:-1])
        assert 1 in streams  # its last byte not yet passed
        feed(server, trailers[-1:])
        assert streams == {3, 5}
        feed(server, frame(0x1, 0x1, 3, b"t" * 20) + continuation(10, False, 3))
        assert streams == {3, 5}  # the block is not whole
        feed(server, continuation(10, True, 3))
        assert streams == {5}
        feed(client, frame(0x3, 0, 5, b"\0\0\0\x08"))  # the client resets it
        assert streams == set()
        feed(client, headers(50, True, 7) + headers(50, True, 9))
        feed(server, frame(0x3, 0, 7, b"\0\0\0\x07") + frame(0x0, 0x1, 9, b""))  # empty DATA
        assert streams == set()
    # HEADERS on fresh ids, one read of thousands: a bounded number is kept.
    streams = set()
    fresh = b"".join(headers(0, True, s) for s in range(1, 20001, 2))
    assert FrameReader(streams).feed(PREFACE + fresh) is None
    assert len(streams) == MAX_STREAMS


# A real gRPC client through the guard.

async def test_a_grpc_client_is_answered_through_the_guard(tmp_path: Path) -> None:
    public = tmp_path / "plugin.sock"
    async with serving(public) as guard, stub(public) as plugin:
        assert guard is not None
        await plugin.GetDevicePluginOptions(pb.Empty(), timeout=5)
        answer = await plugin.Allocate(allocate("kvm-1", "kvm-2"), timeout=5)
        assert answer.container_responses[0].envs["IDS"] == "kvm-1,kvm-2"
        lists = [len(r.devices) async for r in plugin.ListAndWatch(pb.Empty(), timeout=5)]
        assert lists == list(range(1, UPDATES + 1))
        assert guard.connections == 1 and guard.refusals == 0


async def test_large_messages_pass_both_ways(tmp_path: Path) -> None:
    """A request of 4 MiB (DATA frames are skipped, not counted), and an answer of 4 MiB that
    the client reads from the guard's side of the connection."""
    public = tmp_path / "plugin.sock"
    async with serving(public) as guard, stub(public) as plugin:
        assert guard is not None
        ids = [f"kvm-{i:07d}" for i in range(4 * 1024 * 1024 // 14)]
        answer = await plugin.Allocate(allocate(*ids), timeout=10)
        assert answer.container_responses[0].envs["COUNT"] == str(len(ids))
        answer = await plugin.Allocate(allocate(f"pad-{4 << 20}"), timeout=10)
        assert len(answer.container_responses[0].envs["PAD"]) == 4 << 20
        assert guard.refusals == 0


async def test_the_flood_closes_its_connection_and_the_client_is_answered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process: each flood connection is cut off near the bound, counted, and logged once."""
    public = tmp_path / "plugin.sock"
    caplog.set_level(logging.WARNING, logger=frameguard.__name__)
    async with serving(public) as guard, stub(public) as plugin:
        assert guard is not None
        result = await flood(public, connections=4, budget=8 << 20, seconds=1.0, reconnect=False)
        assert result.closed == 4 and result.most < SLACK, result
        await plugin.Allocate(allocate("kvm-1"), timeout=ANSWER_WITHIN)
        assert guard.refusals == 4
    warnings = [r for r in caplog.records if "CONTINUATION flood" in r.getMessage()]
    assert len(warnings) == 1 and "past the bound of 65536 bytes" in warnings[0].getMessage()


# The flood against a server process of its own: its peak memory, and a client all along.

async def answers_all_along(path: Path, stop: asyncio.Event) -> list[float]:
    """Allocate, one call at a time, until ``stop``; the time each took."""
    times = []
    async with stub(path) as plugin:
        while not stop.is_set():
            began = time.monotonic()
            await plugin.Allocate(allocate("kvm-1"), timeout=ANSWER_WITHIN)
            times.append(time.monotonic() - began)
            await asyncio.sleep(0.02)
    return times


async def flood_a_child(public: Path, guarded: bool, connections: int,
                        budget: int) -> tuple[int, list[float], object]:
    """The child's VmHWM growth (KiB) over the flood, the client's call times, the flood's result."""
    with child_server(public, guarded) as proc:
        async with stub(public) as plugin:  # warm: a call served before the peak is taken
            for _ in range(20):
                await plugin.Allocate(allocate("kvm-1"), timeout=5)
        before = hwm_kib(proc)
        stop = asyncio.Event()
        client = asyncio.create_task(answers_all_along(public, stop))
        try:
            result = await flood(public, connections, budget, seconds=1.5)
            await asyncio.sleep(0.3)
        finally:
            stop.set()
        times = await client
        return hwm_kib(proc) - before, times, result


@pytest.mark.parametrize("connections", [4, 48])
async def test_the_flood_leaves_the_server_s_memory_bounded(tmp_path: Path, connections: int) -> None:
    growth, times, result = await flood_a_child(tmp_path / "plugin.sock", True, connections,
                                                budget=64 << 20)
    print(f"guarded, {connections} connections: +{growth / 1024:.1f} MiB, {result}")
    assert growth <= GROWTH_KIB, (growth, result)
    assert result.closed >= connections and result.most < SLACK, result  # type: ignore[attr-defined]
    assert times and max(times) < ANSWER_WITHIN


async def test_without_the_guard_the_same_flood_grows_the_server(tmp_path: Path) -> None:
    """The flood above is a real one: unguarded, the same server holds it (the guard's bound is
    not met by chance)."""
    growth, _, result = await flood_a_child(tmp_path / "plugin.sock", False, 4, budget=16 << 20)
    print(f"unguarded: +{growth / 1024:.1f} MiB, {result}")
    assert growth > GROWTH_KIB and result.closed == 0, (growth, result)  # type: ignore[attr-defined]


# The guard as a socket: half-close, backpressure, ends, shutdown.

@contextlib.asynccontextmanager
async def kept_connection(tmp_path: Path) -> AsyncIterator[
        tuple[FrameGuard, socket.socket, list[asyncio.StreamWriter]]]:
    """A guard in front of a server that keeps each connection until its client ends it (its
    writers, for a test to write the server's side), and one non-blocking client connected."""
    writers: list[asyncio.StreamWriter] = []

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read()
        writer.close()

    server = await asyncio.start_unix_server(keeps, str(tmp_path / "up.sock"))
    async with server, guard_before(server, tmp_path / "g.sock") as guard:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.setblocking(False)
            await asyncio.get_running_loop().sock_connect(client, str(tmp_path / "g.sock"))
            yield guard, client, writers


@contextlib.asynccontextmanager
async def guard_before(upstream: asyncio.Server, path: Path) -> AsyncIterator[FrameGuard]:
    """A guard at ``path`` forwarding to a plain asyncio server (no HTTP/2 needed past the
    guard's reader)."""
    address = f"unix:{upstream.sockets[0].getsockname()}"
    guard = FrameGuard(address)
    await guard.listen(path)
    try:
        yield guard
    finally:
        await guard.close()


async def connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(PREFACE + frame(0x4, 0, 0, b""))
    return reader, writer


async def test_a_half_close_is_passed_on_both_ways(tmp_path: Path) -> None:
    """The client's EOF reaches the server, whose answer after it still reaches the client; then
    the server's EOF the client's, and the client may still write."""
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read()  # until the client's EOF
        writer.write(b"answer after EOF: %d bytes" % len(first))
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def talks_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        writer.write_eof()  # the server half-closes first
        await got.put(await reader.read())
        writer.close()
        await writer.wait_closed()

    for handler, client_first in ((upstream, True), (talks_on, False)):
        server = await asyncio.start_unix_server(handler, str(tmp_path / "up.sock"))
        async with server, guard_before(server, tmp_path / f"g{client_first}.sock") as guard:
            reader, writer = await connect(tmp_path / f"g{client_first}.sock")
            if client_first:
                writer.write(frame(0x0, 0x1, 1, b"x" * 100))
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 2) == b"answer after EOF: 142 bytes"
            else:
                assert await asyncio.wait_for(reader.read(), 2) == b"hello"  # its EOF reached us
                writer.write(frame(0x0, 0x1, 1, b"y" * 10))
                writer.write_eof()
                assert await asyncio.wait_for(got.get(), 2) == PREFACE + frame(0x4, 0, 0, b"") \
                    + frame(0x0, 0x1, 1, b"y" * 10)
            writer.close()
            await writer.wait_closed()
            await wait_for(lambda: guard.connections == 0)
        os.unlink(tmp_path / "up.sock")


async def wait_for(condition: object, timeout: float = 2.0) -> None:
    until = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < until, "not within the timeout"
        await asyncio.sleep(0.01)


async def test_a_side_that_stops_reading_holds_back_the_other(tmp_path: Path) -> None:
    """No unbounded buffer in the guard: a server that reads nothing stops the client's writes,
    and a client that reads nothing stops the server's, each after a few socket buffers."""
    loop = asyncio.get_running_loop()
    upstream_writer: list[asyncio.StreamWriter] = []
    reading = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writer.append(writer)
        await reading.wait()
        writer.close()

    server = await asyncio.start_unix_server(never_reads, str(tmp_path / "up.sock"))
    async with server, guard_before(server, tmp_path / "g.sock") as guard:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(tmp_path / "g.sock"))
            taken = 0
            data = PREFACE + frame(0x4, 0, 0, b"") + headers(50, True)
            for _ in range(8):  # a write blocked for 0.3 s is held back
                try:
                    async with asyncio.timeout(0.3):
                        await loop.sock_sendall(sock, data)
                except TimeoutError:
                    break
                taken += len(data)
                data = frame(0x0, 0, 1, b"d" * (1 << 20))
            assert taken < 4 << 20, taken
            # The other way: the server writes to a client that reads nothing.
            await wait_for(lambda: bool(upstream_writer))
            writer = upstream_writer[0]
            written = 0
            for _ in range(8):
                writer.write(b"s" * (1 << 20))
                written += 1 << 20
                try:
                    await asyncio.wait_for(writer.drain(), 0.3)
                except TimeoutError:
                    break
            assert written < 4 << 20, written
            assert guard.connections == 1
        reading.set()
        await wait_for(lambda: guard.connections == 0)
    os.unlink(tmp_path / "up.sock")


async def test_an_end_on_either_side_ends_the_other(tmp_path: Path) -> None:
    """The gRPC server stopping closes its clients' connections; a client going closes its
    connection to the server; nothing listening upstream closes the client at once."""
    public = tmp_path / "plugin.sock"
    async with serving(public) as guard:
        assert guard is not None
        reader, writer = await connect(public)
        assert (await asyncio.wait_for(reader.read(9), 2))[3] == 0x4  # grpc's SETTINGS
        writer.close()
        await writer.wait_closed()
        await wait_for(lambda: guard.connections == 0)
        reader, writer = await connect(public)
        await asyncio.wait_for(reader.read(9), 2)
    # serving() stopped the server, then closed the guard: our connection ended.
    assert await asyncio.wait_for(reader.read(), 2) in (b"",) or reader.at_eof()
    writer.close()
    guard = FrameGuard(f"unix:{tmp_path / 'nothing.sock'}")
    await guard.listen(tmp_path / "g.sock")
    try:
        reader, writer = await connect(tmp_path / "g.sock")
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        await wait_for(lambda: guard.connections == 0)
    finally:
        await guard.close()


@pytest.mark.guard(10)
async def test_close_ends_every_connection_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections forwarded (one mid-way through a header block) to a server that accepts none
    (queued in its backlog), and one whose upstream connection is still being made: close() ends
    them all at once, removes its socket and leaves no task."""
    public = tmp_path / "g.sock"
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
        upstream.bind(str(tmp_path / "up.sock"))
        upstream.listen(16)
        guard = FrameGuard(f"unix:{tmp_path / 'up.sock'}")
        await guard.listen(public)
        clients = [await connect(public) for _ in range(3)]
        clients[0][1].write(headers(1000, False))
        await wait_for(lambda: guard.connections == 3 and len(asyncio.all_tasks()) == 1)

        original = loop.create_unix_connection

        async def never_upstream(factory: Any, path: str, **kwargs: Any) -> Any:
            if path == str(tmp_path / "up.sock"):
                await asyncio.Event().wait()
            return await original(factory, path, **kwargs)

        monkeypatch.setattr(loop, "create_unix_connection", never_upstream)
        clients.append(await connect(public))
        await wait_for(lambda: guard.connections == 4)
        assert len(asyncio.all_tasks()) == 2  # ours, and the one connecting
        began = time.monotonic()
        await guard.close()
        assert time.monotonic() - began < 0.5
        assert guard.connections == 0 and not public.exists()
        assert asyncio.all_tasks() == {asyncio.current_task()}
        for reader, writer in clients:
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(), 2) == b""
            writer.close()
    os.unlink(tmp_path / "up.sock")


async def test_a_cancelled_close_has_ended_everything_already(tmp_path: Path) -> None:
    server = await asyncio.start_unix_server(lambda r, w: None, str(tmp_path / "up.sock"))
    public = tmp_path / "g.sock"
    async with server:
        guard = FrameGuard(f"unix:{tmp_path / 'up.sock'}")
        await guard.listen(public)
        reader, writer = await connect(public)
        await wait_for(lambda: guard.connections == 1 and len(asyncio.all_tasks()) == 1)
        closing = asyncio.ensure_future(guard.close())
        await asyncio.sleep(0)
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        assert not public.exists()
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        await wait_for(lambda: guard.connections == 0)
    os.unlink(tmp_path / "up.sock")


async def test_listen_refuses_a_path_in_use_and_close_keeps_a_replaced_one(tmp_path: Path) -> None:
    public = tmp_path / "g.sock"
    public.write_text("not ours")
    guard = FrameGuard(f"unix:{tmp_path / 'up.sock'}")
    with pytest.raises(OSError):
        await guard.listen(public)
    assert public.read_text() == "not ours"
    public.unlink()
    await guard.listen(public)
    os.rename(public, tmp_path / "moved.sock")
    public.write_text("a successor's")
    await guard.close()
    assert public.read_text() == "a successor's" and (tmp_path / "moved.sock").exists()


def test_addresses_in_grpc_s_spelling() -> None:
    assert frameguard._connect_path("unix-abstract:x") == "\0x"
    assert frameguard._connect_path("unix:/a/b") == "/a/b"
    assert frameguard._connect_path("unix:///a/b") == "/a/b"
    assert frameguard.abstract_address() != frameguard.abstract_address()
    with pytest.raises(ValueError, match="not a unix"):
        frameguard._connect_path("localhost:50051")


def test_the_flood_is_an_allocate_whose_headers_never_end() -> None:
    """What the flood sends decodes as HPACK: the Allocate request's fields, then 16 KiB frames of
    whole header fields (what grpc keeps), none of them ending the block."""
    opening = flood_opening()
    assert opening.startswith(PREFACE + frame(0x4, 0, 0, b""))
    head = opening[len(PREFACE) + 9:]
    assert head[3:5] == bytes([0x1, 0])  # HEADERS, no END_HEADERS
    decoder = hpack.Decoder()
    assert ("/v1beta1.DevicePlugin/Allocate" in dict(decoder.decode(head[9:])).values())
    assert CONTINUATION[3:5] == bytes([0x9, 0]) and len(CONTINUATION) - 9 <= FRAME
    assert {f for f in decoder.decode(CONTINUATION[9:])} == {("x-pa", "v" * 100)}


def add_reader_as_in_python_3_11_2(self: Any, fd: int, callback: Any, *args: Any) -> None:
    """asyncio's _SelectorTransport._add_reader as Debian bookworm's Python 3.11.2 has it (the
    image's): it starts reading even when connection_made() paused the transport (later
    releases check is_reading() first)."""
    if self._closing:
        return
    self._loop._add_reader(fd, callback, *args)


async def test_what_a_client_sends_before_the_upstream_connection_is_made_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet writes its preface the moment it connects; the guard's connection to gRPC is
    made a loop turn or more later. Reading paused in connection_made() held those bytes back on
    a recent Python only: on the image's (3.11.2) the guard read them with nowhere to send them
    and dropped them, gRPC closed the connection for the missing preface, and the kubelet's
    GetDevicePluginOptions failed (error reading from server: EOF), so registrations failed and
    were retried with backoff: 5 to 15 s hand-over gaps on the real cluster (issue 40). What
    arrives first is kept (one read at most: reading pauses) and sent once connected."""
    monkeypatch.setattr(asyncio.selector_events._SelectorTransport, "_add_reader",
                        add_reader_as_in_python_3_11_2)
    gate = asyncio.Event()
    connect = frameguard._Pair.connect

    async def late(pair: frameguard._Pair, address: str) -> None:
        await gate.wait()
        await connect(pair, address)

    monkeypatch.setattr(frameguard._Pair, "connect", late)
    got: list[bytes] = []

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read())
        writer.close()

    server = await asyncio.start_unix_server(keeps, str(tmp_path / "up.sock"))
    async with server, guard_before(server, tmp_path / "g.sock") as guard:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(client, str(tmp_path / "g.sock"))
            sent = PREFACE + frame(0x4, 0, 0, b"") + headers(20, True, 1) + b"d" * 100_000
            await loop.sock_sendall(client, sent)
            # The guard has read what it could before the upstream connection is made.
            await wait_for(lambda: unread(client) < len(sent))
            gate.set()
            await loop.sock_sendall(client, b"more")
            client.shutdown(socket.SHUT_WR)
            await wait_for(lambda: bool(got))
            assert got == [sent + b"more"]
            assert guard.refusals == 0
    os.unlink(tmp_path / "up.sock")


def unread(sock: socket.socket) -> int:
    """Bytes written on ``sock`` that its peer has not read yet (SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0])


async def test_forwarded_returns_once_what_the_server_sent_is_with_the_client(tmp_path: Path) -> None:
    """What a hand-over waits on before its socket goes: the server's bytes written to the
    client's socket (readable there without this loop running again); bounded by its timeout
    for a client that reads nothing."""
    async with kept_connection(tmp_path) as (guard, client, writers):
        await wait_for(lambda: bool(writers))
        writers[0].write(b"the stream's end")  # sent on the upstream socket at once
        await guard.forwarded(2.0)
        assert client.recv(100) == b"the stream's end"  # no await between: already there
        # A client that reads nothing: the guard holds what the kernel does not take.
        writers[0].write(b"x" * (8 << 20))
        began = time.monotonic()
        await guard.forwarded(0.2)
        assert 0.15 < time.monotonic() - began < 1.0
        assert any(pair.holding() for pair in guard._pairs)
    os.unlink(tmp_path / "up.sock")


async def test_forwarded_waits_for_the_streams_given_to_be_ended_and_with_the_client(
        tmp_path: Path) -> None:
    """A hand-over takes the streams open (streams()) before it ends its ListAndWatch streams:
    forwarded() returns once the server's end of each has been written to its client, not when
    the server's other bytes are; a stream opened after the look is not waited for."""
    async with kept_connection(tmp_path) as (guard, client, writers):
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client, PREFACE + frame(0x4, 0, 0, b"") + headers(20, True, 1))
        await wait_for(lambda: bool(writers) and guard.streams())
        streams = guard.streams()
        await loop.sock_sendall(client, headers(20, True, 3))  # after the look
        writers[0].write(frame(0x1, 0x4, 1, b"h" * 10) + frame(0x0, 0, 1, b"list"))
        waiting = asyncio.create_task(guard.forwarded(5.0, streams))
        # A bounded watch, 0.3 s: the server's bytes are with the client, its end is not.
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done
        writers[0].write(frame(0x1, 0x1 | 0x4, 1, b"t" * 10))
        await waiting
        received = client.recv(1000)  # no await between: already there
        assert received.endswith(frame(0x1, 0x1 | 0x4, 1, b"t" * 10))
        assert [ids for _, ids in guard.streams()] == [frozenset({3})]
    os.unlink(tmp_path / "up.sock")


async def test_close_lets_the_server_s_closed_connections_end_in_order_first(tmp_path: Path) -> None:
    """close(drain): a connection the server has closed is closed on the client's side after what
    the server sent (read to its end, no reset); one still open upstream is ended at the drain's
    end."""
    writers: list[asyncio.StreamWriter] = []

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read()

    server = await asyncio.start_unix_server(keeps, str(tmp_path / "up.sock"))
    async with server:
        guard = FrameGuard(f"unix:{server.sockets[0].getsockname()}")
        await guard.listen(tmp_path / "g.sock")
        done_reader, done_writer = await connect(tmp_path / "g.sock")
        await wait_for(lambda: len(writers) == 1)  # writers[0] is this one's upstream side
        open_reader, open_writer = await connect(tmp_path / "g.sock")
        await wait_for(lambda: len(writers) == 2)
        writers[0].write(b"goodbye")
        writers[0].close()  # the server ends this one, as a stopping gRPC server does
        began = time.monotonic()
        await guard.close(drain=0.3)
        assert 0.25 < time.monotonic() - began < 1.0  # the open one held the drain to its end
        assert await asyncio.wait_for(done_reader.read(), 2) == b"goodbye"
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(open_reader.read(), 2) == b""
        for writer in (done_writer, open_writer):
            writer.close()
    os.unlink(tmp_path / "up.sock")
