"""The HTTP port against hostile clients: every bound at its edge, in process, over real TCP.

The load tests against the real daemon (2,000 slow clients, an 800-request burst, a 1,024 fd
limit) are in test_http_load.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, Node, wait_until
from prometheus_client import CollectorRegistry
from support.observers import held_connections

from hlplugin import parsers
from hlplugin.deviceplugin.process.http import HttpServer, Limits, connection_cap
from hlplugin.tools.process import free_port

HAVE_IPV6 = socket.has_ipv6
try:
    with socket.socket(socket.AF_INET6) as _probe:
        _probe.bind(("::1", 0))
except OSError:
    HAVE_IPV6 = False
needs_ipv6 = pytest.mark.skipif(not HAVE_IPV6, reason="needs IPv6 on loopback (::1)")


class Served:
    """What the server's handlers saw: a request that reaches them has been served."""

    def __init__(self) -> None:
        self.liveness = 0
        self.readiness = 0

    def alive(self) -> tuple[bool, str]:
        self.liveness += 1
        return True, ""

    def ready(self) -> dict[str, tuple[bool, str]]:
        self.readiness += 1
        return {"registered": (True, "")}


@contextlib.asynccontextmanager
async def server(limits: Limits | None = None, host: str = "127.0.0.1",
                 served: Served | None = None) -> AsyncIterator[HttpServer]:
    served = served or Served()
    http = HttpServer(served.ready, served.alive, CollectorRegistry(), limits or Limits())
    await http.start((host, 0))
    try:
        yield http
    finally:
        await http.stop()


async def exchange(port: int, data: bytes, *, host: str = "127.0.0.1", eof: bool = False,
                   timeout: float = 5.0) -> bytes:
    """Send ``data`` (then EOF if asked) and read until the server closes; b"" if it never answered."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        if eof:
            writer.write_eof()
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer else 0


def request(path: str = "/healthz", extra: bytes = b"") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + extra + b"\r\n"


async def test_head_over_the_limit_gets_431_and_is_closed() -> None:
    limits = Limits(max_head=8 * 1024)
    async with server(limits) as http:
        # Just under the limit: served.
        answer = await exchange(http.port, request(extra=b"X: " + b"a" * 7000 + b"\r\n"))
        assert status(answer) == 200
        # Over it: 431, and the server closed (exchange read to EOF), whether the head
        # arrives in one read or trickles in.
        big = request(extra=b"X: " + b"a" * 9000 + b"\r\n")
        answer = await exchange(http.port, big)
        assert status(answer) == 431 and b"connection: close" in answer.lower()
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        for i in range(0, len(big), 500):
            writer.write(big[i:i + 500])
            await writer.drain()
            if reader.at_eof():
                break
        assert status(await asyncio.wait_for(reader.read(), 5)) == 431
        writer.close()
        # A request line alone over the limit: 414.
        answer = await exchange(http.port, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n")
        assert status(answer) == 414
        # A body over its limit: 413, never read to its end.
        answer = await exchange(http.port, request(extra=b"Content-Length: 100000\r\n")
                                + b"b" * 5000)
        assert status(answer) == 413


async def test_an_answer_sent_before_the_whole_request_arrived_is_read_not_reset() -> None:
    """A 431 for a 1 MB head: the server answers after 8 KiB, sends a FIN, and drops the rest as
    it comes, so the client's sending completes and it reads the answer; closing with the rest
    unread would reset the connection, and the answer with it."""
    async with server() as http:
        def send_then_read() -> bytes:
            with socket.create_connection(("127.0.0.1", http.port), timeout=10) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 1_000_000 + b"\r\n\r\n")
                chunks = []
                while chunk := conn.recv(65536):
                    chunks.append(chunk)
                return b"".join(chunks)

        for _ in range(3):
            assert status(await asyncio.to_thread(send_then_read)) == 431


async def test_request_cut_off_by_eof_is_not_served() -> None:
    served = Served()
    async with server(served=served) as http:
        for half in [b"GET /healthz HTTP/1.1\r\nHost: x\r\n",  # no blank line: head unfinished
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc",
                     b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r"]:
            assert await exchange(http.port, half, eof=True) == b"", half
        assert (served.liveness, served.readiness) == (0, 0)
        # A whole request, then EOF (a client that half-closes): answered.
        answer = await exchange(http.port, request(), eof=True)
        assert status(answer) == 200 and served.liveness == 1


async def test_slow_request_is_closed_at_the_whole_request_deadline() -> None:
    """A client sending one byte every 50 ms never trips a per-read timeout; the whole-request
    deadline closes it anyway, unanswered, and not before the deadline."""

    served = Served()
    async with server(Limits(deadline=0.5), served=served) as http:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        started = time.monotonic()
        data = request(extra=b"X-Slow: " + b"s" * 500 + b"\r\n")
        closed_after = None
        for byte in data:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                closed_after = time.monotonic() - started
                break
            if reader.at_eof() or reader.exception() is not None:
                closed_after = time.monotonic() - started
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    if await reader.read(1) == b"":
                        closed_after = time.monotonic() - started
                        break
        writer.close()
        assert closed_after is not None, "still open after the whole request was sent"
        assert closed_after >= 0.5
        assert served.liveness == 0
        assert held_connections(http.port) == 0


async def test_connections_over_the_cap_close_the_oldest_so_a_probe_gets_in() -> None:
    async with server(Limits(max_connections=8)) as http:
        silent = [await asyncio.open_connection("127.0.0.1", http.port) for _ in range(40)]
        try:
            probe = await exchange(http.port, request())
            assert status(probe) == 200
            assert held_connections(http.port) <= 8
            # The oldest were closed: they read EOF (or a reset), with no answer.
            reader, _ = silent[0]
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(), 5) == b""
        finally:
            for _, writer in silent:
                writer.close()


def test_the_connection_cap_leaves_most_fds_to_the_daemon() -> None:
    assert connection_cap(1024) == 128
    assert connection_cap(800) == 100
    assert connection_cap(1 << 20) == 256  # and never more, whatever the limit
    assert connection_cap(16) == 4  # a probe still gets in on an absurdly low limit


async def test_endpoints_and_metrics_content_negotiation() -> None:
    async with server() as http:
        answer = await exchange(http.port, request("/readyz"))
        _, _, payload = answer.partition(b"\r\n\r\n")
        assert status(answer) == 200 and json.loads(payload)["status"] == "ready"
        answer = await exchange(http.port, request(
            "/metrics", b"Accept: application/openmetrics-text; version=1.0.0\r\n"))
        assert b"application/openmetrics-text" in answer and answer.endswith(b"# EOF\n")
        answer = await exchange(http.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(answer) == 200 and answer.endswith(b"\r\n\r\n")
        # One request per connection: a second, pipelined, is not answered.
        answer = await exchange(http.port, request() + request("/readyz"))
        assert answer.count(b"HTTP/1.1 ") == 1


@needs_ipv6
async def test_ipv6_loopback_and_dual_stack_any() -> None:
    async with server(host="::1") as http:
        assert status(await exchange(http.port, request(), host="::1")) == 200
    async with server(host="::") as http:
        assert status(await exchange(http.port, request(), host="::1")) == 200
        assert status(await exchange(http.port, request(), host="127.0.0.1")) == 200


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting what is handed to it (a getaddrinfo, say)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize(("host", "lookups"), [("127.0.0.1", 0), ("localhost", 1)])
async def test_an_ip_address_binds_without_a_lookup_thread_a_name_is_looked_up_off_the_loop(
        host: str, lookups: int) -> None:
    """Start-up: the loop's executor (a thread started for it) only for a name to resolve."""
    executor = CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    async with server(host=host) as http:
        assert status(await exchange(http.port, request())) == 200
    assert executor.submitted == lookups


