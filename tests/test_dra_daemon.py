"""`hlplugin dra` as a process, against the fake kubelet plugin watcher: the main daemon's proofs
gate its Prepare (a device that fails its check is refused, naming why), /readyz says how it
stands with the kubelet and its checkpoint (and lists the CDI directory's exposure as serve's
does), the CDI device it answers is declared by the node's one spec, two drivers of a surge hand
that spec over once, at the new one's registration, and SIGTERM removes its sockets and nothing
else."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from frameguard_server import flood
from harness import daemon, needs_kvm, proc_status, scrape, short_dir, value, wait_until
from support.pluginwatcher import FakePluginWatcher
from support.waits import quiet, quiet_blocking

from hlplugin import config
from hlplugin.api import dra_health_v1alpha1_pb2 as health_pb
from hlplugin.cdi_spec import SPEC_FILE
from hlplugin.deviceplugin.kubelet.dra.checkpoint import InstanceLock
from hlplugin.deviceplugin.ownedfile import temp_prefix
from hlplugin.dra.claims import CHECKPOINT_FILE, LOCK_FILE
from hlplugin.names import CDI_WRITER_FILE, DRA_DRIVER, dra_socket_names
from hlplugin.tools.process import DaemonProcess

UID = "5b8e0c6a-1f2d-4e3b-8a9c-0d1e2f3a4b5c"
CLAIM = ("team-a", "claim-uid-1", "vm-claim")


class Node:
    def __init__(self, dev_dir: Path | None = None) -> None:
        root = short_dir()
        self.registry = root / "plugins_registry"
        self.plugin_dir = root / "plugins" / DRA_DRIVER
        self.cdi_dir = root / "cdi"
        self.dev_dir = dev_dir or root / "dev"
        for directory in (self.registry, self.cdi_dir, root / "dev"):
            directory.mkdir()

    def args(self, uid: str = UID) -> list[str]:
        return ["dra", "--registry-dir", str(self.registry), "--dra-dir", str(self.plugin_dir),
                "--pod-uid", uid, "--node-name", "node-a", "--cdi-dir", str(self.cdi_dir),
                "--dev-dir", str(self.dev_dir), "--host-dev-dir", "", "--hypervisor", "kvm"]

    def owner(self) -> int | None:
        """The uid the CDI spec gives the device node in containers (None: no spec, or torn:
        never, since every write is an atomic rename)."""
        try:
            spec = json.loads((self.cdi_dir / SPEC_FILE).read_bytes())
        except FileNotFoundError:
            return None
        (device,) = spec["devices"]
        (node,) = device["containerEdits"]["deviceNodes"]
        return int(node["uid"])


async def registered(watcher: FakePluginWatcher, count: int = 1) -> None:
    async def done() -> bool:
        await watcher.sync()
        return len(watcher.plugins) >= count

    await wait_until(done, 30, f"the plugin watcher registered {count} driver instance(s)")


def readiness(body: bytes) -> dict[str, tuple[bool, str]]:
    return {name: (c["ok"], c["reason"]) for name, c in json.loads(body)["conditions"].items()}


async def test_a_device_that_fails_its_check_refuses_prepare_naming_why() -> None:
    node = Node()  # --hypervisor kvm, and no kvm node under --dev-dir: the device check fails
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True) as proc:
        await registered(watcher)
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        error = response.claims[CLAIM[1]].error
        assert "hyperlight.dev: the hypervisor device is not usable on this node" in error
        assert "device" in error and not response.claims[CLAIM[1]].devices
        conditions = readiness(await proc.wait_http("/readyz", 503))
        assert conditions["registered"] == (True, "")
        assert conditions["checkpoint"] == (True, "")
        assert not conditions["device"][0]
        assert sorted(os.listdir(node.cdi_dir)) == ["hyperlight.json"]  # the spec is kept anyway
        stream = watcher.watch_health(DRA_DRIVER)
        async with contextlib.aclosing(stream):
            (device,) = (await anext(stream)).devices  # what the kubelet shows in pod status
        assert (device.device.pool_name, device.device.device_name) == ("node-a", "kvm")
        assert device.health == health_pb.HealthStatus.UNHEALTHY and "device: " in device.message
        code, metrics = await proc.http("/metrics")
        assert code == 200
        assert b'hyperlight_dra_prepares_total{result="refused"} 1.0' in metrics
    assert proc.exited() == 0
    assert os.listdir(node.registry) == []
    # Its socket gone; no claim recorded, so no checkpoint (the instances' lock files stay).
    assert sorted(os.listdir(node.plugin_dir)) == [CDI_WRITER_FILE, LOCK_FILE]
    assert os.listdir(node.cdi_dir) == ["hyperlight.json"]  # stays, for running containers


async def test_a_continuation_flood_on_either_socket_is_cut_off_and_the_driver_keeps_serving() -> None:
    """Issue 40 item 1 for the DRA driver: the CONTINUATION flood (tests/frameguard_server.py) on
    its service socket and on its registration socket, each behind the frame guard endpoint.py
    puts in front of every gRPC server of ours with --frame-guard true: every flooding connection
    is closed, the driver's peak memory stays within 8 MiB, a Prepare during each flood is
    answered within 2 s, and the driver stays registered (its registration socket the same one)."""
    node = Node()  # no kvm node under --dev-dir: Prepare is refused, naming why, and answered
    watcher = FakePluginWatcher(node.registry)
    async with daemon([*node.args(), "--frame-guard", "true"], graceful=True) as proc:
        await registered(watcher)
        plugin = watcher.newest(DRA_DRIVER)
        for _ in range(20):  # warm: calls served before the peak is taken
            await watcher.prepare(DRA_DRIVER, CLAIM)
        await quiet(1.0, "the driver's start-up settles")
        idle = proc_status(proc.pid)["VmHWM"]
        results = []
        for path in (Path(plugin.info.endpoint), plugin.socket):
            flooding = asyncio.create_task(flood(path, 4, 64 << 20, seconds=1.5))
            await asyncio.sleep(0.2)
            began = time.monotonic()
            await watcher.prepare(DRA_DRIVER, CLAIM)
            answered = time.monotonic() - began
            results.append((path.name, await flooding, answered))
        await asyncio.sleep(0.3)  # what the driver still had to read
        peak = proc_status(proc.pid)["VmHWM"]
        await watcher.sync()
        assert watcher.newest(DRA_DRIVER).identity == plugin.identity
        assert json.loads(await proc.wait_http("/healthz", 200))["status"] == "ok"
    print(f"dra: +{(peak - idle) / 1024:.1f} MiB; " + "; ".join(
        f"{name}: {r.sent / 2**20:.0f} MiB sent, {r.closed} of {r.opened} closed, Prepare "
        f"answered in {answered * 1000:.0f} ms" for name, r, answered in results))
    for _, result, answered in results:
        assert result.closed >= 4 and answered < 2.0, (result, answered)
    assert peak - idle <= 8 * 1024, f"peak memory grew by {(peak - idle) / 1024:.1f} MiB"


@pytest.mark.slow  # the passing check stands 9 s (HttpSettings.self_check_fresh_for)
async def test_healthz_fails_when_the_dra_service_stops_answering_on_its_socket() -> None:
    """The self-check is a call to the DRA service: with something mute at its socket (the
    kubelet could not reach the driver either), /healthz fails and the kubelet restarts it."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True) as proc:
        await registered(watcher)
        endpoint = watcher.newest(DRA_DRIVER).info.endpoint
        assert json.loads(await proc.wait_http("/healthz", 200))["status"] == "ok"
        # The first probe answered from no check yet and started one, which /healthz does not
        # show ending: a bounded window for it, then its verdict (a call that was answered).
        await quiet(1.0, "the self-check the first probe started ends")
        assert json.loads(await proc.wait_http("/healthz", 200))["status"] == "ok"
        os.unlink(endpoint)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
            mute.bind(endpoint)
            mute.listen(8)
            body = json.loads(await proc.wait_http("/healthz", 503, timeout=40))
            assert body["reason"] == "the gRPC server did not answer on its socket"


