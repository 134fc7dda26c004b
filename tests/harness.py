"""Shared test machinery: run the real daemons as processes against the kubelet emulator. The core
(node root, daemon process, emulator, poller) is hlplugin.tools.drive, which the benchmarks share."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from hlplugin.cdi_spec import SPEC_FILE, TEMP_PREFIX
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.metrics import Metrics
from hlplugin.tools.drive import (  # noqa: F401  (the harness is the tests' one entry: re-exported)
    IS_ROOT,
    Daemon,
    Node,
    cpu_seconds,
    daemon,
    emulator,
    on_kubelet,
    proc_status,
    short_dir,
    spec_is_exact,
    wait_until,
)
from hlplugin.tools.emulator import AdmissionError, KubeletEmulator
from hlplugin.tools.process import DaemonProcess

HAVE_KVM = os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)
needs_kvm = pytest.mark.skipif(not HAVE_KVM, reason="needs a usable /dev/kvm")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mknod, mounts)")


def temp_files(directory: Path) -> list[str]:
    """The reconciler's temporary files in ``directory`` (none where there is no directory)."""
    names = os.listdir(directory) if directory.is_dir() else []
    return sorted(n for n in names if n.startswith(TEMP_PREFIX))


def sh(*argv: str) -> None:
    """Run a command that must succeed (mount, umount ...); its stderr is in the exception."""
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class Runs(Protocol):
    async def run(self) -> None: ...


@contextlib.asynccontextmanager
async def running(runner: Runs) -> AsyncIterator[asyncio.Task[None]]:
    """``runner.run()`` as a task for the block, cancelled and awaited on the way out."""
    task = asyncio.create_task(runner.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait({task})  # not "await task": that would swallow our own cancellation
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


# Allocate's refusal names the failing condition(s) and why.
REFUSAL = re.compile(r"is not usable on this node: .*\b(cdi|device|host_identity): \S")


@dataclass
class Rig:
    """`hlplugin serve` registered on the kubelet emulator: what the kubelet, a pod and an operator
    see of it. ``desired`` is the spec every repair must produce."""

    node: Node
    kubelet: KubeletEmulator
    proc: Daemon
    count: int
    desired: bytes
    resource: str = "hyperlight.dev/hypervisor"
    guard: float = 20.0  # seconds; only ever reached when something is broken

    @property
    def spec(self) -> Path:
        return self.node.cdi_dir / SPEC_FILE

    async def wait(self, predicate: Callable[[], bool]) -> float:
        """Seconds until ``predicate`` held, woken by the emulator's every change."""
        began = time.monotonic()
        await self.kubelet.wait_for(predicate, self.guard)
        return time.monotonic() - began

    async def healthy(self) -> float:
        """Every slot allocatable, and no ended instance's stream still to be read (its late end
        would disconnect the current one: test_faults' SIGKILL loop once met "no healthy
        devices" right after this returned)."""
        return await self.wait(lambda: self.kubelet.allocatable(self.resource) == self.count
                               and self.kubelet.settled(self.resource))

    async def withdrawn(self) -> float:
        return await self.wait(lambda: self.kubelet.capacity(self.resource) == self.count
                               and self.kubelet.allocatable(self.resource) == 0)

    async def admit(self) -> None:
        """A fresh allocation: admitted with the CDI reference, and the spec on disk is exact."""
        response = await self.kubelet.admit(self.resource)
        assert [d.name for d in response.container_responses[0].cdi_devices] == [
            f"{self.resource}=kvm"]
        assert self.spec.read_bytes() == self.desired

    async def refused(self, *names: str) -> str:
        """A raw Allocate (the kubelet would not even try) is refused, naming why."""
        with pytest.raises(AdmissionError) as refused:
            await self.kubelet.allocate(self.resource, [["kvm-0"]])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value
        details = refused.value.details
        assert REFUSAL.search(details), details
        for name in names:
            assert name in details, (name, details)
        return details

    async def conditions(self, status: int) -> dict[str, Any]:
        conditions: dict[str, Any] = json.loads(await self.proc.wait_http("/readyz", status))["conditions"]
        return conditions

    async def live(self) -> None:
        code, body = await self.proc.http("/healthz")
        assert code == 200, body


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


def declared(metrics: object) -> list[MetricWrapperBase]:
    """Every family a daemon's metrics declare, through the groups they compose (each once)."""
    found: dict[int, MetricWrapperBase] = {}
    groups, seen = [metrics], set()
    while groups:
        group = groups.pop(0)
        if id(group) in seen:
            continue
        seen.add(id(group))
        for value in vars(group).values():
            if isinstance(value, MetricWrapperBase):
                found.setdefault(id(value), value)
            elif type(value).__module__.startswith("hlplugin.") and hasattr(value, "__dict__"):
                groups.append(value)
    return list(found.values())


def metric_families() -> dict[str, tuple[str, ...]]:
    """Exposed name -> label names of every family metrics.py declares."""
    found = {}
    for metric in declared(Metrics()):
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
                  *options: str) -> subprocess.CompletedProcess[str]:
    """`helm template` of ``chart`` into ``namespace`` with ``values`` (a values file, so YAML
    types reach the schema as they are) and helm's ``options``; the caller judges the result
    (skips without helm)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(values or {}, file)
        file.flush()
        return subprocess.run([tool("helm"), "template", "hlplugin", str(chart), "--namespace", namespace,
                               "--values", file.name, *options], capture_output=True, text=True,
                              check=False, timeout=100)


def documents(text: str) -> list[dict[str, Any]]:
    """The non-empty documents of a multi-document YAML text."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def healthy_tracker() -> HealthTracker:
    """A tracker whose one required condition holds: a servicer in process advertises Healthy."""
    tracker = HealthTracker(required=("device",))
    tracker.set_condition("device", True)
    return tracker


# A ListAndWatch reader (run with `python -c`, the socket as its argument) that prints the first
# list's health, then stops itself (SIGSTOP): a kubelet that stops reading. After SIGCONT it
# prints the health of each list it reads.
STALLING_CLIENT = """
import os, signal, sys
import grpc
from hlplugin.api import deviceplugin_pb2 as pb, deviceplugin_pb2_grpc as pb_grpc
with grpc.insecure_channel("unix://" + sys.argv[1]) as channel:
    stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
    print(next(stream).devices[0].health, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    for response in stream:
        print(response.devices[0].health, flush=True)
"""


def split_settings(kind: Any, kwargs: dict[str, Any], **fixed: Any) -> tuple[Any, dict[str, Any]]:
    """``kind`` built from the keywords that are its fields (and ``fixed``); the rest returned."""
    names = {f.name for f in dataclasses.fields(kind)}
    ours = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    return kind(**fixed, **ours), kwargs
