"""PluginLifecycle in-process: stopping survives the daemon's repeated cancellations."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from harness import wait_until

from hlplugin.deviceplugin.conditions import HealthTracker
from hlplugin.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.servicer import TrackedDevicePlugin


def test_cancelled_again_while_stopping_still_stops_the_server_and_removes_its_socket() -> None:
    """run_daemon re-cancels every 0.25 s (asyncio.wait_for on 3.11 can swallow a cancel); a
    re-cancel landing inside server.stop() must not leave a running server for the garbage
    collector (``Server.__del__`` then prints a traceback once the loop is closed) or our socket."""

    async def scenario(plugin_dir: Path, turns: int | None) -> None:
        tracker = HealthTracker(required=("device",))
        lifecycle = PluginLifecycle(plugin_dir, "p.sock", "example.com/thing",
                                    lambda: TrackedDevicePlugin(["a"], tracker))
        task = asyncio.create_task(lifecycle.run())
        socket = plugin_dir / "p.sock"
        if turns is None:
            await wait_until(socket.exists)  # serving, waiting for a kubelet that never comes
        else:
            for _ in range(turns):  # somewhere in start-up: creating, binding, starting
                await asyncio.sleep(0)
        while not task.done():  # cancel at every turn of the loop, as hard as it gets
            task.cancel()
            await asyncio.sleep(0)
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
