"""A driver for one real `hlplugin` daemon process, for the tests, the benchmarks and `hlplugin demo`.

It starts the daemon on a free loopback port with JSON logs, keeps its log lines, reads its HTTP
probes, and when the daemon does not stop in time asks it where it hangs before killing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def with_parent_death(argv: list[str]) -> list[str]:
    """Wrap ``argv`` so the child is SIGKILLed when its parent dies: a killed demo or test run
    never leaves daemons behind. setpriv (util-linux) sets it and execs, so no Python runs in the
    forked child (a preexec_fn can deadlock in a process with gRPC's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv


class DaemonProcess:
    """One real `hlplugin` process on a free loopback port, its JSON log lines kept in memory."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 name: str = "") -> None:
        self.name = name or f"hlplugin {args[0]}"
        self.port = free_port()
        self.args = [sys.executable, "-m", "hlplugin", *args,
                     "--http-address", f"127.0.0.1:{self.port}", "--log-format", "json"]
        self.env = dict(os.environ if env is None else env)
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> DaemonProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *with_parent_death(self.args), env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            text = line.decode(errors="replace").rstrip()
            self.raw.append(text)
            with contextlib.suppress(ValueError):
                entry = json.loads(text)
                if isinstance(entry, dict):
                    self.lines.append(entry)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def exited(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def messages(self) -> list[str]:
        return [str(line.get("message", "")) for line in self.lines]

    async def signal(self, signum: int = signal.SIGTERM, timeout: float = 10.0,
                     *, kill_on_timeout: bool = True) -> int:
        """Send ``signum`` and wait for the exit code. A daemon that does not stop in time is asked
        where it hangs (SIGUSR1 logs every task, SIGABRT makes faulthandler print every thread),
        then killed, or, with ``kill_on_timeout`` false, TimeoutError is raised after that."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            self.proc.send_signal(signum)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
            if self.proc.returncode is None:
                self.proc.kill()
            code = await self.proc.wait()
            print("\n".join(self.raw[-80:]), file=sys.stderr)
            if not kill_on_timeout:
                raise
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader, 2)
        return code

    async def stop(self) -> int:
        """SIGTERM, as the kubelet sends at pod deletion."""
        return await self.signal(signal.SIGTERM)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` on the daemon's HTTP port: (status, body), or (0, b"") when unreachable."""

        def fetch() -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                    return int(r.status), bytes(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except OSError:
                return 0, b""

        return await asyncio.to_thread(fetch)

    async def wait_http(self, path: str, status: int, timeout: float = 15.0) -> bytes:
        """The body of ``path`` once it answers ``status``; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            code, body = await self.get(path)
            if code == status:
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} answered {code} {body!r}, wanted {status}")
            await asyncio.sleep(0.05)
