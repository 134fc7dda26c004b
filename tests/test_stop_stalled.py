"""SIGTERM stops `hlplugin serve` within the pod's grace whatever its ListAndWatch readers hold.

Real process, real kubelet emulator, real stopped readers (SIGSTOP): gRPC's own stop waits for
every write a connection holds, and a reader that stops reading holds one for as long as it likes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import (
    STALLING_CLIENT,
    Node,
    emulator,
    healthy_tracker,
    needs_kvm,
    obstruct_with_directory,
    on_kubelet,
)

from hlplugin.deviceplugin.health.conditions import HealthState
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import MAX_STREAMS
from hlplugin.deviceplugin.settings import KubeletSettings
from hlplugin.plugin import HypervisorPlugin, slots

RESOURCE = "hyperlight.dev/hypervisor"
SLOTS = 2000  # the default: ~40 KB a list, so a stopped reader's window fills in two lists
POD_GRACE = 5.0  # seconds between the kubelet's SIGTERM and its SIGKILL (deploy/base)


@needs_kvm
@pytest.mark.slow
async def test_sigterm_ends_the_daemon_in_time_while_stopped_readers_hold_its_streams(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    socket = node.plugin_dir / "hyperlight.sock"
    spec = node.cdi_dir / "hyperlight.json"
    readers: list[asyncio.subprocess.Process] = []
    async with on_kubelet(node, node.serve_args("--device-count", str(SLOTS))) as (kubelet, proc):
        try:
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == SLOTS, timeout=30)
            # Every stream the plugin serves beside the kubelet's.
            await start_readers(socket, MAX_STREAMS - 1, readers)
            # Twenty health transitions, each a 40 KB list for every stream: the stopped readers'
            # connections fill (both hops through the frame guard and the guard's buffer between
            # them take ~0.5 MB), and the daemon holds writes they will never take.
            for _ in range(10):
                obstruct_with_directory(spec)
                await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0, timeout=10)
                os.rmdir(spec)
                await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == SLOTS, timeout=10)

            began = time.monotonic()
            code = await proc.signal(signal.SIGTERM, timeout=2 * POD_GRACE, kill_on_timeout=False)
            took = time.monotonic() - began
        finally:
            for reader in readers:
                reader.kill()  # SIGKILL ends a stopped process too
                await reader.wait()
    print(f"SIGTERM to exit with {len(readers)} stopped readers: {took:.2f} s")
    assert code == 0
    assert took < POD_GRACE / 2, f"stopped {took:.1f} s after SIGTERM; the pod's grace is {POD_GRACE} s"
    assert not socket.exists(), "the socket was left behind"
    assert any("did not stop within" in m for m in proc.messages()), proc.messages()[-10:]
    # The server left behind ends with the process, quietly (no traceback from its collection).
    assert not [line for line in proc.raw if "Traceback" in line or "Exception ignored" in line]


async def start_readers(socket: Path, count: int, readers: list[asyncio.subprocess.Process]
                        ) -> None:
    """Add to ``readers`` ``count`` processes that each read a ListAndWatch stream's first list,
    then stop (the caller kills them, however far this got)."""
    for _ in range(count):
        reader = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STALLING_CLIENT, str(socket), stdout=subprocess.PIPE)
        readers.append(reader)
        assert reader.stdout is not None
        assert (await reader.stdout.readline()).strip() == b"Healthy"


async def test_a_kubelet_restart_registers_anew_while_stopped_readers_hold_the_old_streams(
        ) -> None:
    """In process: the lifecycle stops the old server before registering a fresh one, and that stop
    used to wait for ever on a stopped reader, so the plugin never registered again."""
    plugin_dir = Path(tempfile.mkdtemp(prefix="hlp-", dir="/tmp"))
    tracker = healthy_tracker()

    async def gate() -> HealthState:
        return tracker.state

    lifecycle = PluginLifecycle(KubeletSettings(plugin_dir), "hyperlight.sock", RESOURCE,
                                lambda: HypervisorPlugin("kvm", slots("kvm", SLOTS), tracker, gate))
    readers: list[asyncio.subprocess.Process] = []
    async with emulator(plugin_dir) as kubelet:
        task = asyncio.create_task(lifecycle.run())
        try:
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == SLOTS)
            await start_readers(plugin_dir / "hyperlight.sock", 3, readers)
            for n in range(6):  # each a 40 KB list for every stream: the readers' windows fill
                tracker.set_condition("device", n % 2 == 1, "flap")
                await kubelet.wait_for(lambda n=n: kubelet.allocatable(RESOURCE) == (
                    SLOTS if n % 2 else 0))
            calls = kubelet.register_calls
            await kubelet.restart()
            await kubelet.wait_for(lambda: kubelet.register_calls > calls
                                   and kubelet.allocatable(RESOURCE) == SLOTS, timeout=10)
        finally:
            task.cancel()
            await asyncio.wait({task})
            for reader in readers:
                reader.kill()
                await reader.wait()
            shutil.rmtree(plugin_dir, ignore_errors=True)
