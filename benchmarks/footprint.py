"""What every node pays for each daemon, as the kubelet charges it, beside a floor from the same run.

Each process runs in a memory cgroup of its own (v1 under /sys/fs/cgroup/memory, or v2 where the
memory controller is there), as a container would: its working set is the cgroup's usage minus its
inactive file pages, what the kubelet and metrics-server report. Shared-library pages another
cgroup read first stay charged there (the kernel does not move them), so VmRSS, VmHWM, RssAnon and
RssFile are reported beside it. The floor: an empty grpc.aio DevicePlugin server (memory, idle
CPU) and a minimal grpc.aio plugin that serves, registers and sends one list (start -> Register),
both run by the same interpreter from the same virtual environment.
"""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import hlplugin
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.names import DEVICE_ACCESS_RESOURCE, HYPERVISOR_RESOURCE
from hlplugin.tools import drive
from hlplugin.tools.drive import proc_status
from hlplugin.tools.emulator import KubeletEmulator
from hlplugin.tools.process import with_parent_death

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
MIB = 1024 * 1024
# The manifests' memory limits (deploy/base): the ceiling runs under the main daemon's.
LIMITS = {"main": 96 * MIB, "bootstrap": 72 * MIB}

FLOOR_RESOURCE = "bench.example/floor"
# The floor plugin: serve, register, send one list, then sit idle. What any grpc.aio device
# plugin needs before its first list, and nothing else.
FLOOR_PLUGIN = r"""
import asyncio, sys, grpc
from hlplugin.api import deviceplugin_pb2 as pb, deviceplugin_pb2_grpc as pb_grpc

class Plugin(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions()
    async def ListAndWatch(self, request, context):
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID="floor-0", health="Healthy")])
        await asyncio.Event().wait()
    async def Allocate(self, request, context):
        return pb.AllocateResponse()

async def main(plugin_dir, resource):
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port(f"unix://{plugin_dir}/floor.sock")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{plugin_dir}/kubelet.sock") as channel:
        await pb_grpc.RegistrationStub(channel).Register(pb.RegisterRequest(
            version="v1beta1", endpoint="floor.sock", resource_name=resource))
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


class MemoryCgroup:
    """A memory cgroup of our own; ``wrap(argv)`` runs argv in it (the pid is argv's: sh execs)."""

    def __init__(self, name: str, limit: int | None = None) -> None:
        self.v2 = "memory" in _read(V2 / "cgroup.controllers")
        self.path = (V2 if self.v2 else V1) / f"hlplugin-bench-{os.getpid()}-{name}"
        self.path.mkdir()
        if limit is not None:
            (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *argv]

    def figures(self) -> dict[str, float]:
        """Working set and usage now, and the cgroup's peak usage, in MiB."""
        stat = dict(line.split() for line in _read(self.path / "memory.stat").splitlines())
        if self.v2:
            usage, inactive = int(_read(self.path / "memory.current")), int(stat["inactive_file"])
            peak = int(_read(self.path / "memory.peak") or usage)
        else:
            usage = int(_read(self.path / "memory.usage_in_bytes"))
            inactive = int(stat["total_inactive_file"])
            peak = int(_read(self.path / "memory.max_usage_in_bytes"))
        return {"working_set": mib(usage - inactive), "usage": mib(usage), "cgroup_peak": mib(peak)}

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def mib(n: float) -> float:
    return round(n / MIB, 1)


def available() -> str:
    """"" when memory cgroups can be made here, else why not."""
    if not drive.IS_ROOT:
        return "needs root (memory cgroups)"
    if not (V1 / "cgroup.procs").exists() and "memory" not in _read(V2 / "cgroup.controllers"):
        return "no memory cgroup controller (v1 or v2)"
    return ""


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid``, from the scheduler's nanosecond counters
    (/proc/<pid>/task/*/schedstat): an idle daemon uses a few clock ticks a minute, too few for
    utime + stime to tell it from the floor. A thread that exits takes its time with it; the
    daemons' threads live as long as they do."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def process_figures(pid: int) -> dict[str, float]:
    status = proc_status(pid)
    return {key: round(status[key] / 1024, 1) for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


class Process:
    """One measured process: a daemon (drive.Daemon) or a floor script, in its own cgroup."""

    def __init__(self, who: str, argv: Sequence[str], limit: int | None = None,
                 daemon: drive.Daemon | None = None) -> None:
        """``daemon``: one built already (the DRA driver with its API server named), run in
        place of ``argv``."""
        self.who = who
        self.cgroup = MemoryCgroup(who, limit)
        self.daemon: drive.Daemon | None = daemon
        self.child: asyncio.subprocess.Process | None = None
        self.argv = list(argv)
        self.started = 0.0

    async def start(self) -> Process:
        """Start it; ``started`` is taken just before the spawn, and a floor script runs under
        the same parent-death wrapper as a daemon (setpriv): the two start alike."""
        if self.daemon is not None or self.argv[0] in ("serve", "bootstrap"):
            self.daemon = self.daemon or drive.Daemon(self.argv)
            self.daemon.args = self.cgroup.wrap(self.daemon.args)
            await self.daemon.start()
            self.started = self.daemon.started
        else:
            argv = self.cgroup.wrap(with_parent_death([sys.executable, *self.argv]))
            self.started = time.monotonic()
            self.child = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL)
        return self

    @property
    def pid(self) -> int:
        return self.daemon.pid if self.daemon is not None else self.child.pid if self.child else 0

    def figures(self) -> dict[str, float]:
        return {**self.cgroup.figures(), **process_figures(self.pid)}

    async def stop(self) -> None:
        if self.daemon is not None:
            await self.daemon.stop()
        elif self.child is not None:
            self.child.terminate()
            await self.child.wait()
        self.cgroup.remove()


async def probed(seconds: float, *processes: Process, period: float = 5.0) -> None:
    """``seconds`` of the kubelet's liveness and readiness probes on each daemon of ``processes``,
    every ``period`` (the manifests' 5 s)."""

    async def probe(daemon: drive.Daemon) -> None:
        while True:
            for path in ("/healthz", "/readyz"):
                await daemon.get(path)
            await asyncio.sleep(period)

    tasks = [asyncio.create_task(probe(p.daemon)) for p in processes if p.daemon is not None]
    try:
        await asyncio.sleep(seconds)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def running(*processes: Process) -> AsyncIterator[None]:
    try:
        for proc in processes:
            await proc.start()
        yield
    finally:
        for proc in processes:
            await proc.stop()


async def start_to_register(kubelet: KubeletEmulator, proc: Process, resource: str,
                            count: int) -> tuple[float, float]:
    """(start -> Register done, start -> first list with every device Healthy), in seconds."""
    await kubelet.wait_for(lambda: kubelet.allocatable(resource) == count, 60)
    return kubelet.resources[resource].registered_at - proc.started, time.monotonic() - proc.started


def byte_compile() -> None:
    """Byte-compile the hlplugin package in place, as the image is (Dockerfile: compileall), so a
    start measures running it, not compiling it: where PYTHONDONTWRITEBYTECODE is set, an editable
    install would otherwise compile every module of ours from source at each start (about 35 ms
    here), and the floor, which imports few of them, would not. Where the package's directory is
    not writable (an installed wheel is compiled already), nothing changes."""
    compileall.compile_dir(Path(hlplugin.__file__).parent, quiet=2)


async def measure_starts(tmp: Path, starts: int, make_node: Callable[[Path, str], drive.Node],
                         bootstrap_args: Callable[[drive.Node], list[str]]) -> dict[str, Any]:
    """Median start -> Register and -> first list of each daemon and the floor plugin, started in
    turn (the order rotates) against one kubelet emulator per start, from byte-compiled code."""
    byte_compile()
    kinds: dict[str, tuple[Callable[[drive.Node], list[str]], str, int]] = {
        "floor": (lambda n: ["-c", FLOOR_PLUGIN, str(n.plugin_dir), FLOOR_RESOURCE], FLOOR_RESOURCE, 1),
        "main": (lambda n: n.serve_args("--hypervisor", "kvm", "--device-count", "2000"),
                 HYPERVISOR_RESOURCE, 2000),
        "bootstrap": (bootstrap_args, DEVICE_ACCESS_RESOURCE, ACCESS_SLOTS),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    order = list(kinds)
    for i in range(starts):
        for who in order[i % 3:] + order[:i % 3]:
            args, resource, count = kinds[who]
            node = make_node(tmp, f"start-{who}-{i}")
            async with drive.emulator(node.plugin_dir) as kubelet:
                proc = Process(f"start-{who}-{i}", args(node))
                async with running(proc):
                    times[who].append(await start_to_register(kubelet, proc, resource, count))
    return {who: {"register_s": round(statistics.median(t[0] for t in got), 3),
                  "first_list_s": round(statistics.median(t[1] for t in got), 3),
                  "register_runs_s": [round(t[0], 3) for t in got]}
            for who, got in times.items()}
