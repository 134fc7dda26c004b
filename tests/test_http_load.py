"""The main daemon's HTTP port under attack, as a real process on real /dev/kvm, registered with
the kubelet emulator: 2,000 slow clients, or an 800-request /healthz burst, with and without a
1,024 fd limit (a common container default). Loopback only, bounded in count and time.

Each must leave the daemon under its memory limit (the one deploy/base gives it), alive
(/healthz 200 throughout), ready (/readyz 200 throughout: an attack must not change readiness)
and advertising its capacity (never withdrawn, as the emulated kubelet sees it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from harness import Daemon, Node, needs_kvm, wait_until
from prometheus_client.parser import text_string_to_metric_families
from support.waits import quiet

from hlplugin.tools.emulator import KubeletEmulator

pytestmark = [needs_kvm, pytest.mark.slow]

RESOURCE = "hyperlight.dev/hypervisor"
SLOTS = 2
ROOT = Path(__file__).resolve().parent.parent
SLOW_CLIENTS = 2000
BURST = 800
HALF_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
FULL_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def memory_limit_mib() -> float:
    ds = yaml.safe_load((ROOT / "deploy/base/device-plugin.yaml").read_text())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    return float(limit.removesuffix("Mi"))


def status_value(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def cap(nofile: int | None) -> int:
    """The daemon's connection cap under ``nofile`` (it inherits ours without)."""
    limit = nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return min(256, limit // 8)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def ensure_client_fds(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the test needs {needed} fds for its clients; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def connect_all(port: int, count: int, payload: bytes, budget: float = 20) -> list[socket.socket]:
    """``count`` connections started at once, as an attacker would (not one after another), each
    sending ``payload`` as soon as it is up; those up within ``budget`` seconds."""
    selector = selectors.DefaultSelector()
    for _ in range(count):
        conn = socket.socket()
        conn.setblocking(False)
        if conn.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            conn.close()
            continue
        selector.register(conn, selectors.EVENT_WRITE)
    connected = []
    stop = time.monotonic() + budget
    while selector.get_map() and time.monotonic() < stop:
        for key, _ in selector.select(timeout=0.5):
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            selector.unregister(conn)
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                conn.close()
                continue
            with contextlib.suppress(OSError):
                conn.send(payload)
            connected.append(conn)
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    selector.close()
    return connected


def dribble(conns: list[socket.socket], stop: threading.Event) -> None:
    """Slowloris: a header line a second on every connection, so no per-read timeout ever ends
    one; only a whole-request deadline does."""
    while not stop.wait(1.0):
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(b"X-Slow: y\r\n")


def burst(port: int, count: int, budget: float = 30) -> list[int]:
    """``count`` whole /healthz requests sent at once, then every answer read (all within
    ``budget`` seconds): each answer's status, 0 for a connection closed unanswered, -1 for one
    still open at the end."""
    selector = selectors.DefaultSelector()
    answers: dict[socket.socket, list[bytes]] = {}
    for conn in connect_all(port, count, FULL_REQUEST):
        selector.register(conn, selectors.EVENT_READ)
        answers[conn] = []
    done: dict[socket.socket, bytes] = {}
    stop = time.monotonic() + budget
    while selector.get_map() and time.monotonic() < stop:
        for key, _ in selector.select(timeout=0.5):
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            try:
                chunk = conn.recv(4096)
            except OSError:
                chunk = b""
            if chunk:
                answers[conn].append(chunk)
                continue
            selector.unregister(conn)
            done[conn] = b"".join(answers[conn])
    selector.close()
    statuses = []
    for conn in answers:
        conn.close()
        if conn not in done:
            statuses.append(-1)
        else:
            statuses.append(int(done[conn].split(b" ", 2)[1]) if done[conn] else 0)
    return statuses


def device_checks(metrics: bytes) -> float:
    return sum(sample.value for family in text_string_to_metric_families(metrics.decode())
               if family.name == "hyperlight_probe_duration_seconds"
               for sample in family.samples if sample.name.endswith("_count"))


class Watch:
    """Probes /healthz and /readyz as the kubelet would, and follows the emulated kubelet's view
    of the capacity, while an attack runs."""

    def __init__(self, proc: Daemon, kubelet: KubeletEmulator) -> None:
        self.proc = proc
        self.kubelet = kubelet
        self.probes: list[tuple[str, int]] = []
        self.device_checks = 0.0  # as /metrics last said
        self.lowest = kubelet.allocatable(RESOURCE)
        self.threads = self.base_threads = status_value(proc.pid, "Threads")
        self.fds = self.base_fds = open_fds(proc.pid)
        self.base_rss = status_value(proc.pid, "VmRSS")
        self._tasks: list[asyncio.Task[None]] = []

    def _sample(self) -> None:
        self.threads = max(self.threads, status_value(self.proc.pid, "Threads"))
        self.fds = max(self.fds, open_fds(self.proc.pid))

    async def _probe(self) -> None:
        while True:
            for path in ("/healthz", "/readyz"):
                self.probes.append((path, (await self.proc.get(path))[0]))
                self._sample()
            code, metrics = await self.proc.get("/metrics")
            self.probes.append(("/metrics", code))
            if code == 200:
                self.device_checks = device_checks(metrics)
            await quiet(0.1, "the prober's pace")

    async def _capacity(self) -> None:
        def seen() -> bool:
            self.lowest = min(self.lowest, self.kubelet.allocatable(RESOURCE))
            return False

        with contextlib.suppress(TimeoutError):
            await self.kubelet.wait_for(seen, timeout=3600)

    def __enter__(self) -> Watch:
        self._tasks = [asyncio.create_task(self._probe()), asyncio.create_task(self._capacity())]
        return self

    def __exit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()

    def failed(self) -> list[tuple[str, int]]:
        return [(path, code) for path, code in self.probes if code != 200]


@contextlib.asynccontextmanager
async def attacked_daemon(tmp_path: Path, nofile: int | None) -> AsyncIterator[
        tuple[KubeletEmulator, Daemon]]:
    node = Node.make(tmp_path)
    kubelet = KubeletEmulator(node.plugin_dir)
    await kubelet.start()
    # Checks every second (the floor), so an attack that starves them shows within it.
    proc = Daemon(node.serve_args("--hypervisor", "kvm", "--device-count", str(SLOTS),
                                  "--cdi-interval", "1", "--health-interval", "1"))
    if nofile is not None:  # prlimit sets the limit and execs: the daemon runs under it from start
        proc.args[:0] = ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
    try:
        await proc.start()
        try:
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == SLOTS, timeout=30)
            await proc.wait_http("/readyz", 200)
            if nofile is not None:
                assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (nofile, nofile)
            yield kubelet, proc
        finally:
            assert await proc.stop() == 0
    finally:
        await kubelet.stop()


