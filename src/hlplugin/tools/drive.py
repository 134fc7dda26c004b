"""The real daemons on a throwaway node root, against the kubelet emulator: what the tests
(tests/harness.py) and the benchmarks (benchmarks/) share.

A node root with its plugin, CDI and device dirs; a daemon process; a kubelet emulator; the one
poller (``wait_until``); and what /proc says of a process (CPU time, VmRSS, VmHWM).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hlplugin.tools.emulator import KubeletEmulator
from hlplugin.tools.process import DaemonProcess

IS_ROOT = os.geteuid() == 0


def short_dir() -> Path:
    """A fresh directory under /tmp, removed at exit: pytest's tmp_path can be too long for a
    unix socket path (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hlp-", dir="/tmp"))
    atexit.register(shutil.rmtree, path, True)
    return path


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
        return cls(root, short_dir(), root / "cdi", dev_dir or Path("/dev"), host_dev_dir or Path("/dev"))

    def serve_args(self, *extra: str) -> list[str]:
        return ["serve", "--plugin-dir", str(self.plugin_dir), "--cdi-dir", str(self.cdi_dir),
                "--dev-dir", str(self.dev_dir), "--host-dev-dir", str(self.host_dev_dir), *extra]


class Daemon(DaemonProcess):
    """A daemon under test: faulthandler on, and a daemon that does not stop in time fails the
    test after showing where it hangs."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        super().__init__(args, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
        self.started = 0.0

    async def start(self) -> Daemon:
        self.started = time.monotonic()  # what a start-up time is measured from
        await super().start()
        return self

    async def signal(self, signum: int = signal.SIGTERM, timeout: float = 10.0,
                     *, kill_on_timeout: bool = False) -> int:
        return await super().signal(signum, timeout, kill_on_timeout=kill_on_timeout)

    http = DaemonProcess.get


@contextlib.asynccontextmanager
async def daemon(args: Sequence[str], env: dict[str, str] | None = None, *,
                 graceful: bool = False) -> AsyncIterator[Daemon]:
    """The daemon started with ``args``; on the way out killed or, if ``graceful``, stopped with
    SIGTERM (a daemon that does not stop in time fails the test)."""
    proc = await Daemon(args, env).start()
    try:
        yield proc
    finally:
        await (proc.stop() if graceful else proc.signal(signal.SIGKILL))


@contextlib.asynccontextmanager
async def emulator(plugin_dir: Path, mode: str = "normal") -> AsyncIterator[KubeletEmulator]:
    """A kubelet emulator serving in ``plugin_dir`` (``mode`` as KubeletEmulator's) for the block."""
    kubelet = KubeletEmulator(plugin_dir, mode=mode)
    await kubelet.start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


@contextlib.asynccontextmanager
async def on_kubelet(node: Node, args: Sequence[str], env: dict[str, str] | None = None, *,
                     mode: str = "normal") -> AsyncIterator[tuple[KubeletEmulator, Daemon]]:
    """A kubelet emulator on ``node``, then the daemon started with ``args``; the daemon is
    stopped first on the way out, then the kubelet."""
    async with emulator(node.plugin_dir, mode) as kubelet, \
            daemon(args, env, graceful=True) as proc:
        yield kubelet, proc


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     what: str = "", step: float = 0.005) -> float:
    """The one poller: wait until ``predicate()`` holds and return how long that took; past
    ``timeout`` (a guard, not a measurement) fail naming ``what``. ``predicate`` may be async (an
    HTTP probe). Prefer waiting on an event (KubeletEmulator.wait_for, a tracker's
    wait_for_change) where the code under test offers one."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while True:
        result = predicate()
        if await result if inspect.isawaitable(result) else result:
            return loop.time() - began
        if loop.time() - began > timeout:
            raise TimeoutError(f"{what or 'condition'} not met within {timeout:g}s")
        await asyncio.sleep(step)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM ... in KiB from /proc/<pid>/status."""
    return {key: int(value.split()[0]) for key, _, value in
            (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            if value.strip().endswith("kB")}


def spec_is_exact(path: Path, desired: bytes) -> bool:
    """``path`` is a regular file, mode 0644, holding exactly ``desired``: what the reconciler
    keeps, seen without following a symlink."""
    try:
        st = os.lstat(path)
        return (stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
                and path.read_bytes() == desired)
    except OSError:
        return False
