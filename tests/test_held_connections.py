"""Connections held past the gRPC server's bound (issue 30 #1): the server admits 12 at once
(grpcserver.MAX_CONNECTIONS) and closes one more at once, so whoever holds a dozen kept the
liveness self-check's call out, /healthz answered 503 for as long as they were held, and the
kubelet restarted the daemon. The self-check now needs no slot: when its call is refused
UNAVAILABLE, the server's transport accepting a connection (and closing it, at the bound)
proves the server lives (grpcserver.transport_answers).

Each daemon is a real process on the kubelet emulator. The connections are taken before the
first /healthz, so the self-check has no connection of its own yet; held as the issue held them:
silent, with a ListAndWatch stream that is never read, and beside clients calling Allocate on
channels of their own. Each one the server closes is opened again, as a retrying client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.exceptions
import h2.settings
import pytest
from harness import Node, needs_kvm, on_kubelet, short_dir, wait_until
from support.waits import quiet

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.kubelet.grpcserver import MAX_CONNECTIONS, transport_answers
from hlplugin.tools.emulator import AdmissionError

DAEMONS = {
    # daemon: (its arguments beside --plugin-dir, resource, socket, an ID it advertises)
    "serve": (["serve", "--device-count", "4"], "hyperlight.dev/hypervisor", "hyperlight.sock",
              "kvm-1"),
    "bootstrap": (["bootstrap", "--dev-dir", "/dev"], "hyperlight.dev/device-access",
                  "hyperlight-device-access.sock", "device-access-kvm"),
}
HOLD = 8.0  # seconds /healthz is probed while the connections are held: over a check's bound
PROBE_EVERY = 0.5
RECOVERY = 5.0  # the bound, from the connections going, for /healthz and a new dial
LIST_AND_WATCH = [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                  (":path", "/v1beta1.DevicePlugin/ListAndWatch"),
                  ("content-type", "application/grpc"), ("te", "trailers")]


def stalled_stream() -> h2.connection.H2Connection:
    """A ListAndWatch call with a flow-control window of 0: the server can never send it a list,
    while the connection answers what HTTP/2 asks of it (SETTINGS and PING acknowledgements), as
    a client that stopped reading its stream does."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, LIST_AND_WATCH)
    conn.send_data(sid, b"\0\0\0\0\0", end_stream=True)  # the empty request message
    return conn


class Holder:
    """Keeps ``count`` connections to a unix socket open from a thread (an attacker's process):
    each one the server closes is opened again after ``retry`` seconds (gRPC's first backoff).
    Silent ones send nothing and drop what they are sent; ``stream`` ones hold a stalled
    ListAndWatch stream each."""

    def __init__(self, path: str, count: int, stream: bool, retry: float = 1.0) -> None:
        self.path, self.count, self.retry, self.stream = path, count, retry, stream
        self.opened = 0
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="holder", daemon=True)

    def __enter__(self) -> Holder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        due: list[float] = [0.0] * self.count  # when each closed connection opens again
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                ready = [when for when in due if when <= now]
                due[:] = [when for when in due if when > now]
                for _ in ready:
                    self._open(selector, due)
                for key, _events in selector.select(0.02):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    conn = key.data
                    try:
                        data = sock.recv(65536)
                        if data and conn is not None:
                            conn.receive_data(data)
                            sock.sendall(conn.data_to_send())  # small: acknowledgements
                    except (OSError, h2.exceptions.ProtocolError):
                        data = b""
                    if not data:
                        self.closed_by_server += 1
                        selector.unregister(sock)
                        sock.close()
                        due.append(time.monotonic() + self.retry)
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            selector.close()

    def _open(self, selector: selectors.BaseSelector, due: list[float]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = stalled_stream() if self.stream else None
        try:
            sock.connect(self.path)
            if conn is not None:
                sock.sendall(conn.data_to_send())
        except OSError:
            sock.close()
            due.append(time.monotonic() + self.retry)
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, conn)
        self.opened += 1


