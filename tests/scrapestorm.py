"""A scrape storm: ``clients`` concurrent loops fetching one path over loopback HTTP, as fast as
answers come, for ``seconds`` or until SIGTERM. Run as a process of its own (``python
scrapestorm.py PORT CLIENTS SECONDS [PATH]``), so the storm's CPU is not the measuring test's: it
prints "storming" once every client has sent its first request, then at the end how many answers
of each status arrived (0: none)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import sys
import time

from support.waits import quiet


async def storm(port: int, clients: int, seconds: float, path: str = "/metrics") -> dict[int, int]:
    statuses: collections.Counter[int] = collections.Counter()
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    deadline = time.monotonic() + seconds
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)

    sent = 0

    async def client() -> None:
        nonlocal sent
        while time.monotonic() < deadline and not stopped.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                sent += 1
                if sent == clients:
                    print("storming", flush=True)
                answer = await reader.read()
                writer.close()
                statuses[int(answer.split(b" ", 2)[1]) if answer else 0] += 1
            except (OSError, ValueError, IndexError):
                statuses[0] += 1
                await quiet(0.01, "a refused connection's retry pace")

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopped.wait(), seconds)
    stopped.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return dict(statuses)


if __name__ == "__main__":
    port, clients, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    print(asyncio.run(storm(port, clients, seconds, *sys.argv[4:5])), flush=True)