@needs_kvm
async def test_prepare_answers_the_cdi_device_the_nodes_one_spec_declares() -> None:
    node = Node(dev_dir=Path("/dev"))
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True) as proc:
        await registered(watcher)
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        entry = response.claims[CLAIM[1]]
        assert not entry.error, entry.error
        ((device,),) = [entry.devices]
        assert (device.pool_name, device.device_name) == ("node-a", "kvm")
        assert list(device.cdi_device_ids) == ["hyperlight.dev/hypervisor=kvm"]
        declared = [f"{spec['kind']}={d['name']}" for name in os.listdir(node.cdi_dir)
                    for spec in [json.loads((node.cdi_dir / name).read_bytes())]
                    for d in spec["devices"]]
        assert declared == ["hyperlight.dev/hypervisor=kvm"]  # one spec declares it, once
        conditions = readiness(await proc.wait_http("/readyz", 200))
        # /healthz asks the DRA service itself (an Unprepare of no claims): it answers.

        async def live() -> bool:
            code, body = await proc.http("/healthz")
            return code == 200 and json.loads(body)["status"] == "ok"

        await wait_until(live, 30, "/healthz after a self-check of the DRA service")
        assert {"registered", "checkpoint", "cdi", "device"} <= set(conditions)
        assert CLAIM[1] in json.loads((node.plugin_dir / CHECKPOINT_FILE).read_bytes())["entries"]
    assert sorted(os.listdir(node.plugin_dir)) == [CDI_WRITER_FILE, CHECKPOINT_FILE, LOCK_FILE]


