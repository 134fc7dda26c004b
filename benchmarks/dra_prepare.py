#!/usr/bin/env python3
"""NodePrepareResources latency of `hlplugin dra` (issue 31, item 8), beside a floor in the same
run: a minimal grpc.aio DRAPlugin v1 server answering a fixed response on a unix socket.

    python benchmarks/dra_prepare.py [--calls 300] [--repeats 3]

Three ways in, each called one at a time over one channel, as the kubelet does:

- floor: the minimal server (nothing but gRPC on a unix socket);
- service: our DRA service and claims preparer in this process, the checkpoint on this machine's
  /tmp, the health gate always healthy: what our code adds to gRPC (new claims write the
  checkpoint, with its fsyncs; repeated claims answer from memory);
- daemon: `hlplugin dra` as a process with its real gate (the CDI read and a KVM check begun after
  the call), where /dev/kvm is usable: new claims, then one claim again (answered from memory
  after the inotify-vouched CDI read, with no lock, read or write of the record).

Medians over the repeats of each p50 and p99; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from hlplugin.api import dra_v1_pb2 as pb
from hlplugin.api import dra_v1_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.health.conditions import Condition, HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.dra.checkpoint import Checkpoint
from hlplugin.deviceplugin.kubelet.dra.draservice import new_dra_server
from hlplugin.dra.claims import CHECKPOINT_FILE, CHECKPOINT_KIND, ClaimPreparer, node_device
from hlplugin.tools.drive import wait_until
from hlplugin.tools.process import DaemonProcess


class Floor(pb_grpc.DRAPluginServicer):
    async def NodePrepareResources(self, request: pb.NodePrepareResourcesRequest,
                                   context: object) -> pb.NodePrepareResourcesResponse:
        response = pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].devices.add(
                pool_name="node-a", device_name="kvm", cdi_device_ids=["hyperlight.dev/hypervisor=kvm"])
        return response


@contextlib.asynccontextmanager
async def serving(server: grpc.aio.Server, path: Path) -> AsyncIterator[Path]:
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        yield path
    finally:
        await server.stop(None)


async def timed(endpoint: Path, calls: int, uid: Callable[[int], str]) -> list[float]:
    """``calls`` Prepares of one claim each, one at a time over one channel."""
    times = []
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
        prepare = pb_grpc.DRAPluginStub(channel).NodePrepareResources
        await prepare(pb.NodePrepareResourcesRequest(), timeout=10)  # connected
        for i in range(calls):
            request = pb.NodePrepareResourcesRequest(
                claims=[pb.Claim(namespace="bench", uid=uid(i), name=f"claim-{i}")])
            began = time.perf_counter()
            response = await prepare(request, timeout=10)
            times.append(time.perf_counter() - began)
            assert not response.claims[uid(i)].error, response.claims[uid(i)].error
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(name: str, runs: list[list[float]], floor: tuple[float, float] | None) -> tuple[float, float]:
    p50 = statistics.median(pct(r, 50) for r in runs)
    p99 = statistics.median(pct(r, 99) for r in runs)
    ratio = f"   {p50 / floor[0]:4.1f}x / {p99 / floor[1]:4.1f}x the floor" if floor else ""
    print(f"{name:48s} p50 {p50 * 1000:7.3f} ms  p99 {p99 * 1000:7.3f} ms{ratio}", flush=True)
    return p50, p99


async def service_run(root: Path, calls: int, repeated: bool) -> list[float]:
    tracker = HealthTracker(required=("device",))
    tracker.set_condition("device", True)

    async def gate() -> HealthState:
        return tracker.state

    state = root / uuid.uuid4().hex[:8]

    async def cdi() -> Condition:
        return Condition(True)

    preparer = ClaimPreparer(Checkpoint(state, CHECKPOINT_FILE, CHECKPOINT_KIND), gate,
                             node_device("node-a", "kvm", "hyperlight.dev/hypervisor=kvm"),
                             cdi=cdi)
    await preparer.load()
    async with serving(new_dra_server(preparer), state.with_suffix(".sock")) as endpoint:
        if repeated:
            await timed(endpoint, 1, lambda i: "same")
            return await timed(endpoint, calls, lambda i: "same")
        return await timed(endpoint, calls, lambda i: f"uid-{i}")


async def daemon_run(root: Path, calls: int) -> tuple[list[float], list[float]] | None:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return None
    node = root / uuid.uuid4().hex[:8]
    for part in ("registry", "dra", "cdi"):
        (node / part).mkdir(parents=True)
    proc = DaemonProcess(["dra", "--registry-dir", str(node / "registry"), "--dra-dir", str(node / "dra"),
                          "--cdi-dir", str(node / "cdi"), "--node-name", "node-a", "--host-dev-dir", "",
                          "--hypervisor", "kvm"])
    await proc.start()
    try:
        endpoint = node / "dra" / "dra.sock"
        await wait_until(lambda: endpoint.exists(), 30, "the daemon's DRA socket")
        new = await timed(endpoint, calls, lambda i: f"uid-{i}")
        return new, await timed(endpoint, calls, lambda i: "uid-0")
    finally:
        await proc.stop()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hlp-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        floors, news, sames, daemons, daemon_sames = [], [], [], [], []
        for _ in range(args.repeats):
            async with serving(_floor_server(), root / "floor.sock") as endpoint:
                floors.append(await timed(endpoint, args.calls, lambda i: f"uid-{i}"))
            news.append(await service_run(root, args.calls, repeated=False))
            sames.append(await service_run(root, args.calls, repeated=True))
            if (daemon := await daemon_run(root, args.calls)) is not None:
                daemons.append(daemon[0])
                daemon_sames.append(daemon[1])
        print(f"{args.calls} calls, medians of {args.repeats} runs")
        floor = summary("floor: minimal grpc.aio DRAPlugin server", floors, None)
        summary("service: a new claim (checkpoint written)", news, floor)
        summary("service: the same claim again (from memory)", sames, floor)
        if daemons:
            summary("daemon: a new claim, real gate (CDI, KVM)", daemons, floor)
            summary("daemon: the same claim again (CDI read, memory)", daemon_sames, floor)
        else:
            print("daemon: skipped, /dev/kvm is not usable here")
    return 0


def _floor_server() -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_DRAPluginServicer_to_server(Floor(), server)
    return server


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