@contextlib.asynccontextmanager
async def allocating(path: str, clients: int, device: str) -> AsyncIterator[list[int]]:
    """``clients`` clients calling Allocate in a loop, each on a channel (and connection) of its
    own; yields how many calls each had answered."""
    answered = [0] * clients
    running = True

    async def one(index: int) -> None:
        # A pool of its own: in one process, channels to one target would share a connection.
        async with grpc.aio.insecure_channel(
                f"unix://{path}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[device])])
            while running:
                try:
                    await stub.Allocate(request, timeout=5)
                    answered[index] += 1
                except grpc.aio.AioRpcError:
                    await quiet(0.05, "a refused client's retry pace")

    tasks = [asyncio.create_task(one(i)) for i in range(clients)]
    try:
        yield answered
    finally:
        running = False
        await asyncio.gather(*tasks, return_exceptions=True)


async def dial(path: str, timeout: float, wait: bool = False) -> grpc.StatusCode:
    """A client that dials anew, as a restarted kubelet does: a call on a fresh connection
    (``wait``: until it connects, within ``timeout``, as the kubelet's first call waits)."""
    async with grpc.aio.insecure_channel(
            f"unix://{path}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                pb.Empty(), timeout=timeout, wait_for_ready=wait)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


CASES = {
    # case: (connections held, each with a ListAndWatch stream?, Allocate clients beside them)
    "silent": (40, False, 0),
    "listandwatch": (500, True, 0),
    "stalled_streams_and_allocates": (8, True, 16),
}


@needs_kvm
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which", list(DAEMONS))
async def test_connections_held_past_the_bound_never_fail_healthz(
        tmp_path: Path, which: str, case: str) -> None:
    args, resource, socket_name, device = DAEMONS[which]
    count, stream, clients = CASES[case]
    node = Node.make(tmp_path)
    path = str(node.plugin_dir / socket_name)
    argv = node.serve_args(*args[1:]) if which == "serve" else [
        args[0], "--plugin-dir", str(node.plugin_dir), *args[1:]]
    async with on_kubelet(node, argv) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0, timeout=30)
        with Holder(path, count, stream) as holder:
            async with allocating(path, clients, device) as answered:
                # Past the bound: the server turns connections away, and a new client is refused.
                async def refused() -> bool:
                    return await dial(path, 1.0) == grpc.StatusCode.UNAVAILABLE

                await wait_until(refused, 15, "a new client refused", step=0.1)
                codes: list[int] = []
                began = time.monotonic()
                while time.monotonic() - began < HOLD:  # the first probe starts the first check
                    codes.append((await proc.get("/healthz"))[0])
                    await quiet(PROBE_EVERY, "the pace of a kubelet probing often")
                # The kubelet's own connection, opened before, still carries its calls and stream.
                try:
                    await kubelet.allocate(resource, [[device]], timeout=5)
                except AdmissionError as exc:
                    pytest.fail(f"the kubelet's Allocate failed while others held the bound: {exc}")
                assert kubelet.registered(resource)
                held = holder.opened - holder.closed_by_server
        gone = time.monotonic()
        code = await dial(path, RECOVERY, wait=True)
        redial = time.monotonic() - gone
        # Not the verdict of a check made while they were held (that was the 503 after they went).
        status, body = await proc.get("/healthz")
        recovered = time.monotonic() - gone
        assert kubelet.registered(resource)
    print(f"{which} {case}: {holder.opened} connections opened, {holder.closed_by_server} closed "
          f"by the server, {held} still open on its side at the end; Allocates answered beside them "
          f"{sum(answered)}; /healthz while held {codes}; after: a new dial in {redial:.2f} s, "
          f"/healthz {status} at the first probe, {recovered:.2f} s")
    assert codes and all(c == 200 for c in codes), codes
    assert code == grpc.StatusCode.OK and redial < RECOVERY, (code, redial)
    assert status == 200 and b'"ok"' in body, (status, body)


# -- transport_answers: what it tells apart, in process ---------------------------------------


async def test_the_transport_answers_under_and_at_the_bound_of_a_live_server() -> None:
    path = short_dir() / "p.sock"
    server = grpc.aio.server(options=[("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS)])
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        assert await transport_answers(path, 2.0)
        with Holder(str(path), 3 * MAX_CONNECTIONS, stream=False) as holder:
            await wait_until(lambda: holder.closed_by_server > 0, 15, "the bound reached")
            # A holder's connection may be between its close and its reconnect: ask a few times.
            codes = [await dial(str(path), 1.0) for _ in range(5)]
            assert grpc.StatusCode.UNAVAILABLE in codes, codes
            assert await transport_answers(path, 2.0)
    finally:
        await server.stop(None)
    assert not await transport_answers(path, 2.0)  # gone: nothing to connect to


async def test_a_socket_nobody_accepts_on_or_nobody_listens_on_does_not_answer() -> None:
    directory = short_dir()
    queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued.bind(str(directory / "queued.sock"))
    queued.listen(8)  # the kernel completes connections; nobody accepts them (a wedged server)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(directory / "dead.sock"))  # a file left by a server that has gone
    dead.close()
    try:
        began = time.monotonic()
        assert not await transport_answers(directory / "queued.sock", 0.5)
        assert time.monotonic() - began < 5  # a guard: ended by its timeout
        assert not await transport_answers(directory / "dead.sock", 0.5)
        assert not await transport_answers(directory / "missing.sock", 0.5)
    finally:
        queued.close()