async def test_a_start_removes_the_checkpoints_temp_files_only_under_the_instance_lock() -> None:
    """A temp file beside the record is a crashed write's leftover only when no other instance
    holds the lock: in a surge it is the other instance's write in flight, and removing it failed
    that write's rename and its Prepare (the real cluster's DRA upgrade test). Held by "another
    instance" (this test) through the start, it stays; at a start with the lock free, it goes."""
    node = Node(dev_dir=Path("/dev"))
    node.plugin_dir.mkdir(parents=True)
    in_flight = node.plugin_dir / f"{temp_prefix(CHECKPOINT_FILE)}0123456789abcdef"
    in_flight.write_bytes(b"{")
    fd = InstanceLock(node.plugin_dir, LOCK_FILE).try_acquire()
    assert fd is not None
    try:
        watcher = FakePluginWatcher(node.registry)
        async with daemon(node.args(), graceful=True):
            await registered(watcher)  # after start(), which waited the lock's budget out
            assert in_flight.exists()
    finally:
        os.close(fd)
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True):
        await registered(watcher)
        assert not in_flight.exists()


@needs_kvm
async def test_readyz_lists_the_cdi_directorys_exposure_as_the_main_daemons_does() -> None:
    """The driver keeps the main daemon's CDI spec, so it says what serve says of its directory
    (tests/test_cdi_exposure.py): a note in every /readyz answer, not a failure, and the gauge."""
    node = Node(dev_dir=Path("/dev"))
    os.chmod(node.cdi_dir.parent, 0o755)
    os.chmod(node.cdi_dir, 0o777)
    directory = {"directory": str(node.cdi_dir)}
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True) as proc:
        await registered(watcher)
        ready = json.loads(await proc.wait_http("/readyz", 200))  # a note, not a failure
        [warning] = ready["warnings"]
        assert "writable by group and others (mode 0777)" in warning
        assert warning in proc.messages()
        assert value(await scrape(proc), "hyperlight_cdi_dir_exposed", **directory) == 1
        os.chmod(node.cdi_dir, 0o755)  # fixed: inotify sees the change, the next pass says so

        async def cleared() -> bool:
            return json.loads((await proc.get("/readyz"))[1])["warnings"] == []

        await wait_until(cleared, what="the warning gone from /readyz")
        assert value(await scrape(proc), "hyperlight_cdi_dir_exposed", **directory) == 0
        assert f"{node.cdi_dir} is no longer exposed to others than root" in proc.messages()


async def test_a_corrupt_checkpoint_is_said_in_readyz_and_the_log_and_left_alone() -> None:
    node = Node()
    node.plugin_dir.mkdir(parents=True)
    checkpoint = node.plugin_dir / CHECKPOINT_FILE
    checkpoint.write_bytes(b"\0" * 64)  # a torn write of the kind a crashed filesystem leaves
    watcher = FakePluginWatcher(node.registry)
    async with daemon(node.args(), graceful=True) as proc:
        await registered(watcher)  # it still serves, and tells the kubelet why per claim
        ok, reason = readiness(await proc.wait_http("/readyz", 503))["checkpoint"]
        assert not ok and str(checkpoint) in reason and "is not JSON" in reason
        errors = [line["message"] for line in proc.lines if line.get("levelname") == "ERROR"
                  or line.get("level") == "error"]
        assert any("refusing the checkpoint of prepared claims" in m for m in errors), proc.raw
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        assert "refusing to prepare" in response.claims[CLAIM[1]].error
    assert checkpoint.read_bytes() == b"\0" * 64


