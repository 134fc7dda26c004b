"""The hand-over's order scenario, run alike on the kubelet emulator (tests/test_handover.py) and on
the real kubelet (tests/test_cluster_handover.py), so that the two cannot drift apart."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

from harness import healthy_tracker, running, wait_until

from hlplugin.deviceplugin.health.conditions import HealthState
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.settings import KubeletSettings
from hlplugin.plugin import HypervisorPlugin, slots


async def second_survives(plugin_dir: Path, resource: str, *, before: bool, hold: float = 2.0,
                          prefix: str = "order") -> bool:
    """Two instances of ``resource``, each on a socket name of its own, against whatever kubelet
    serves ``plugin_dir`` (the emulator, or a real one: tests/test_cluster_upgrade.py): A
    registers and streams; B registers while A still streams (``before``) or only once A has
    stopped (its stream ended). Whether B still has its stream ``hold`` seconds after A stopped
    (B's stream grace is 60 s, so it does not register anew meanwhile)."""
    tracker = healthy_tracker()

    async def gate() -> HealthState:
        return tracker.state

    def make(name: str, **options: float) -> PluginLifecycle:
        return PluginLifecycle(KubeletSettings(plugin_dir, **options), f"{prefix}-{name}.sock",
                               resource, lambda: HypervisorPlugin("kvm", slots("kvm", 2), tracker, gate))

    a, b = make("a"), make("b", stream_grace=60)
    async with AsyncExitStack() as stack:
        first = AsyncExitStack()
        await first.enter_async_context(running(a))
        await wait_until(lambda: a.open_streams == 1, timeout=20, what="A streams")
        if before:
            await stack.enter_async_context(running(b))
            await wait_until(lambda: b.open_streams == 1, timeout=20, what="B streams beside A")
            await first.aclose()
        else:
            await first.aclose()
            await stack.enter_async_context(running(b))
            await wait_until(lambda: b.open_streams == 1, timeout=20, what="B streams after A")
        try:
            await wait_until(lambda: b.open_streams == 0, timeout=hold)
        except TimeoutError:
            return True
        return False
