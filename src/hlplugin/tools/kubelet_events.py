"""Pieces of the kubelet emulator (emulator.py): what it saw of each resource, in order, and the
hand-over gaps that follow from it (the kubelet's own view: tests/test_handover.py,
benchmarks/run.py); the proxy behind its kubelet.sock."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    """What the kubelet saw of one resource, when (time.monotonic()): "register", "list" (each
    ListAndWatch answer), "stream_end" (a client's run ended), "disconnect" (the client holding
    the name then was disconnected)."""

    at: float
    kind: str
    resource: str
    endpoint: str


def handover_gaps(events: Iterable[Event], name: str) -> list[float]:
    """Each outage of ``name``: from a disconnect (a stream's end seen) to the first list that
    followed from a new registration, in seconds."""
    gaps: list[float] = []
    down: float | None = None
    registered = False
    for event in events:
        if event.resource != name:
            continue
        if event.kind == "disconnect":
            down, registered = event.at, False
        elif event.kind == "register" and down is not None:
            registered = True
        elif event.kind == "list" and down is not None and registered:
            gaps.append(event.at - down)
            down = None
    return gaps


async def forward(conn: socket.socket, target: Path) -> None:
    """Pass one connection to the emulator's kubelet.sock on to its gRPC server's private socket
    (see KubeletEmulator.start), until either side closes."""
    writers: list[asyncio.StreamWriter] = []
    try:
        client_r, client_w = await asyncio.open_unix_connection(sock=conn)
        writers.append(client_w)
        server_r, server_w = await asyncio.open_unix_connection(str(target))
        writers.append(server_w)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

        pumps = {asyncio.create_task(pump(client_r, server_w)),
                 asyncio.create_task(pump(server_r, client_w))}
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    except OSError:
        pass
    finally:
        conn.close()
        for writer in writers:
            writer.close()
