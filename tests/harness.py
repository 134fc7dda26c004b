"""Shared test machinery: run the real daemons as processes against the kubelet emulator."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

HAVE_KVM = os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)
IS_ROOT = os.geteuid() == 0
needs_kvm = pytest.mark.skipif(not HAVE_KVM, reason="needs a usable /dev/kvm")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mknod, mounts)")


def run(coroutine: Awaitable[T], timeout: float = 60.0) -> T:
    """Run one async test body with a generous guard timeout."""

    async def guarded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(guarded())


def with_parent_death(argv: list[str]) -> list[str]:
    """Wrap ``argv`` so the child is SIGKILLed when the test process dies: a killed test run must
    never leave daemons behind. setpriv (util-linux) sets it and execs, so no Python runs in the
    forked child (a preexec_fn can deadlock in a process with gRPC's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Node:
    """A temporary node root: kubelet plugin dir, CDI dir, and device dirs."""

    root: Path
    plugin_dir: Path
    cdi_dir: Path
    dev_dir: Path
    host_dev_dir: Path

    @classmethod
    def make(cls, root: Path, dev_dir: Path | None = None, host_dev_dir: Path | None = None) -> Node:
        # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
        plugin_dir = Path(tempfile.mkdtemp(prefix="hlp-", dir="/tmp"))
        atexit.register(shutil.rmtree, plugin_dir, True)
        cdi_dir = root / "cdi"
        return cls(root, plugin_dir, cdi_dir, dev_dir or Path("/dev"), host_dev_dir or Path("/dev"))

    def serve_args(self, *extra: str) -> list[str]:
        return ["serve", "--plugin-dir", str(self.plugin_dir), "--cdi-dir", str(self.cdi_dir),
                "--dev-dir", str(self.dev_dir), "--host-dev-dir", str(self.host_dev_dir), *extra]


class Daemon:
    """A real `hlplugin` process; its log lines (JSON) are collected for assertions."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = [sys.executable, "-m", "hlplugin", *args,
                     "--http-address", f"127.0.0.1:{self.port}", "--log-format", "json"]
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Daemon:
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
                self.lines.append(json.loads(text))

    def messages(self) -> list[str]:
        return [str(line.get("message", "")) for line in self.lines]

    async def signal(self, signum: int) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signum)
        try:
            code = await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            # Show where it hangs: SIGUSR1 logs every task, SIGABRT makes faulthandler print
            # every thread's stack.
            self.proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
                if self._reader is not None:
                    await asyncio.wait_for(self._reader, 2)
            print("\n".join(self.raw[-80:]), file=sys.stderr)
            raise
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reader, 2)
        return code

    async def stop(self) -> int:
        return await self.signal(signal.SIGTERM)

    async def http(self, path: str) -> tuple[int, bytes]:
        def get() -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except OSError:
                return 0, b""

        return await asyncio.to_thread(get)

    async def wait_http(self, path: str, status: int, timeout: float = 15.0) -> bytes:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            code, body = await self.http(path)
            if code == status:
                return body
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{path} answered {code} {body!r}, wanted {status}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def daemon(args: Sequence[str], env: dict[str, str] | None = None) -> AsyncIterator[Daemon]:
    proc = await Daemon(args, env).start()
    try:
        yield proc
    finally:
        if proc.proc is not None and proc.proc.returncode is None:
            proc.proc.kill()
            await proc.proc.wait()


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)