class Owners:
    """Every owner the CDI spec names, in order, sampled in a thread of its own (every
    millisecond, so a write that lasts longer is seen) for as long as the block runs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.seen: list[int | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cdi-owners", daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            owner = self.node.owner()
            if not self.seen or self.seen[-1] != owner:
                self.seen.append(owner)
            quiet_blocking(0.001, "the sampler's pace")

    def __enter__(self) -> Owners:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


async def repairs(proc: DaemonProcess) -> dict[str, float]:
    samples = await scrape(proc)
    return {cause: count for cause in ("missing", "malformed", "stale", "metadata")
            if (count := value(samples, "hyperlight_cdi_repairs_total", cause=cause))}


async def owned_by(node: Node, uid: int, what: str) -> None:
    await wait_until(lambda: node.owner() == uid, 30, what)


OLD, NEW = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
FAST = ["--cdi-interval", "1s"]  # a pass every second beside those inotify wakes: a fight shows


async def test_two_drivers_of_different_device_uids_hand_the_cdi_spec_over_once_at_registration(
        ) -> None:
    """A surge that changes deviceUid (issue 38 item 2): the old and the new pod both run, and
    only one writes the spec at any moment. The old one keeps its spec while the new one is not
    yet registered (it only looks); the kubelet's registration of the new one hands the spec over
    (the kubelet calls the newest), and the old one never writes it back, also once it goes."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with daemon([*node.args(OLD), *FAST, "--device-uid", "1000"], graceful=True) as old:
        await registered(watcher)
        await owned_by(node, 1000, "the old driver's spec, written once the kubelet registered it")
        with Owners(node) as owners:
            async with daemon([*node.args(NEW), *FAST, "--device-uid", "2000"],
                              graceful=True) as new:
                published = node.registry / dra_socket_names(NEW)[0]
                await wait_until(published.exists, 30,
                                 "the new driver serving, its registration socket published")
                await quiet(3.0, "the new driver's passes while not registered: it writes none")
                assert owners.seen == [1000]
                await registered(watcher, 2)  # the kubelet calls the new one from now on
                await owned_by(node, 2000, "the new driver's spec once the kubelet registered it")
                await quiet(3.0, "both drivers' passes: the old one must not write its spec back")
                assert await repairs(old) == {"missing": 1}
                assert await repairs(new) == {"stale": 1}  # the one hand-over
                assert old.exited() is None
                await old.stop()  # the surge's end: the old pod goes
                await quiet(2.0, "the new driver's passes once the old one is gone")
                assert node.owner() == 2000
        assert owners.seen == [1000, 2000], owners.seen
        assert (node.plugin_dir / CDI_WRITER_FILE).read_text() == f"dra-{NEW}.sock\n"


async def test_a_writer_that_dies_is_taken_over_by_the_driver_still_serving() -> None:
    """The new driver is SIGKILLed after it took the spec over (nothing of it runs to hand back):
    the old one, still serving, sees that nobody answers on the writer's socket and writes its
    own spec again, so the node's spec is kept by a live driver."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with daemon([*node.args(OLD), *FAST, "--device-uid", "1000"], graceful=True) as old:
        await registered(watcher)
        await owned_by(node, 1000, "the old driver's spec")
        async with daemon([*node.args(NEW), *FAST, "--device-uid", "2000"]) as new:
            await registered(watcher, 2)
            await owned_by(node, 2000, "the new driver's spec once the kubelet registered it")
            await new.signal(signal.SIGKILL)
        await owned_by(node, 1000, "the old driver's spec again, the writer being dead")
        assert (node.plugin_dir / CDI_WRITER_FILE).read_text() == f"dra-{OLD}.sock\n"
        assert await repairs(old) == {"missing": 1, "stale": 1}


def test_a_registry_dir_too_long_for_its_socket_exits_2_naming_the_flag(tmp_path: Path) -> None:
    long_dir = "/tmp/" + "d" * 80
    result = subprocess.run(
        [sys.executable, "-m", "hlplugin", "dra", "--registry-dir", long_dir, "--pod-uid", UID,
         "--dra-dir", str(tmp_path), "--cdi-dir", str(tmp_path), "--http-address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "argument --registry-dir (or HYPERLIGHT_REGISTRY_DIR): " in result.stderr
    assert "too long for a unix socket path" in result.stderr


@pytest.mark.parametrize(("variable", "value"), [
    ("HYPERLIGHT_POD_UID", "../../etc"), ("HYPERLIGHT_NODE_NAME", "Node_A")])
def test_an_invalid_pod_uid_or_node_name_from_the_environment_falls_back_with_a_warning(
        variable: str, value: str) -> None:
    no_flags = argparse.Namespace()
    resolution = config.resolve_sources(no_flags, config.DRA_OPTIONS, "dra", {variable: value})
    assert resolution.settings.dra.pod_uid == "" and resolution.settings.dra.node_name == ""
    (warning,) = [w for w in resolution.warnings if variable in w]
    assert "using the default ''" in warning
