"""The DRA driver's figures (issue 41, item 6), the ``dra`` step of benchmarks/run.py:

- process start -> first ResourceSlice published: `hlplugin dra` in a cluster, its API server
  the tests' fake on loopback (tests/support/fakeapi.py: real TCP and HTTP, no latency of its
  own worth the name), so the figure is the driver's: imports, the first passes, the node's
  facts, the first list and create;
- NodePrepareResources p50 and p99, a new claim and the same claim again, `hlplugin dra` as a
  process with its real gate (the CDI read, a KVM check begun after the call), beside a minimal
  grpc.aio DRAPlugin server measured in the same run (benchmarks/dra_prepare.py);
- the driver's idle CPU and working set, in a memory cgroup of its own (benchmarks/footprint.py),
  beside the main daemon's, measured in the same window: the goal is at most the main daemon's
  + 10 MiB. The driver runs as in a cluster (the API client loaded, its slice kept), since that is
  what a node pays.
"""

from __future__ import annotations

import asyncio
import os
import stat
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dra_prepare  # beside this script: on sys.path as the script's directory
import footprint

from hlplugin.kubeapi import RESOURCE_SLICES
from hlplugin.names import HYPERVISOR_RESOURCE
from hlplugin.tools import drive
from hlplugin.tools.drive import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.dracluster import DriverProcess, Node  # the tests' driver runner
from support.fakeapi import FakeApiServer
from support.fakeslices import add_node

Record = Callable[..., None]
KVM = Path("/dev/kvm")


def dra_node() -> Node:
    """Scratch directories for one driver, its --dev-dir holding a node of the host's KVM (a
    device that passes its check, so the slice carries no taint)."""
    node = Node()
    os.mknod(node.dev_dir / "kvm", stat.S_IFCHR | 0o666, os.stat(KVM).st_rdev)
    return node


def driver_args(node: Node) -> list[str]:
    """The tests' arguments with the default health interval, as the main daemon's here."""
    args = node.args()
    at = args.index("--health-interval")
    return args[:at] + args[at + 2:]


async def first_slice(runs: int) -> list[float]:
    """Seconds from the driver's spawn to its slice stored by the API server, per run."""
    times = []
    for _ in range(runs):
        async with FakeApiServer() as server:
            add_node(server)
            proc = await DriverProcess(server.url, driver_args(dra_node())).start()
            try:
                await wait_until(lambda: bool(server.objects.get(RESOURCE_SLICES.path())), 60,
                                 "the slice published", step=0.002)
                times.append(time.monotonic() - proc.started)
            finally:
                await proc.stop()
    return times


async def prepare_latency(root: Path, calls: int, repeats: int) -> dict[str, list[list[float]]]:
    """Per repeat: the floor's and the daemon's (a new claim, then the same claim) latencies."""
    runs: dict[str, list[list[float]]] = {"floor": [], "new": [], "same": []}
    for i in range(repeats):
        async with dra_prepare.serving(dra_prepare._floor_server(), root / f"floor-{i}.sock") as end:
            runs["floor"].append(await dra_prepare.timed(end, calls, lambda n: f"uid-{n}"))
        got = await dra_prepare.daemon_run(root, calls)
        assert got is not None, "/dev/kvm is not usable (benchmarks/run.py checked it)"
        runs["new"].append(got[0])
        runs["same"].append(got[1])
    return runs


async def idle_footprint(make_main: Callable[[], Any], seconds: float) -> dict[str, dict[str, float]]:
    """The main daemon (against the kubelet emulator) and the driver (in a cluster: the fake API
    server) in cgroups of their own, side by side: idle CPU (% of a core) and working set."""
    node, main_args = make_main()
    api = FakeApiServer()
    async with api:
        add_node(api)
        driver = dra_node()
        procs = {"main": footprint.Process("dra-main", main_args, footprint.LIMITS["main"]),
                 "driver": footprint.Process("dra-driver", [], footprint.LIMITS["main"],
                                             daemon=DriverProcess(api.url, driver_args(driver)))}
        async with drive.emulator(node.plugin_dir) as kubelet, footprint.running(*procs.values()):
            await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR_RESOURCE) == 2000, 60)
            await wait_until(lambda: bool(api.objects.get(RESOURCE_SLICES.path())), 60,
                             "the driver's slice")
            await asyncio.sleep(2.0)  # settle: start-up work done before the window opens
            before = {k: footprint.cpu_seconds(v.pid) for k, v in procs.items()}
            began = time.monotonic()
            await asyncio.sleep(seconds)
            wall = time.monotonic() - began
            return {k: {"cpu": (footprint.cpu_seconds(v.pid) - before[k]) / wall * 100,
                        **v.figures()} for k, v in procs.items()}


async def bench(tmp: Path, record: Record, *, starts: int, calls: int, repeats: int, idle: float,
                make_main: Callable[[], Any]) -> None:
    """Every figure of the step, recorded with ``record`` (benchmarks/run.py's)."""
    times = await first_slice(starts)
    record("process start -> first ResourceSlice, DRA driver", round(statistics.median(times), 3),
           "s", runs_s=[round(t, 3) for t in times],
           api_server="the tests' fake on loopback (tests/support/fakeapi.py)")
    runs = await prepare_latency(tmp, calls, repeats)
    floor = {q: statistics.median(dra_prepare.pct(r, q) for r in runs["floor"]) for q in (50, 99)}
    for kind, what in (("new", "a new claim"), ("same", "the same claim again")):
        for q in (50, 99):
            value = statistics.median(dra_prepare.pct(r, q) for r in runs[kind])
            record(f"NodePrepareResources p{q}, DRA driver, {what}", round(value * 1000, 3), "ms",
                   baseline=round(floor[q] * 1000, 3), ratio=round(value / floor[q], 2),
                   calls=calls, repeats=repeats,
                   baseline_is="a minimal grpc.aio DRAPlugin server, same run")
    if why := footprint.available():
        print(f"  DRA footprint skipped: {why}", file=sys.stderr)
        return
    figures = await idle_footprint(make_main, idle)
    main, driver = figures["main"], figures["driver"]
    record(f"idle CPU, DRA driver ({idle:.0f} s, own cgroup)", round(driver["cpu"], 3),
           "% of a core", baseline=round(main["cpu"], 3),
           ratio=round(driver["cpu"] / main["cpu"], 2) if main["cpu"] > 0 else None,
           baseline_is="the main daemon, idle, same window")
    record("working set idle, DRA driver", driver["working_set"], "MiB",
           goal="<= main daemon + 10 MiB", met=driver["working_set"] <= main["working_set"] + 10,
           baseline=main["working_set"], ratio=round(driver["working_set"] / main["working_set"], 2),
           driver=driver, main=main, baseline_is="the main daemon's cgroup, same window")
