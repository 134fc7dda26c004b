"""The kubelet emulator's rules (src/hlplugin/tools/emulator.py, tests/test_emulator.py) checked on
the real kubelet, so the emulator cannot drift from it: the same bare device plugin of the test's
own (tests/test_emulator.py's BarePlugin, registering a resource of its own name) in the same
scenarios, with the same outcomes asserted. The plugin runs in the test process, on the host; its
socket is in the cluster's device-plugin directory (bound from the run directory), which the
kubelet and the test reach at two paths. Budgets: a few seconds each, plus node-status waits.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.bareplugin import BarePlugin
from support.cluster import NODE, PAUSE_IMAGE, Cluster

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.kubelet.deviceplugin.kubeletsock import listens
from hlplugin.deviceplugin.kubelet.endpoint import socket_identity
from hlplugin.tools.drive import wait_until
from hlplugin.tools.emulator import CHECKPOINT, no_healthy_devices

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.guard(240)]

# Resources of the tests' own, nothing of ours serves them; one per test, since a plugin stopped at
# the end of one test ends its stream a moment later, and the kubelet then disconnects whichever
# client holds its name (the per-name rule below): the next test's, had it the same name.
BARE = "hlcluster.test/bare"
RESTART, DISCONNECT = "hlcluster.test/restart", "hlcluster.test/disconnect"
FIRST_ENDS_LATE, FIRST_ENDS_FIRST = "hlcluster.test/late", "hlcluster.test/handover"


def refused(resource: str) -> str:
    """A pod's status message when the kubelet refuses it for ``resource``: the emulator's words
    (hlplugin.tools.emulator.no_healthy_devices), as the kubelet prefixes them."""
    return f"Pod was rejected: {no_healthy_devices(resource)}"


class Bare(BarePlugin):
    """BarePlugin registering ``BARE`` (or ``resource``) with the real kubelet."""

    def __init__(self, plugin_dir: Path, name: str = "bare.sock", health: str = "Healthy",
                 resource: str = BARE) -> None:
        super().__init__(plugin_dir, name, health)
        self.resource = resource

    async def serve_and_register(self) -> None:
        self.socket.unlink(missing_ok=True)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet}") as channel:
            await pb_grpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                version="v1beta1", endpoint=self.socket.name, resource_name=self.resource), timeout=10)


@asynccontextmanager
async def bare(plugin_dir: Path, name: str = "bare.sock", health: str = "Healthy",
               resource: str = BARE) -> AsyncIterator[Bare]:
    plugin = Bare(plugin_dir, name, health, resource)
    try:
        yield plugin
    finally:
        await plugin.server.stop(None)


def plugin_dir(cluster: Cluster) -> Path:
    return cluster.run / "kubelet" / "device-plugins"


def bound_pod(name: str, resource: str = BARE) -> dict[str, Any]:
    """A pod bound to the node (no scheduler: the kubelet's admission alone decides)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": NODE, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                                     "resources": {"limits": {resource: "1"}}}]}}


def klog_time(line: str, near: float) -> float:
    """A klog line's time (UTC, time of day only) as epoch seconds, on the day of ``near``."""
    midnight = near - near % 86400
    hours, minutes, rest = line.split()[1].split(":")
    return midnight + int(hours) * 3600 + int(minutes) * 60 + float(rest)


def kubelet_says(cluster: Cluster, resource: str = BARE) -> str:
    """The kubelet's log lines about ``resource``: what a failed wait shows."""
    return "\n".join(line for line in cluster.log("kubelet").splitlines() if resource in line)[-4000:]


async def until(cluster: Cluster, predicate: Any, what: str, resource: str, timeout: float = 30) -> None:
    """harness.wait_until; a timeout fails with the kubelet's log about ``resource``."""
    try:
        await wait_until(predicate, timeout, what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{kubelet_says(cluster, resource)}") from None


async def run(func: Any, *args: Any, **kw: Any) -> Any:
    """A blocking cluster call off the event loop, which serves the plugin's gRPC meanwhile."""
    return await asyncio.to_thread(func, *args, **kw)


async def phase(cluster: Cluster, name: str) -> dict[str, Any]:
    async def decided() -> bool:
        status = (await run(cluster.get, "pod", name, "-n", "default"))["status"]
        return status.get("phase") in ("Running", "Failed")

    await wait_until(decided, 60, f"pod {name} admitted or refused", step=0.2)
    status: dict[str, Any] = (await run(cluster.get, "pod", name, "-n", "default"))["status"]
    return status


async def delete(cluster: Cluster, *names: str) -> None:
    await run(cluster.kubectl, "delete", "pod", "-n", "default", "--wait=false", "--ignore-not-found", *names)


async def test_a_resource_without_healthy_devices_fails_admission_without_allocate(cluster: Cluster) -> None:
    """tests/test_emulator.py's test of the same name: the kubelet refuses the pod, with the
    emulator's words, and never calls Allocate."""
    async with bare(plugin_dir(cluster), health="Unhealthy") as plugin:
        await plugin.serve_and_register()
        await wait_until(lambda: plugin.streams == 1, 30, "the kubelet's ListAndWatch")
        try:
            await run(cluster.apply, bound_pod("unhealthy-bare"))
            status = await phase(cluster, "unhealthy-bare")
            assert status["phase"] == "Failed" and status["reason"] == "UnexpectedAdmissionError", status
            assert status["message"] == refused(BARE)
            assert plugin.allocations == 0, "the kubelet called Allocate with nothing healthy"
        finally:
            await delete(cluster, "unhealthy-bare")


def plant(directory: Path) -> dict[str, Path]:
    """tests/test_emulator.py's plant, with names of this test's own (the directory is shared)."""
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(directory / "hlcluster-other-vendor.sock"))
    other.close()
    (directory / "HLCLUSTER-NOTE").write_text("x")
    (directory / "hlcluster-subdir").mkdir(exist_ok=True)
    return {"file": directory / "HLCLUSTER-NOTE", "dir": directory / "hlcluster-subdir",
            "checkpoint": directory / CHECKPOINT, "foreign": directory / "hlcluster-other-vendor.sock"}


@pytest.fixture
def kubelet_restored(cluster: Cluster) -> Iterator[None]:
    """Whatever the test did, the kubelet runs after it (the other tests need it)."""
    yield
    if "kubelet" not in cluster.status()["running"]:
        cluster.command("start kubelet")


async def test_restart_streams_end_the_dead_socket_stays_then_every_socket_is_deleted(
        cluster: Cluster, kubelet_restored: None) -> None:
    """tests/test_emulator.py's test of the same name: the kubelet exits (our stream ends while
    every socket is on disk, kubelet.sock stays, dead), the new one deletes every socket but keeps
    files, directories and its checkpoint, and serves a new kubelet.sock; the resource has no
    device until its plugin registers again (a pod is refused in the emulator's words), then it
    is served. Leaves the chart's plugins re-registered as they do after any kubelet restart."""
    directory = plugin_dir(cluster)

    async def has_device() -> bool:
        allocatable: dict[str, str] = await run(cluster.allocatable)
        return allocatable.get(RESTART, "0") != "0"

    async def no_device() -> bool:
        return not await has_device()

    async with bare(directory, resource=RESTART) as plugin:
        await plugin.serve_and_register()
        await wait_until(lambda: plugin.streams == 1, 30, "the kubelet's ListAndWatch")
        planted = plant(directory)
        old = socket_identity(plugin.kubelet)
        assert planted["checkpoint"].is_file(), "the kubelet checkpoints allocations"
        await wait_until(has_device, 60, f"node status: {RESTART} with its device", step=0.2)
        await run(cluster.command, "stop kubelet")
        await wait_until(lambda: bool(plugin.ended), 30, "the stream to end")
        assert plugin.ended[0][1], "the stream ended only after our socket was deleted"
        assert socket_identity(plugin.kubelet) == old and not listens(plugin.kubelet)
        assert plugin.socket.exists() and planted["foreign"].exists()
        probe = socket.socket(socket.AF_UNIX)
        with probe, pytest.raises(ConnectionRefusedError):
            probe.connect(str(plugin.kubelet))
        await run(cluster.command, "start kubelet")
        await wait_until(lambda: listens(plugin.kubelet)
                         and socket_identity(plugin.kubelet) not in (None, old), 60, "a new kubelet.sock")
        await wait_until(lambda: not plugin.socket.exists(), 30, "our socket deleted by the new kubelet")
        assert not planted["foreign"].exists()
        assert all(planted[k].exists() for k in ("file", "dir", "checkpoint"))
        planted["file"].unlink()
        planted["dir"].rmdir()
        # A pod that reached the new kubelet in its first batch of pods, before the kubelet had put
        # its device manager's state into node status, was admitted (2 CI runs of 3): so apply it
        # once the node says the resource has no device, as it does until the plugin is back.
        await wait_until(no_device, 60, f"node status: {RESTART} with no device", step=0.2)
        try:
            await run(cluster.apply, bound_pod("restart-unregistered", RESTART))
            status = await phase(cluster, "restart-unregistered")
            assert status["phase"] == "Failed" and status["message"] == refused(RESTART), status
        finally:
            await delete(cluster, "restart-unregistered")
    async with bare(directory, resource=RESTART) as again:
        await again.serve_and_register()
        await wait_until(lambda: again.streams == 1, 30, "served again after registering again")
        try:
            await run(cluster.apply, bound_pod("restart-registered", RESTART))
            assert (await phase(cluster, "restart-registered"))["phase"] == "Running"
            assert again.allocations == 1
        finally:
            await delete(cluster, "restart-registered")


async def test_a_plugin_whose_stream_ended_fails_admission_at_once(cluster: Cluster) -> None:
    """The emulator's rule for a plugin disconnect: the kubelet marks the resource unhealthy the
    moment the stream ends, so a pod admitted then is refused without Allocate, in the emulator's
    words, while one admitted before got its device."""
    async with bare(plugin_dir(cluster), "disconnect.sock", resource=DISCONNECT) as plugin:
        await plugin.serve_and_register()
        await wait_until(lambda: plugin.streams == 1, 30, "the kubelet's ListAndWatch")
        try:
            await run(cluster.apply, bound_pod("before-disconnect", DISCONNECT))
            assert (await phase(cluster, "before-disconnect"))["phase"] == "Running"
            assert plugin.allocations == 1
            await plugin.server.stop(None)
            await wait_until(lambda: bool(plugin.ended), 30, "the stream ended")
            await run(cluster.apply, bound_pod("after-disconnect", DISCONNECT))
            status = await phase(cluster, "after-disconnect")
            assert status["phase"] == "Failed" and status["message"] == refused(DISCONNECT), status
            assert plugin.allocations == 1, "the kubelet called Allocate on a disconnected plugin"
        finally:
            await delete(cluster, "before-disconnect", "after-disconnect")


async def test_a_second_instance_registered_before_the_first_ends_is_disconnected_with_it(
        cluster: Cluster) -> None:
    """The kubelet keeps one client per resource name, and when a client's run ends it
    disconnects whichever client holds the name then (handler.go runClient): a second instance
    that registers the same resource on its own socket before the first's stream ended loses
    its stream when the first goes (real-cluster.md; the emulator must do the same)."""
    directory = plugin_dir(cluster)
    see = functools.partial(until, cluster, resource=FIRST_ENDS_LATE)
    async with bare(directory, "late-a.sock", resource=FIRST_ENDS_LATE) as first, \
            bare(directory, "late-b.sock", resource=FIRST_ENDS_LATE) as second:
        await first.serve_and_register()
        await see(lambda: first.streams == 1, "the first instance's ListAndWatch")
        await second.serve_and_register()
        await see(lambda: second.streams == 1, "the second instance's ListAndWatch")
        await first.server.stop(None)
        await see(lambda: bool(first.ended), "the first stream ended")
        await see(lambda: bool(second.ended), "the second instance disconnected with the first")
        assert second.streams == 0


async def test_an_instance_registered_after_the_first_stream_ended_is_served(cluster: Cluster) -> None:
    """The order that survives: the first instance's stream ends, the kubelet has processed that
    (its log says the plugin disconnected), then the second registers and keeps its stream; a
    pod bound to the node gets its device from the second. Seeing the stream end on the plugin's
    side is not enough: a second registration 1 ms before the kubelet's own end of the first's
    run was deregistered with it, and its Register failed ("failed to get device plugin options
    ... the client connection is closing"), seen here once in five runs."""
    directory = plugin_dir(cluster)
    see = functools.partial(until, cluster, resource=FIRST_ENDS_FIRST)
    offset = len(cluster.log("kubelet"))
    disconnected = f'"Device plugin disconnected" resource="{FIRST_ENDS_FIRST}"'
    async with bare(directory, "handover-a.sock", resource=FIRST_ENDS_FIRST) as first, \
            bare(directory, "handover-b.sock", resource=FIRST_ENDS_FIRST) as second:
        await first.serve_and_register()
        await see(lambda: first.streams == 1, "the first instance's ListAndWatch")
        await first.server.stop(None)
        await see(lambda: bool(first.ended), "the first stream ended")
        # When the plugin saw its stream end, on the wall clock the kubelet's log uses.
        seen = time.time() - (asyncio.get_running_loop().time() - first.ended[0][0])
        await see(lambda: disconnected in cluster.log("kubelet")[offset:], "the kubelet's end of the first")
        line = next(x for x in cluster.log("kubelet")[offset:].splitlines() if disconnected in x)
        print(f"the kubelet logged the first's disconnect {(klog_time(line, seen) - seen) * 1000:+.1f} ms "
              "after the plugin saw its stream end")
        await second.serve_and_register()
        await see(lambda: second.streams == 1, "the second instance's ListAndWatch")
        try:
            await run(cluster.apply, bound_pod("after-handover", FIRST_ENDS_FIRST))
            status = await phase(cluster, "after-handover")
            assert status["phase"] == "Running", status
            assert second.allocations == 1 and first.allocations == 0
            assert second.streams == 1 and not second.ended
        finally:
            await delete(cluster, "after-handover")