@pytest.mark.parametrize(("text", "address"), [
    ("0.0.0.0:8080", ("0.0.0.0", 8080)),
    (":8080", ("0.0.0.0", 8080)),
    ("[::]:8080", ("::", 8080)),
    ("[::1]:0", ("::1", 0)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ("node-1.example.com:9090", ("node-1.example.com", 9090)),
])
def test_http_address_forms(text: str, address: tuple[str, int]) -> None:
    assert parsers.address(text) == address


@pytest.mark.parametrize(("text", "why"), [
    ("::1:8080", "brackets"),
    ("[::1]", "[IPV6]:PORT"),
    ("[not-v6]:80", "not an IPv6 address"),
    ("not a host:80", "not an IP address or a host name"),
    ("-bad.example:80", "not an IP address or a host name"),
    ("127.0.0.1:65536", "port must be 0-65535"),
    ("127.0.0.1:\uff18\uff10", "port must be 0-65535"),  # full-width digits
])
def test_http_address_refusals_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parsers.address(text)


# -- binding, through the real command line -------------------------------------------------------

async def exit_of(tmp_path: Path, address: str) -> tuple[int, list[str]]:
    node = Node.make(tmp_path)
    proc = Daemon(node.serve_args("--hypervisor", "kvm"))
    proc.args[proc.args.index("--http-address") + 1] = address
    await proc.start()
    assert proc.proc is not None
    code = await asyncio.wait_for(proc.proc.wait(), 30)
    await proc.signal()
    return code, proc.raw


async def test_port_in_use_exits_1_with_one_line_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = await exit_of(tmp_path, f"127.0.0.1:{port}")
    assert code == 1
    errors = [line for line in lines if '"level": "error"' in line or "Traceback" in line]
    assert len(errors) == 1, lines
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in errors[0]
    assert "in use" in errors[0]


async def test_unresolvable_host_exits_1_with_one_line_naming_it(tmp_path: Path) -> None:
    code, lines = await exit_of(tmp_path, "no-such-host.invalid:8080")
    assert code == 1
    errors = [line for line in lines if '"level": "error"' in line or "Traceback" in line]
    assert len(errors) == 1, lines
    assert "cannot serve HTTP on no-such-host.invalid:8080" in errors[0]


async def test_invalid_host_exits_2_naming_the_flag(tmp_path: Path) -> None:
    code, lines = await exit_of(tmp_path, "not a host:8080")
    assert code == 2
    assert any("--http-address" in line and "not a host" in line for line in lines), lines
    assert not any("Traceback" in line for line in lines)


@needs_ipv6
async def test_daemon_serves_on_ipv6_loopback(tmp_path: Path) -> None:
    port = free_port()
    node = Node.make(tmp_path)
    proc = Daemon(node.serve_args("--hypervisor", "kvm"))
    proc.args[proc.args.index("--http-address") + 1] = f"[::1]:{port}"
    await proc.start()

    async def answers() -> bool:
        with contextlib.suppress(OSError):
            return status(await exchange(port, request(), host="::1")) == 200
        return False

    try:
        await wait_until(answers, 15, "a 200 on [::1]", step=0.05)
        assert any(f"on [::1]:{port}" in m for m in proc.messages())
    finally:
        assert await proc.stop() == 0
