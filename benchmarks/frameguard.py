#!/usr/bin/env python3
"""What the frame guard costs (issue 40, item 3), and what it holds back: a grpc.aio DevicePlugin
server answering a fixed Allocate, as a process of its own, with and without
src/hlplugin/deviceplugin/frameguard.py in front of its unix socket.

    python benchmarks/frameguard.py [--pairs 5] [--calls 3000] [--no-flood]

Each pair starts both servers afresh (which goes first alternates) and measures, for each:

- start: its own time from building the server (importing the guard included) to listening,
  and the time from process start to its first answer;
- idle working set: VmRSS once it answered one call and sat 0.5 s;
- Allocate p50 and p99 at concurrency 1 and 16, over one channel as the kubelet holds one.

Reported: each figure's median over the pairs of (guarded - unguarded), and the issue's limits
(p99 at 16 +1 ms, idle +2 MiB, start +20 ms). Then, unless --no-flood, the CONTINUATION flood
(64 MiB of header fields on 4 connections) against each, as VmHWM growth. Nothing is asserted.

    python benchmarks/frameguard.py --daemons [--pairs 5] [--calls 3000]

The same for the main daemon (`hlplugin serve`) on the kubelet emulator: this tree's daemon with
--frame-guard true against the same daemon with it off (the default), both on the real
/dev/kvm, as five interleaved pairs of fresh daemons: start to registered, idle VmRSS,
Allocate p50 and p99 at concurrency 1 and 16 over one channel, and the surge hand-over's gap as
the kubelet sees it (the old stream's end to the new instance's first list; the median of 3 per
daemon). Needs root and /dev/kvm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import hpack

import hlplugin.deviceplugin  # the daemons import the package anyway; the guard's module is timed
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc

SCRIPT = Path(__file__).resolve()
REQUEST = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])
LIMITS = {"Allocate p99, concurrency 16": 1.0, "idle working set (VmRSS)": 2.0, "start to listening": 20.0}


class Plugin(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(self, request: pb.Empty, context: object) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def Allocate(self, request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        response = pb.AllocateResponse()
        for _ in request.container_requests:
            response.container_responses.add(cdi_devices=[pb.CDIDevice(name="hyperlight.dev/hypervisor=kvm")])
        return response


async def serve(public: Path, guarded: bool) -> None:
    """The child: serve until stdin closes; print the seconds from building to listening."""
    began = time.perf_counter()
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    if guarded:
        from hlplugin.deviceplugin.frameguard import FrameGuard, abstract_address
        address = abstract_address()
        server.add_insecure_port(address)
        await server.start()
        guard = FrameGuard(address)
        await guard.listen(public)
    else:
        server.add_insecure_port(f"unix://{public}")
        await server.start()
    print(f"ready {time.perf_counter() - began:.6f}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)
    if guarded:
        await guard.close()


def status(pid: int, key: str) -> float:
    """A /proc/<pid>/status figure in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


