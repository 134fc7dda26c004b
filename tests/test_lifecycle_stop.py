"""PluginLifecycle in-process: stopping survives the daemon's repeated cancellations."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

from harness import GUARD, Daemon, wait_until
from support.waits import loop_turn, quiet_blocking

from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.settings import KubeletSettings


def test_cancelled_again_while_stopping_still_stops_the_server_and_removes_its_socket() -> None:
    """Daemon.stop() re-cancels every 0.25 s (asyncio.wait_for on 3.11 can swallow a cancel); a
    re-cancel landing inside server.stop() must not leave a running server for the garbage
    collector (``Server.__del__`` then prints a traceback once the loop is closed) or our socket."""

    async def scenario(plugin_dir: Path, turns: int | None) -> None:
        tracker = HealthTracker(required=("device",))
        lifecycle = PluginLifecycle(KubeletSettings(plugin_dir), "p.sock", "example.com/thing",
                                    lambda: TrackedDevicePlugin(["a"], tracker))
        task = asyncio.create_task(lifecycle.run())
        socket = plugin_dir / "p.sock"
        if turns is None:
            await wait_until(socket.exists)  # serving, waiting for a kubelet that never comes
        else:
            for _ in range(turns):  # somewhere in start-up: creating, binding, starting
                await loop_turn()
        while not task.done():  # cancel at every turn of the loop, as hard as it gets
            task.cancel()
            await loop_turn()
        assert task.cancelled()
        assert not socket.exists(), f"the stopped server's socket was left behind ({turns} turns)"
        assert lifecycle.open_streams == 0

    # Kept sync on purpose, one asyncio.run per case: the turns count from a fresh loop's start,
    # and the listing runs after that loop closed, when a server left running would have been
    # collected. One async test would share a loop across cases and list before it closed.
    for turns in (None, *range(12)):
        with tempfile.TemporaryDirectory(prefix="hlp-") as directory:
            asyncio.run(asyncio.wait_for(scenario(Path(directory), turns), 60))  # a guard
            assert os.listdir(directory) == [], f"left behind when cancelled after {turns} turns"


async def test_stop_signals_while_it_stops_never_kill_the_daemon(tmp_path: Path) -> None:
    """SIGTERM after SIGTERM, one every 0.1 ms or so, from the first until the process has
    exited: it stops and exits 0. asyncio's own handlers end with its loop and put back the
    default action, so a signal in the moment between the loop's close and the exit (a long one
    when a helper is stuck in the kernel, or the machine is busy) would kill it; the daemon's
    handlers last until the process exits. A pidfd names the process, never a reused pid."""
    dev = tmp_path / "dev"
    dev.mkdir()
    plugin_dir = Path(tempfile.mkdtemp(prefix="hlp-", dir="/tmp"))
    try:
        for _ in range(3):
            proc = await Daemon(["bootstrap", "--plugin-dir", str(plugin_dir), "--dev-dir", str(dev),
                                 "--hypervisor", "kvm"]).start()
            await proc.wait_http("/healthz", 200)  # its handlers are in place
            pidfd = os.pidfd_open(proc.pid)
            sent = 0

            def flood(pidfd: int = pidfd) -> None:
                nonlocal sent
                with contextlib.suppress(ProcessLookupError):
                    while True:
                        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                        sent += 1
                        # Not a wait for an event: pacing, so that the daemon gets on with
                        # stopping between signals (a flood would keep every thread in handlers).
                        quiet_blocking(0.0001, "pacing: the daemon stops between signals")

            try:
                await asyncio.to_thread(flood)  # returns once the process has exited
            finally:
                os.close(pidfd)
            code = await proc.signal(signal.SIGKILL, timeout=GUARD)  # only reaps: it has exited
            assert code == 0, f"exit {code} after {sent} SIGTERMs\n" + "\n".join(proc.raw[-20:])
            assert sent > 1, sent
            assert "hlplugin bootstrap stopping" in proc.messages()
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)