async def settled(proc: Daemon, kubelet: KubeletEmulator, watch: Watch, nofile: int | None) -> None:
    """After the attack: the daemon held no thread and at most its share of fds for the clients,
    let go of them, stayed under its memory limit, never failed a probe, never withdrew
    capacity, and never turned unhealthy."""
    assert watch.threads <= watch.base_threads + 4, f"{watch.threads} threads"
    limit = nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    # The connection cap, and the accept batches (32 each) in flight for a few loop turns.
    share = cap(nofile) + 4 * 32
    assert watch.fds <= watch.base_fds + share, f"{watch.fds} fds, of {limit}"
    await wait_until(lambda: open_fds(proc.pid) <= watch.base_fds + 8, timeout=30)
    peak = status_value(proc.pid, "VmHWM") / 1024
    assert peak < memory_limit_mib(), f"peak RSS {peak:.0f} MiB"
    assert watch.probes and not watch.failed(), watch.failed()[:10]
    assert watch.lowest == SLOTS, f"capacity dropped to {watch.lowest}"
    assert kubelet.allocatable(RESOURCE) == SLOTS
    code, body = await proc.get("/metrics")
    assert code == 200
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "hyperlight_health_transitions":
            assert not [s for s in family.samples if s.labels.get("to") == "unhealthy" and s.value]
    print(f"RSS {watch.base_rss / 1024:.1f} MiB before, {status_value(proc.pid, 'VmRSS') / 1024:.1f} after; "
          f"peak RSS {peak:.1f} MiB, at most {watch.threads} threads and {watch.fds} fds, "
          f"{len(watch.probes)} probes all 200")


@pytest.mark.parametrize("nofile", [None, 1024], ids=["default-fds", "1024-fds"])
@pytest.mark.guard(180)
async def test_two_thousand_slow_clients(tmp_path: Path, nofile: int | None) -> None:
    ensure_client_fds(SLOW_CLIENTS + 256)

    async with attacked_daemon(tmp_path, nofile) as (kubelet, proc):
        with Watch(proc, kubelet) as watch:
            await wait_until(lambda: watch.device_checks > 0, timeout=30)
            conns = await asyncio.to_thread(connect_all, proc.port, SLOW_CLIENTS, HALF_REQUEST)
            stop = threading.Event()
            dribbling = asyncio.create_task(asyncio.to_thread(dribble, conns, stop))
            try:
                assert len(conns) > SLOW_CLIENTS // 2, "the attack never got going"
                # Held while the daemon runs two device checks (each opens fds) and the
                # CDI checks run meanwhile (every second).
                checks = watch.device_checks
                await wait_until(lambda: watch.device_checks >= checks + 2, timeout=30)
            finally:
                stop.set()
                await dribbling
                for conn in conns:  # EOF on every unfinished request at once
                    conn.close()
            # Answers to the probes after the EOFs, too.
            probes = len(watch.probes)
            await wait_until(lambda: len(watch.probes) >= probes + 6, timeout=30)
        await settled(proc, kubelet, watch, nofile)


@pytest.mark.parametrize("nofile", [None, 1024], ids=["default-fds", "1024-fds"])
@pytest.mark.guard(180)
async def test_healthz_burst(tmp_path: Path, nofile: int | None) -> None:
    ensure_client_fds(BURST + 256)

    async with attacked_daemon(tmp_path, nofile) as (kubelet, proc):
        with Watch(proc, kubelet) as watch:
            statuses = await asyncio.to_thread(burst, proc.port, BURST)
            probes = len(watch.probes)
            await wait_until(lambda: len(watch.probes) >= probes + 6, timeout=30)
        answered = [s for s in statuses if s > 0]
        print(f"burst: {len(answered)} of {BURST} answered, {statuses.count(0)} closed "
              f"unanswered, {statuses.count(-1)} still open")
        # Every connection answered or closed (none left hanging), every answer 200, and at
        # least as many answered as the cap admits at once (beyond it the oldest are closed),
        # less the one slot the watch's own probe may hold while the burst lands.
        assert statuses.count(-1) == 0 and set(answered) == {200}, sorted(set(statuses))
        assert len(answered) >= cap(nofile) - 1, len(answered)
        await settled(proc, kubelet, watch, nofile)
