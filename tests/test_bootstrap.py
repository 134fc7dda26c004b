"""`hlplugin bootstrap` as a real process against the kubelet emulator."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
from harness import HAVE_KVM, Node, mknod_char, needs_root, on_kubelet, scrape, value, wait_metric

from hlplugin.emulator import AdmissionError

ACCESS = "hyperlight.dev/device-access"


def bootstrap_args(node: Node, dev_dir: Path, *extra: str) -> list[str]:
    return ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(dev_dir), *extra]


def make_dev_dir(root: Path) -> Path:
    """A host /dev view holding a char node with the real /dev/kvm's numbers (root only)."""
    dev = root / "host-dev"
    dev.mkdir()
    mknod_char(dev / "kvm", os.stat("/dev/kvm").st_rdev if HAVE_KVM else os.makedev(10, 232))
    return dev


@needs_root
async def test_grants_exactly_the_device_refuses_without_it_and_every_family_moves(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    dev = make_dev_dir(tmp_path)
    rdev = os.stat(dev / "kvm").st_rdev
    async with on_kubelet(node, bootstrap_args(node, dev)) as (kubelet, proc):
        # One slot, registered; every family says so (build_info, set by Metrics: test_metrics).
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == 1)
        resource = kubelet.resources[ACCESS]
        assert resource.endpoint == "hyperlight-device-access.sock"
        assert list(resource.devices) == ["device-access-kvm"]
        ready = json.loads(await proc.wait_http("/readyz", 200))
        assert ready == {"status": "ready", "conditions": {name: {"ok": True, "reason": ""} for name in (
            "registered", "listandwatch", "device")}}
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_listandwatch_streams") == 1)
        first = {key for key in m if key[0].startswith("hyperlight_")}
        # Only the families it changes: it has no CDI spec and no device prober.
        assert not {name for name, _ in first if name.startswith(("hyperlight_cdi", "hyperlight_probe"))}
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
        # (A regular file there instead: test_http's bootstrap case names it.)

        # The device comes back: granted again without a restart, to several containers too.
        mknod_char(dev / "kvm", rdev)
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
