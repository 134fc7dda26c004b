"""A trivial DevicePlugin gRPC server, with or without the frame guard in front, and the
CONTINUATION flood against a unix socket (tests/test_frameguard.py).

As a script it serves until its stdin closes, so a test can measure the process's own memory:

    python tests/frameguard_server.py PUBLIC_SOCKET [--no-guard]

It prints "ready" once the socket answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import hpack

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.frameguard import PREFACE, FrameGuard, abstract_address

MAX_MESSAGE = 8 * 1024 * 1024
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
           ("grpc.max_send_message_length", MAX_MESSAGE)]
UPDATES = 3  # ListAndWatch responses before the stream ends


class Plugin(pb_grpc.DevicePluginServicer):
    """Answers from its request alone: Allocate echoes its IDs (and ``pad`` bytes asked for by the
    first ID ``pad-N``), ListAndWatch sends UPDATES lists and ends."""

    async def GetDevicePluginOptions(self, request: pb.Empty, context: object) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request: pb.Empty,
                           context: object) -> AsyncIterator[pb.ListAndWatchResponse]:
        for n in range(UPDATES):
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"kvm-{i}", health="Healthy")
                                                   for i in range(n + 1)])

    async def Allocate(self, request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        response = pb.AllocateResponse()
        for container in request.container_requests:
            ids = list(container.devices_ids)
            envs = {"IDS": ",".join(ids[:4]), "COUNT": str(len(ids))}
            if ids and ids[0].startswith("pad-"):
                envs["PAD"] = "x" * int(ids[0].removeprefix("pad-"))
            response.container_responses.add(envs=envs)
        return response


@contextlib.asynccontextmanager
async def serving(public: Path, guarded: bool = True) -> AsyncIterator[FrameGuard | None]:
    """The Plugin served at ``public``: behind a guard (the server on an abstract address), or
    bound there itself."""
    server = grpc.aio.server(options=OPTIONS)
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    guard = None
    if guarded:
        address = abstract_address()
        server.add_insecure_port(address)
        guard = FrameGuard(address)
    else:
        server.add_insecure_port(f"unix://{public}")
    await server.start()
    try:
        if guard is not None:
            await guard.listen(public)
        yield guard
    finally:
        await server.stop(None)
        if guard is not None:
            await guard.close()


# The CONTINUATION flood: HEADERS for Allocate without END_HEADERS, then CONTINUATION frames of
# 16 KiB for ever, each 154 literal header fields (not indexed) of 100 bytes. grpc keeps every
# field until the block ends: 64 MiB of them on 4 connections grew an unguarded server by 200 MiB.
# (One literal value that never ends grew it by 4 MiB only: grpc skips a value past its bound.)
FRAME = 16 * 1024
FIELD = b"\x00\x04x-pa" + bytes([100]) + b"v" * 100
REQUEST = [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
           (":path", "/v1beta1.DevicePlugin/Allocate"), ("content-type", "application/grpc"),
           ("te", "trailers")]


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def flood_opening() -> bytes:
    """Preface, SETTINGS, and HEADERS for Allocate (stream 1) without END_HEADERS."""
    return PREFACE + frame(0x4, 0, 0, b"") + frame(0x1, 0, 1, hpack.Encoder().encode(REQUEST))


CONTINUATION = frame(0x9, 0, 1, FIELD * (FRAME // len(FIELD)))


@dataclass
class FloodResult:
    sent: int = 0  # bytes the kernel took, over all connections
    opened: int = 0
    closed: int = 0  # connections the other side ended
    most: int = 0  # the most bytes one connection took before it was ended
    per_connection: list[int] = field(default_factory=list)


async def flood(path: Path, connections: int, budget: int, seconds: float,
                reconnect: bool = True) -> FloodResult:
    """Write ``budget`` bytes of the flood over ``connections`` connections at once, each opening
    a new one when the other side ends it (``reconnect``), for at most ``seconds``."""
    result = FloodResult()
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds

    async def one() -> None:
        while result.sent < budget and loop.time() < until:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            sent = 0
            try:
                await loop.sock_connect(sock, str(path))
                result.opened += 1
                data = flood_opening()
                while result.sent < budget and loop.time() < until:
                    async with asyncio.timeout(max(0.01, until - loop.time())):
                        await loop.sock_sendall(sock, data)
                    sent += len(data)
                    result.sent += len(data)
                    data = CONTINUATION
            except (BrokenPipeError, ConnectionResetError):
                result.closed += 1
                result.most = max(result.most, sent)
                result.per_connection.append(sent)
                if reconnect:
                    continue
                return
            except TimeoutError:
                pass
            finally:
                sock.close()
            result.per_connection.append(sent)
            return

    await asyncio.gather(*(one() for _ in range(connections)))
    return result


async def _main(public: Path, guarded: bool) -> None:
    async with serving(public, guarded):
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(_main(Path(sys.argv[1]), "--no-guard" not in sys.argv[2:]))
