"""`hlplugin bootstrap` as a real process against the kubelet emulator."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from harness import (
    HAVE_KVM,
    Node,
    daemon,
    mknod_char,
    needs_kvm,
    needs_root,
    on_kubelet,
    scrape,
    value,
    wait_metric,
)

from hlplugin import hvnode
from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.bootstrap import DeviceAccessPlugin, node_watch
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.health.producer import Trigger
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import new_server
from hlplugin.tools.emulator import AdmissionError

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
@needs_kvm  # the bootstrap grants only the node with the kernel's kvm numbers (none without KVM)
async def test_grants_exactly_the_device_refuses_without_it_and_every_family_moves(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    dev = make_dev_dir(tmp_path)
    rdev = os.stat(dev / "kvm").st_rdev
    async with on_kubelet(node, bootstrap_args(node, dev)) as (kubelet, proc):
        # Its slots, registered; every family says so (build_info, set by Metrics: test_metrics).
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS)
        resource = kubelet.resources[ACCESS]
        assert resource.endpoint == "hyperlight-device-access.sock"
        assert list(resource.devices) == ["device-access-kvm", "device-access-kvm-1",
                                         "device-access-kvm-2"]
        ready = json.loads(await proc.wait_http("/readyz", 200))
        assert ready == {"status": "ready", "ignored_settings": [], "warnings": [],
                         "conditions": {name: {"ok": True, "reason": ""} for name in (
            "registered", "listandwatch", "device")}}
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_listandwatch_streams") == 1)
        first = {key for key in m if key[0].startswith("hyperlight_")}
        # Only the families it changes: it has no CDI spec and no device prober.
        assert not {name for name, _ in first if name.startswith(("hyperlight_cdi", "hyperlight_probe"))}
        assert value(m, "hyperlight_registrations_total", result="success") == 1
        assert value(m, "hyperlight_devices_advertised") == ACCESS_SLOTS
        assert value(m, "hyperlight_devices_healthy") == ACCESS_SLOTS
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
        await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS, timeout=5)
        await kubelet.allocate(ACCESS, [["device-access-kvm"]])  # the slot is the admitted pod's
        await proc.wait_http("/readyz", 200)
        two = await kubelet.allocate(ACCESS, [["device-access-kvm"], ["device-access-kvm"]])
        assert len(two.container_responses) == 2
        assert all(len(c.devices) == 1 for c in two.container_responses)
        for _ in range(2):  # a kubelet restart: registered again, and grants again
            await kubelet.restart()
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS, timeout=10)
            await kubelet.admit(ACCESS)


# --- the node must be the hypervisor, not merely a character device --------------------------------

NULL = Path("/dev/null")  # a character device that is not a hypervisor


def fake_sys(root: Path, **numbers: str) -> Path:
    """A sysfs root whose misc class lists ``numbers`` (name -> "MAJOR:MINOR")."""
    sys_dir = root / "sys"
    (sys_dir / "class" / "misc").mkdir(parents=True)
    for name, text in numbers.items():
        (sys_dir / "class" / "misc" / name).mkdir()
        (sys_dir / "class" / "misc" / name / "dev").write_text(text + "\n")
    return sys_dir


def test_the_hypervisor_numbers_come_from_sysfs_else_proc_misc_and_unknown_says_why(
        tmp_path: Path) -> None:
    sys_dir = fake_sys(tmp_path, kvm="10:232", mshv="10:58", broken="ten")
    assert hvnode.misc_numbers("kvm", sys_dir) == os.makedev(10, 232)
    assert hvnode.misc_numbers("mshv", sys_dir) == os.makedev(10, 58)
    with pytest.raises(LookupError, match="holds 'ten', not MAJOR:MINOR"):
        hvnode.misc_numbers("broken", sys_dir)
    with pytest.raises(LookupError, match="the kernel has no misc device gone"):
        hvnode.misc_numbers("gone", sys_dir)
    # No misc class in sysfs (not mounted): /proc/misc names the minor; the major is misc's, 10.
    proc_misc = tmp_path / "misc"
    proc_misc.write_text(" 58 mshv\n232 kvm\n183 hw_random\n")
    no_sysfs = tmp_path / "empty"
    no_sysfs.mkdir()
    assert hvnode.misc_numbers("kvm", no_sysfs, proc_misc) == os.makedev(10, 232)
    assert hvnode.misc_numbers("mshv", no_sysfs, proc_misc) == os.makedev(10, 58)
    with pytest.raises(LookupError, match="does not list it"):
        hvnode.misc_numbers("xen", no_sysfs, proc_misc)
    with pytest.raises(LookupError, match="cannot read"):
        hvnode.misc_numbers("kvm", no_sysfs, tmp_path / "absent")
    if HAVE_KVM:  # the real kernel's, both ways
        assert hvnode.misc_numbers("kvm") == os.stat("/dev/kvm").st_rdev
        assert hvnode.misc_numbers("kvm", no_sysfs) == os.stat("/dev/kvm").st_rdev


def test_a_character_device_that_is_not_the_hypervisor_is_refused_saying_why(tmp_path: Path) -> None:
    sys_dir = fake_sys(tmp_path, kvm="10:232")
    assert hvnode.node_problem(NULL, "kvm", sys_dir) == "/dev/null is device 1:3, not kvm (10:232)"
    assert hvnode.node_problem(NULL, "mshv", sys_dir).startswith(
        "cannot tell whether /dev/null is mshv: the kernel has no misc device mshv")
    (tmp_path / "kvm").symlink_to("/dev/kvm" if HAVE_KVM else NULL)
    assert hvnode.node_problem(tmp_path / "kvm", "kvm", sys_dir) == (
        f"{tmp_path / 'kvm'} is not a character device (a symlink)")
    if HAVE_KVM:
        assert hvnode.node_problem(Path("/dev/kvm"), "kvm") == ""


@needs_root
async def test_dev_null_numbers_at_the_device_path_are_never_advertised_or_granted(
        tmp_path: Path) -> None:
    """A char node with /dev/null's numbers where kvm belongs (the injected sysfs says kvm is
    10:232): Unhealthy and Allocate refused with the reason; the kvm numbers there: granted."""
    dev = tmp_path / "dev"
    dev.mkdir()
    node = mknod_char(dev / "kvm", os.stat(NULL).st_rdev)
    tracker = HealthTracker(required=("device",))
    watch = node_watch(tracker, node, sys_dir=fake_sys(tmp_path, kvm="10:232"))
    assert not await watch.check("start")
    assert tracker.state.reasons == {"device": f"{node} is device 1:3, not kvm (10:232)"}
    plugin = DeviceAccessPlugin("kvm", tracker, functools.partial(watch.check, Trigger.ALLOCATE))
    request = pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=["device-access-kvm"])])
    sock = Path(tempfile.mkdtemp(prefix="hlp-", dir="/tmp")) / "b.sock"
    server = new_server(plugin)
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            stream = stub.ListAndWatch(pb.Empty())
            first = await stream.read()
            assert [d.health for d in first.devices] == ["Unhealthy"] * ACCESS_SLOTS
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Allocate(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == (
                f"cannot grant /dev/kvm: device: {node} is device 1:3, not kvm (10:232)")
            node.unlink()
            mknod_char(node, os.makedev(10, 232))  # the hypervisor's numbers: granted (never opened)
            answer = await stub.Allocate(request, timeout=10)
            assert [d.host_path for d in answer.container_responses[0].devices] == ["/dev/kvm"]
            assert [d.health for d in (await stream.read()).devices] == ["Healthy"] * ACCESS_SLOTS
            stream.cancel()
    finally:
        plugin.close_streams()
        await server.stop(None)
        shutil.rmtree(sock.parent, ignore_errors=True)


async def test_an_ignored_setting_is_listed_in_every_readyz_answer_and_exported(tmp_path: Path) -> None:
    """No device and no kubelet here (503): the bootstrap daemon lists the environment value it
    ignored all the same, and exports it, without that changing readiness."""
    node = Node.make(tmp_path)
    dev = tmp_path / "dev"
    dev.mkdir()
    env = {"HYPERLIGHT_REGISTER_TIMEOUT": "10x", "HYPERLIGHT_LOG_LEVEL": "debug"}
    async with daemon(bootstrap_args(node, dev), env, graceful=True) as proc:
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert body["ignored_settings"] == ["register_timeout"]
        samples = await scrape(proc)
    assert value(samples, "hyperlight_settings_ignored", setting="register_timeout") == 1
    assert [k for k in samples if k[0] == "hyperlight_settings_ignored"] == [
        ("hyperlight_settings_ignored", frozenset({("setting", "register_timeout")}))]
