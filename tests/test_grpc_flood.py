"""The HTTP/2 rapid reset (CVE-2023-44487) on the plugin socket of each daemon, as a real process
registered with the kubelet emulator: 20,000 HEADERS + RST_STREAM pairs over a few connections,
then over more connections than the server admits. Unix socket only, bounded in count and time.

The daemon's peak memory (VmHWM) may grow by at most 8 MiB over its peak before the flood (which
already includes the kubelet's Allocates at full speed), and the kubelet's own Allocates, issued
all along, must all succeed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from h2flood import flood
from harness import Node, needs_kvm, on_kubelet, proc_status
from support.waits import quiet

from hlplugin.deviceplugin.kubelet.grpcserver import MAX_CONNECTIONS
from hlplugin.tools.emulator import AdmissionError, KubeletEmulator

pytestmark = [needs_kvm, pytest.mark.slow]

PAIRS = 20_000
GROWTH_KIB = 8 * 1024
DAEMONS = {
    # daemon: (its arguments beside --plugin-dir, resource, socket, an ID it advertises)
    "serve": (["serve", "--device-count", "2000"], "hyperlight.dev/hypervisor", "hyperlight.sock",
              "kvm-1"),
    "bootstrap": (["bootstrap", "--dev-dir", "/dev"], "hyperlight.dev/device-access",
                  "hyperlight-device-access.sock", "device-access-kvm"),
}


class Allocations:
    """The kubelet's Allocate in a loop, one call at a time as the kubelet makes them."""

    def __init__(self, kubelet: KubeletEmulator, resource: str, device: str) -> None:
        self.kubelet, self.resource, self.device = kubelet, resource, device
        self.calls = 0
        self.failures: list[str] = []
        self._running = True
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self._running:
            try:
                await self.kubelet.allocate(self.resource, [[self.device]], timeout=10)
            except AdmissionError as exc:
                self.failures.append(str(exc)[:200])
            self.calls += 1

    async def stop(self) -> None:
        self._running = False
        await self._task


@pytest.mark.parametrize("which", list(DAEMONS))
async def test_a_rapid_reset_flood_grows_memory_little_and_fails_no_allocate(
        tmp_path: Path, which: str) -> None:
    args, resource, socket_name, device = DAEMONS[which]
    node = Node.make(tmp_path)
    path = str(node.plugin_dir / socket_name)
    argv = [args[0], "--plugin-dir", str(node.plugin_dir), *args[1:]]
    if which == "serve":
        argv = node.serve_args(*args[1:])
    async with on_kubelet(node, argv) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0, timeout=30)
        allocations = Allocations(kubelet, resource, device)
        try:
            await quiet(1.0, "the kubelet's calls at full speed are part of idle")
            idle = proc_status(proc.pid)["VmHWM"]
            floods = []
            # A few connections, as the CVE's pattern; then more than the server admits at once.
            for connections in (4, 4 * MAX_CONNECTIONS):
                began = time.monotonic()
                floods.append(await asyncio.to_thread(flood, path, PAIRS, connections, budget=45))
                assert time.monotonic() - began < 60  # a guard: bounded in time
            peak = proc_status(proc.pid)["VmHWM"]
        finally:
            await allocations.stop()
        # The daemon still serves the kubelet: its stream and registration are intact.
        assert kubelet.registered(resource)
        await kubelet.allocate(resource, [[device]])
    print(f"{which}: idle peak {idle / 1024:.1f} MiB, after the floods {peak / 1024:.1f} MiB "
          f"(+{(peak - idle) / 1024:.1f} MiB); {allocations.calls} Allocates meanwhile; {floods}")
    assert all(f.pairs == PAIRS for f in floods), floods
    assert allocations.failures == [], allocations.failures[:5]
    assert allocations.calls > 0
    assert peak - idle <= GROWTH_KIB, f"peak memory grew by {(peak - idle) / 1024:.1f} MiB"
