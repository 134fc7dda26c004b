"""`hlplugin bootstrap` as a real process against the kubelet emulator, and with the main plugin."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import grpc
import pytest
from harness import HAVE_KVM, Node, daemon, needs_kvm, needs_root, on_kubelet, scrape, value, wait_metric

from hlplugin import __version__
from hlplugin.emulator import AdmissionError

ACCESS = "hyperlight.dev/device-access"
HYPERVISOR = "hyperlight.dev/hypervisor"


def bootstrap_args(node: Node, dev_dir: Path, *extra: str) -> list[str]:
    return ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(dev_dir), *extra]


def make_dev_dir(root: Path) -> Path:
    """A host /dev view holding a char node with the real /dev/kvm's numbers (root only)."""
    dev = root / "host-dev"
    dev.mkdir()
    rdev = os.stat("/dev/kvm").st_rdev if HAVE_KVM else os.makedev(10, 232)
    os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, rdev)
    return dev


@needs_root
async def test_grants_exactly_the_device_refuses_without_it_and_every_family_moves(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    dev = make_dev_dir(tmp_path)
    rdev = os.stat(dev / "kvm").st_rdev
    async with on_kubelet(node, bootstrap_args(node, dev)) as (kubelet, proc):
        # One slot, registered; every family says so.
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1)
        resource = kubelet.resources[ACCESS]
        assert resource.endpoint == "hyperlight-device-access.sock"
        assert list(resource.devices) == ["device-access-kvm"]
        ready = json.loads(await proc.wait_http("/readyz", 200))
        assert ready == {"status": "ready", "conditions": {name: {"ok": True, "reason": ""} for name in (
            "registered", "listandwatch", "device")}}
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_listandwatch_streams") == 1)
        first = {key for key in m if key[0].startswith("hyperlight_")}
        assert value(m, "hyperlight_build_info", version=__version__) == 1
        assert value(m, "hyperlight_registrations_total", result="success") == 1
        assert value(m, "hyperlight_devices_advertised") == 1
        assert value(m, "hyperlight_devices_healthy") == 1
        assert value(m, "hyperlight_health_condition", condition="device") == 1

        # It grants exactly the device, and refuses an ID it does not advertise.
        response = await kubelet.admit(ACCESS)
        (entry,) = response.container_responses
        assert [(d.container_path, d.host_path, d.permissions) for d in entry.devices] == [
            ("/dev/kvm", "/dev/kvm", "rw")]
        assert not entry.mounts and not entry.envs and not entry.annotations
        assert not entry.cdi_devices
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(ACCESS, [["kvm-0"]])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

        # The device goes: the slot is withdrawn and Allocate refused with the reason.
        os.unlink(dev / "kvm")
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 0, timeout=5)
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_devices_healthy") == 0)
        assert value(m, "hyperlight_health_condition", condition="device") == 0
        assert value(m, "hyperlight_health_transitions_total", to="unhealthy") == 1
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(ACCESS, [["device-access-kvm"]])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "kvm" in refused.value.details
        m = await scrape(proc)
        for result in ("success", "invalid", "refused"):
            assert value(m, "hyperlight_allocations_total", result=result) == 1, result
        assert {key for key in m if key[0].startswith("hyperlight_")} == first
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["device"]["ok"] is False
        (dev / "kvm").write_text("a regular file is not a device")
        await proc.wait_http("/readyz", 503)
        with pytest.raises(AdmissionError):
            await kubelet.allocate(ACCESS, [["device-access-kvm"]])

        # The device comes back: granted again without a restart, to several containers too.
        os.unlink(dev / "kvm")
        os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, rdev)
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1, timeout=5)
        await kubelet.allocate(ACCESS, [["device-access-kvm"]])  # the slot is the admitted pod's
        await proc.wait_http("/readyz", 200)
        two = await kubelet.allocate(ACCESS, [["device-access-kvm"], ["device-access-kvm"]])
        assert len(two.container_responses) == 2
        assert all(len(c.devices) == 1 for c in two.container_responses)
        for _ in range(2):  # a kubelet restart: registered again, and grants again
            await kubelet.restart()
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1, timeout=10)
            await kubelet.admit(ACCESS)


@needs_kvm
@needs_root
async def test_both_daemons_on_one_kubelet(tmp_path: Path) -> None:
    """The main plugin's pod gets its device from the bootstrap: the emulator allocates
    device-access first, then starts the main plugin with the device the DeviceSpec names."""
    node = Node.make(tmp_path)
    host_dev = make_dev_dir(tmp_path)
    async with on_kubelet(node, bootstrap_args(node, host_dev)) as (kubelet, boot):
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
        main_node = Node(node.root, node.plugin_dir, node.cdi_dir, container_dev, host_dev)
        async with daemon(main_node.serve_args("--device-count", "4")) as main:
            await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR) == 4, timeout=15)
            await main.wait_http("/readyz", 200)
            await boot.wait_http("/readyz", 200)
            response = await kubelet.admit(HYPERVISOR)
            assert [d.name for d in response.container_responses[0].cdi_devices] == [
                f"{HYPERVISOR}={name}"]