@contextlib.contextmanager
def child(public: Path, guarded: bool) -> Iterator[tuple[subprocess.Popen[str], float, float]]:
    """A server process: it, its own start time and the time to its ready line (seconds)."""
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--serve", str(public),
                             *([] if guarded else ["--unguarded"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        yield proc, float(line[1]), time.perf_counter() - began
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            public.unlink()


@contextlib.asynccontextmanager
async def stub(public: Path) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    async with grpc.aio.insecure_channel(f"unix://{public}") as channel:
        yield pb_grpc.DevicePluginStub(channel)


def pct(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def hammer(plugin: pb_grpc.DevicePluginStub, calls: int, concurrency: int) -> tuple[float, float]:
    """``calls`` Allocates from ``concurrency`` workers: p50 and p99 in ms."""
    latencies: list[float] = []
    jobs = iter(range(calls))

    async def worker() -> None:
        for _ in jobs:
            began = time.perf_counter()
            await plugin.Allocate(REQUEST, timeout=30)
            latencies.append(time.perf_counter() - began)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return pct(latencies, 50) * 1000, pct(latencies, 99) * 1000


async def one_pair(tmp: Path, calls: int, guarded_first: bool) -> dict[str, dict[str, float]]:
    """Both servers measured once, interleaved: figure -> {"guarded": v, "unguarded": v}."""
    modes = [True, False] if guarded_first else [False, True]
    figures: dict[str, dict[str, float]] = {}

    def put(name: str, guarded: bool, value: float) -> None:
        figures.setdefault(name, {})["guarded" if guarded else "unguarded"] = value

    with contextlib.ExitStack() as stack:
        sockets = {guarded: tmp / f"g{guarded}.sock" for guarded in modes}
        for guarded in modes:
            proc, own, total = stack.enter_context(child(sockets[guarded], guarded))
            put("start to listening", guarded, own * 1000)
            put("process start to ready", guarded, total * 1000)
            async with stub(sockets[guarded]) as plugin:
                await plugin.Allocate(REQUEST, timeout=10)
            await asyncio.sleep(0.5)
            put("idle working set (VmRSS)", guarded, status(proc.pid, "VmRSS"))
        await allocate_latencies(sockets, modes, calls, put)
    return figures


async def allocate_latencies(sockets: dict[bool, Path], modes: list[bool], calls: int,
                             put: Callable[[str, bool, float], None]) -> None:
    """Allocate p50 and p99 at concurrency 1 and 16 on each mode's socket, interleaved."""
    for concurrency in (1, 16):
        for guarded in modes:
            async with stub(sockets[guarded]) as plugin:
                await hammer(plugin, 200, 4)  # warm
                p50, p99 = await hammer(plugin, calls, concurrency)
            put(f"Allocate p50, concurrency {concurrency}", guarded, p50)
            put(f"Allocate p99, concurrency {concurrency}", guarded, p99)


HYPERVISOR = "hyperlight.dev/hypervisor"
SLOTS = 2000
HANDOVERS = 3  # surge hand-overs per daemon and pair


async def one_daemon_pair(tmp: Path, calls: int, guarded_first: bool) -> dict[str, dict[str, float]]:
    """The main daemon with and without --frame-guard measured once, interleaved, each on a
    kubelet emulator of its own: figure -> {"guarded": v, "unguarded": v}."""
    from hlplugin.tools import drive  # the daemon mode's only: the server mode stays lean

    env = {"PYTHONPATH": str(Path(hlplugin.deviceplugin.__file__).parents[2])}  # this tree's
    modes = [True, False] if guarded_first else [False, True]
    figures: dict[str, dict[str, float]] = {}

    def put(name: str, guarded: bool, value: float) -> None:
        figures.setdefault(name, {})["guarded" if guarded else "unguarded"] = value

    async with contextlib.AsyncExitStack() as stack:
        sockets: dict[bool, Path] = {}
        kubelets: dict[bool, Any] = {}
        procs: dict[bool, Any] = {}
        args: dict[bool, list[str]] = {}
        for guarded in modes:
            node = drive.Node.make(tmp / f"d{guarded}")
            args[guarded] = node.serve_args("--hypervisor", "kvm", "--device-count", str(SLOTS),
                                            "--frame-guard", str(guarded).lower())
            began = time.monotonic()
            kubelet = kubelets[guarded] = await stack.enter_async_context(drive.emulator(node.plugin_dir))
            proc = procs[guarded] = await stack.enter_async_context(
                drive.daemon(args[guarded], env))
            await kubelet.wait_for(lambda k=kubelet: k.allocatable(HYPERVISOR) == SLOTS, 30)
            put("start to registered", guarded, (time.monotonic() - began) * 1000)
            sockets[guarded] = node.plugin_dir / "hyperlight.sock"
            async with stub(sockets[guarded]) as plugin:
                await plugin.Allocate(REQUEST, timeout=10)
            await asyncio.sleep(0.5)
            put("idle working set (VmRSS)", guarded, status(proc.pid, "VmRSS"))
        await allocate_latencies(sockets, modes, calls, put)
        for guarded in modes:
            kubelet, old, gaps = kubelets[guarded], procs[guarded], []
            for _ in range(HANDOVERS):
                new = await stack.enter_async_context(drive.daemon(args[guarded], env))
                await new.wait_http("/readyz", 200, 30)  # the standby, Ready beside the old one
                calls_before = kubelet.register_calls
                await old.stop()
                await kubelet.wait_for(lambda k=kubelet, c=calls_before: k.register_calls > c
                                       and k.allocatable(HYPERVISOR) == SLOTS, 30)
                gaps.append(kubelet.handover_gaps(HYPERVISOR)[-1] * 1000)
                old = new
            put("surge hand-over gap (kubelet)", guarded, statistics.median(gaps))
    return figures


# The CONTINUATION flood (tests/frameguard_server.py has the same, and says why these fields).
FIELD = b"\x00\x04x-pa" + bytes([100]) + b"v" * 100
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


async def flood(public: Path, connections: int = 4, budget: int = 64 << 20, seconds: float = 2.0) -> int:
    """The flood on ``connections`` connections, each reopened when the server ends it; returns
    how many it ended."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    opening = PREFACE + frame(0x4, 0, 0, b"") + frame(0x1, 0, 1, hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
        (":path", "/v1beta1.DevicePlugin/Allocate"), ("content-type", "application/grpc")]))
    continuation = frame(0x9, 0, 1, FIELD * (16384 // len(FIELD)))
    sent, ended = 0, 0

    async def one() -> None:
        nonlocal sent, ended
        while sent < budget and loop.time() < until:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, str(public))
                    data = opening
                    while sent < budget and loop.time() < until:
                        async with asyncio.timeout(max(0.01, until - loop.time())):
                            await loop.sock_sendall(sock, data)
                        sent += len(data)
                        data = continuation
                except (BrokenPipeError, ConnectionResetError):
                    ended += 1
                except TimeoutError:
                    return

    await asyncio.gather(*(one() for _ in range(connections)))
    return ended


async def flood_growth(tmp: Path, guarded: bool) -> tuple[float, float, int]:
    with child(tmp / "flood.sock", guarded) as (proc, _, _):
        async with stub(tmp / "flood.sock") as plugin:
            await hammer(plugin, 200, 4)
        before = status(proc.pid, "VmHWM")
        ended = await flood(tmp / "flood.sock")
        await asyncio.sleep(0.3)
        return before, status(proc.pid, "VmHWM") - before, ended


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000, help="Allocates per measurement")
    parser.add_argument("--no-flood", action="store_true")
    parser.add_argument("--daemons", action="store_true",
                        help="compare the main daemon with and without --frame-guard instead")
    args = parser.parse_args()
    print(f"{args.pairs} interleaved pairs, {args.calls} Allocates per measurement, "
          f"{os.cpu_count()} CPUs" + (", serve with and without --frame-guard" if args.daemons else ""),
          flush=True)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="fg-") as tmp:
        for n in range(args.pairs):
            if args.daemons:
                pairs.append(await one_daemon_pair(Path(tmp) / str(n), args.calls, n % 2 == 0))
            else:
                pairs.append(await one_pair(Path(tmp), args.calls, guarded_first=n % 2 == 0))
        print(f"{'figure':34s} {'unguarded':>10s} {'guarded':>10s} {'median diff':>12s}  pairs' diffs")
        for name in pairs[0]:
            unit = "MiB" if "VmRSS" in name else "ms"
            diffs = [p[name]["guarded"] - p[name]["unguarded"] for p in pairs]
            median = statistics.median(diffs)
            limit = LIMITS.get(name)
            verdict = "" if limit is None else \
                f"  (limit +{limit:g} {unit}: {'met' if median <= limit else 'MISSED'})"
            print(f"{name:34s} {statistics.median(p[name]['unguarded'] for p in pairs):10.3f} "
                  f"{statistics.median(p[name]['guarded'] for p in pairs):10.3f} {median:+12.3f} {unit}"
                  f"  [{', '.join(f'{d:+.3f}' for d in diffs)}]{verdict}", flush=True)
        if not args.no_flood and not args.daemons:
            for guarded in (True, False):
                before, growth, ended = await flood_growth(Path(tmp), guarded)
                who = "guarded" if guarded else "unguarded"
                print(f"CONTINUATION flood, 64 MiB on 4 connections, {who}: "
                      f"VmHWM {before:.1f} MiB, +{growth:.1f} MiB, {ended} connections ended by the server",
                      flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        asyncio.run(serve(Path(sys.argv[2]), "--unguarded" not in sys.argv[3:]))
    else:
        sys.exit(asyncio.run(main()))
