"""`hlplugin bootstrap` as a real process against the kubelet emulator, and with the main plugin."""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import HAVE_KVM, Daemon, Node, daemon, needs_kvm, needs_root, on_kubelet, wait_until

from hlplugin.emulator import AdmissionError, KubeletEmulator

ACCESS = "hyperlight.dev/device-access"
HYPERVISOR = "hyperlight.dev/hypervisor"


def bootstrap_args(node: Node, dev_dir: Path, *extra: str) -> list[str]:
    return ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(dev_dir), *extra]


def readyz(proc: Daemon) -> dict[str, Any]:
    """/readyz's body, whatever its status (a check from a synchronous predicate)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/readyz", timeout=5) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as refused:
        return dict(json.loads(refused.read()))


def make_dev_dir(root: Path) -> Path:
    """A host /dev view holding a char node with the real /dev/kvm's numbers (root only)."""
    dev = root / "host-dev"
    dev.mkdir()
    rdev = os.stat("/dev/kvm").st_rdev if HAVE_KVM else os.makedev(10, 232)
    os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, rdev)
    return dev


@needs_root
async def test_registers_one_slot_grants_exactly_the_device_and_re_registers(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    dev = make_dev_dir(tmp_path)
    async with on_kubelet(node, bootstrap_args(node, dev)) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1)
        resource = kubelet.resources[ACCESS]
        assert resource.endpoint == "hyperlight-device-access.sock"
        assert list(resource.devices) == ["device-access-kvm"]
        response = await kubelet.admit(ACCESS)
        (entry,) = response.container_responses
        assert [(d.container_path, d.host_path, d.permissions) for d in entry.devices] == [
            ("/dev/kvm", "/dev/kvm", "rw")]
        assert not entry.mounts and not entry.envs and not entry.annotations
        assert not entry.cdi_devices
        two = await kubelet.allocate(ACCESS, [["device-access-kvm"], ["device-access-kvm"]])
        assert len(two.container_responses) == 2
        assert all(len(c.devices) == 1 for c in two.container_responses)
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(ACCESS, [["kvm-0"]])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        await proc.wait_http("/readyz", 200)
        for _ in range(2):  # a kubelet restart: registered again, and grants again
            await kubelet.restart()
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1, timeout=10)
            await kubelet.admit(ACCESS)


@needs_root
async def test_missing_device_refuses_and_recovers_without_restart(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    dev = make_dev_dir(tmp_path)
    rdev = os.stat(dev / "kvm").st_rdev
    async with on_kubelet(node, bootstrap_args(node, dev, "--hypervisor", "kvm")) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1)
        os.unlink(dev / "kvm")
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 0, timeout=5)
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(ACCESS, [["device-access-kvm"]])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "kvm" in refused.value.details
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["device"]["ok"] is False
        (dev / "kvm").write_text("a regular file is not a device")
        await proc.wait_http("/readyz", 503)
        with pytest.raises(AdmissionError):
            await kubelet.allocate(ACCESS, [["device-access-kvm"]])
        os.unlink(dev / "kvm")
        os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, rdev)
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1, timeout=5)
        await kubelet.admit(ACCESS)
        await proc.wait_http("/readyz", 200)


@needs_kvm
@needs_root
async def test_both_daemons_on_one_kubelet(tmp_path: Path) -> None:
    """The main plugin's pod gets its device from the bootstrap: the emulator allocates
    device-access first, then starts the main plugin with the device the DeviceSpec names."""

    node = Node.make(tmp_path)
    host_dev = make_dev_dir(tmp_path)
    kubelet = KubeletEmulator(node.plugin_dir)
    await kubelet.start()
    boot = await Daemon(bootstrap_args(node, host_dev)).start()
    main: Daemon | None = None
    try:
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1)
        granted = await kubelet.admit(ACCESS)
        (spec,) = granted.container_responses[0].devices
        # The "container" of the main plugin: a /dev holding exactly the granted node, which
        # the runtime would create from host_path. Here: the real host node at that path.
        container_dev = tmp_path / "container-dev"
        container_dev.mkdir()
        host_node = os.stat(spec.host_path)
        assert stat.S_ISCHR(host_node.st_mode)
        name = Path(spec.container_path).name
        os.mknod(container_dev / name, stat.S_IFCHR | 0o660, host_node.st_rdev)
        main = await Daemon(["serve", "--plugin-dir", str(node.plugin_dir),
                             "--cdi-dir", str(node.cdi_dir), "--dev-dir", str(container_dev),
                             "--host-dev-dir", str(host_dev), "--device-count", "4"]).start()
        await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR) == 4, timeout=15)
        await main.wait_http("/readyz", 200)
        await boot.wait_http("/readyz", 200)
        response = await kubelet.admit(HYPERVISOR)
        assert [d.name for d in response.container_responses[0].cdi_devices] == [
            f"{HYPERVISOR}={name}"]
    finally:
        if main is not None:
            await main.stop()
        await boot.stop()
        await kubelet.stop()


async def test_auto_without_a_device_says_what_it_looks_for_and_where(tmp_path: Path) -> None:
    """--hypervisor auto (what the manifests deploy) on a node with neither node: /readyz names
    the search, as the main daemon's ``hypervisor`` condition does, and drops it once one appears."""

    node = Node.make(tmp_path)
    dev = tmp_path / "empty-dev"
    dev.mkdir()
    async with daemon(bootstrap_args(node, dev, "--hypervisor", "auto")) as proc:
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["hypervisor"] == {
            "ok": False, "reason": f"no mshv or kvm device under {dev}"}
        (dev / "kvm").write_text("not a device")  # found by name; then checked as a node
        await wait_until(lambda: "hypervisor device" in " ".join(proc.messages()))
        want = {"ok": False, "reason": f"{dev / 'kvm'} is not a character device"}
        # The readiness this answers is set just after that log line.
        await wait_until(lambda: readyz(proc)["conditions"]["device"] == want)
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["device"] == want
        assert "hypervisor" not in ready["conditions"]
