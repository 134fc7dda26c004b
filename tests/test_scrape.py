"""/metrics kept behind the kubelet: scrapes are answered at a pace while /healthz and /readyz are
answered at once (in process, real TCP on loopback). The storm itself: test_scrape_storm.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from harness import wait_until
from prometheus_client import CollectorRegistry
from support.observers import held_connections

from hlplugin.deviceplugin.process.http import HttpServer, Limits


@asynccontextmanager
async def serving(per_second: float) -> AsyncIterator[HttpServer]:
    server = HttpServer(lambda: {"c": (True, "")}, lambda: (True, ""), CollectorRegistry(),
                        Limits(scrapes_per_second=per_second))
    await server.start(("127.0.0.1", 0))
    try:
        yield server
    finally:
        await server.stop()


async def fetch(port: int, path: str) -> tuple[int, float]:
    """(status, seconds to the answer) of one GET on a fresh connection."""
    began = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1]), time.monotonic() - began


async def test_scrapes_are_paced_and_probes_are_not() -> None:
    per_second = 4.0
    async with serving(per_second) as server:
        scrapes = [asyncio.create_task(fetch(server.port, "/metrics")) for _ in range(12)]
        # Two answered at once (the burst); the other ten wait, a quarter of a second each.
        await wait_until(lambda: len(server.scrapes.waiting) >= 9, what="scrapes waiting")
        # Probes meanwhile are answered at once, not after the scrapes (2.5 s).
        for path in ("/healthz", "/readyz"):
            status, took = await fetch(server.port, path)
            assert status == 200 and took < 1.0, (path, took)
        assert len(server.scrapes.waiting) >= 6  # probes took no turn of the scrapes'
        results = await asyncio.gather(*scrapes)
        assert {status for status, _ in results} == {200}
        slowest = max(took for _, took in results)
        assert slowest >= 2.0, f"12 scrapes in {slowest:.2f} s: not paced at {per_second}/s"


async def test_a_scraper_that_leaves_while_it_waits_takes_no_turn() -> None:
    async with serving(1.0) as server:
        for _ in range(server.scrapes.burst):
            await fetch(server.port, "/metrics")
        gone = []
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            gone.append(writer)
        await wait_until(lambda: len(server.scrapes.waiting) == 5, what="five scrapes waiting")
        for writer in gone:
            writer.close()
        await wait_until(lambda: not held_connections(server.port), what="the scrapers' connections closed")
        # The next scrape's turn comes within the second, not after five of them.
        status, took = await fetch(server.port, "/metrics")
        assert status == 200 and took < 2.5, took
