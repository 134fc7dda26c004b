"""`hlplugin serve` as a real process against the kubelet emulator over real unix sockets."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import grpc
import pytest
from harness import Node, daemon, emulator, needs_kvm, needs_root, on_kubelet, scrape, wait_until
from support.waits import quiet

from hlplugin.tools.emulator import AdmissionError

RESOURCE = "hyperlight.dev/hypervisor"
CDI_NAME = "hyperlight.dev/hypervisor=kvm"


@needs_kvm
async def test_registers_allocates_and_re_registers_when_its_socket_goes(tmp_path: Path) -> None:
    """A kubelet restart: test_faults; no annotations without --cdi-annotations: test_plugin."""
    node = Node.make(tmp_path)
    # --cdi-annotations: for kubelets older than 1.29. Environment twins apply, and a flag wins.
    args = node.serve_args("--device-count", "10", "--cdi-annotations", "--device-gid", "2002")
    env = {"DEVICE_COUNT": "7", "DEVICE_UID": "1000", "DEVICE_GID": "1001"}
    async with on_kubelet(node, args, env) as (kubelet, proc):
        # Registration: ten slots, and a CDI reference and its annotation per container.
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 10)
        resource = kubelet.resources[RESOURCE]
        assert resource.endpoint == "hyperlight.sock"
        assert sorted(resource.devices) == sorted(f"kvm-{i}" for i in range(10))
        assert set(resource.devices.values()) == {"Healthy"}
        assert kubelet.rejections == []
        spec = json.loads((node.cdi_dir / "hyperlight.json").read_bytes())
        device_node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
        assert (device_node["uid"], device_node["gid"]) == (1000, 2002)
        ready = json.loads(await proc.wait_http("/readyz", 200))
        assert ready == {"status": "ready", "ignored_settings": [], "warnings": [],
                         "conditions": {name: {"ok": True, "reason": ""} for name in (
            "registered", "listandwatch", "cdi", "device", "host_identity")}}
        one = await kubelet.admit(RESOURCE)
        assert len(one.container_responses) == 1
        assert [d.name for d in one.container_responses[0].cdi_devices] == [CDI_NAME]
        assert not one.container_responses[0].devices
        assert one.container_responses[0].annotations
        requests = [["kvm-3"], ["kvm-4", "kvm-5"], ["kvm-6"]]
        several = await kubelet.allocate(RESOURCE, requests)
        assert len(several.container_responses) == 3
        for ids, entry in zip(requests, several.container_responses, strict=True):
            assert [d.name for d in entry.cdi_devices] == [CDI_NAME]
            assert dict(entry.annotations) == {f"cdi.k8s.io/hyperlight.dev_{ids[0]}": CDI_NAME}
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(RESOURCE, [["kvm-1"], ["kvm-999"]])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "kvm-999" in refused.value.details

        # Registering anew. When its socket goes, the daemon ends the old streams before
        # registering: the kubelet keys streams on the resource, so an old stream ending after
        # the new registration would stop the new endpoint. The emulator reproduces that, so
        # this fails if we register first.
        for _ in range(3):
            calls = kubelet.register_calls
            os.unlink(node.plugin_dir / "hyperlight.sock")
            await kubelet.wait_for(lambda c=calls: kubelet.allocatable(RESOURCE) == 10
                                   and kubelet.register_calls > c, timeout=10)
            # A bounded watch, 300 ms: an old stream ends when its server stops, well within
            # this on loopback, and its end would unregister the resource at once.
            await quiet(0.3, "a bounded watch: an old stream's end would unregister the resource")
            assert kubelet.registered(RESOURCE)
            assert kubelet.allocatable(RESOURCE) == 10
            await kubelet.admit(RESOURCE)


async def test_socket_deleted_during_register_starts_fresh_server_and_sigterm_exits(
        tmp_path: Path) -> None:
    """A Register that hangs: deleting our socket starts a fresh server at once, and SIGTERM
    during the Register in flight exits promptly, without waiting out --register-timeout."""
    node = Node.make(tmp_path)
    sock = node.plugin_dir / "hyperlight.sock"
    args = node.serve_args("--hypervisor", "kvm", "--register-timeout", "60")
    async with on_kubelet(node, args, mode="hang") as (hanging, proc):
        await hanging.wait_for(lambda: hanging.register_calls == 1, timeout=10)
        os.unlink(sock)
        # Without the fix the daemon waits out the 60 s register timeout first.
        await wait_until(sock.exists, timeout=10)
        await hanging.wait_for(lambda: hanging.register_calls == 2, timeout=10)
        began = time.monotonic()
        assert await proc.stop() == 0
        assert time.monotonic() - began < 5  # the contract is 2 s; a guard
        assert not sock.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_starts_without_kubelet_or_socket_path_then_stops_on_a_signal(
        tmp_path: Path, signum: int) -> None:
    node = Node.make(tmp_path)
    sock = node.plugin_dir / "hyperlight.sock"
    sock.write_text("not ours")
    async with daemon(node.serve_args("--hypervisor", "kvm", "--device-count", "2",
                                      "--log-level", "debug")) as proc:
        # No kubelet yet, and a non-socket at our socket path: not deleted; once it goes, we bind.
        await wait_until(lambda: any("not a socket" in m for m in proc.messages()), 10)
        assert sock.read_text() == "not ours"
        assert stat.S_ISREG(os.lstat(sock).st_mode)
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert body["conditions"]["registered"]["ok"] is False
        sock.unlink()
        await wait_until(sock.exists)
        # The kubelet comes late: once the daemon serves (its debug line, written as it goes on to
        # look for kubelet.sock and wait), so that kubelet.sock's appearance is what wakes it.
        await wait_until(lambda: any(m.startswith(f"serving {RESOURCE} on") for m in proc.messages()),
                         10, "the daemon serving")
        async with emulator(node.plugin_dir) as kubelet:
            await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2, timeout=10)
            # SIGTERM or SIGINT: a quick exit that removes the socket and keeps the spec.
            spec = (node.cdi_dir / "hyperlight.json").read_bytes()
            began = time.monotonic()
            code = await proc.signal(signum)
            elapsed = time.monotonic() - began
            assert code == 0
            assert elapsed < 5, f"took {elapsed:.2f}s to stop"  # the contract is 2 s; a guard
            assert not sock.exists()
            assert (node.plugin_dir / "kubelet.sock").exists()
            assert (node.cdi_dir / "hyperlight.json").read_bytes() == spec
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0)


@needs_kvm
@needs_root
async def test_no_hypervisor_at_start_stays_up_unready_then_recovers(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    async with on_kubelet(node, node.serve_args("--device-count", "2")) as (kubelet, proc):
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["hypervisor"]["ok"] is False
        # A bounded watch, half a second: registration follows a found hypervisor within
        # milliseconds, so none in this time means none without one.
        await quiet(0.5, "a bounded watch: registration follows a found hypervisor within ms")
        assert kubelet.allocatable(RESOURCE) == 0
        assert (await proc.http("/healthz"))[0] == 200
        os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, os.stat("/dev/kvm").st_rdev)
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2, timeout=10)
        await proc.wait_http("/readyz", 200)
        await kubelet.admit(RESOURCE)


@needs_kvm
async def test_ignored_environment_values_are_exported_and_listed_without_failing_readiness(
        tmp_path: Path) -> None:
    """DEVICE_COUNT=0 runs with the default 2000, as upstream does; the operator learns it from a
    gauge per ignored setting and from /readyz, in every answer, 503 and 200 alike. The log says
    "advertising" once the kubelet has the list, not at start."""
    node = Node.make(tmp_path)
    env = {"DEVICE_COUNT": "0", "HYPERLIGHT_CDI_INTERVAL": "10x", "HYPERLIGHT_HEALTH_INTERVAL": "1m"}
    async with daemon(node.serve_args(), env, graceful=True) as proc:
        unready = json.loads(await proc.wait_http("/readyz", 503))  # no kubelet yet
        assert unready["ignored_settings"] == ["cdi_interval", "device_count"]
        await wait_until(lambda: (node.plugin_dir / "hyperlight.sock").exists())
        # "advertising" is said when the kubelet has the list, not when there is none to have it.
        assert not any("advertising" in m for m in proc.messages()), proc.messages()
        async with emulator(node.plugin_dir) as kubelet:
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2000, timeout=10)
            await wait_until(lambda: "advertising 2000 devices to the kubelet, all Healthy"
                             in proc.messages(), what="the advertising line")
            ready = json.loads(await proc.wait_http("/readyz", 200))
            assert ready["status"] == "ready"
            assert ready["ignored_settings"] == ["cdi_interval", "device_count"]
            samples = await scrape(proc)
    ignored = {dict(labels)["setting"]: v for (name, labels), v in samples.items()
               if name == "hyperlight_settings_ignored"}
    assert ignored == {"cdi_interval": 1.0, "device_count": 1.0}  # 1m was taken: not ignored
    assert any("ignoring DEVICE_COUNT" in m for m in proc.messages())


@needs_kvm
@needs_root
async def test_registers_while_its_first_checks_run_and_lists_what_they_found(tmp_path: Path) -> None:
    """The first CDI pass and device check run while the plugin starts serving and registers;
    the first list waits for them. Here the CDI storage hangs from the start (FUSE): the daemon
    registers with its cdi condition still unchecked, no list sent; once that pass gives up
    (its budget), the first list is all Unhealthy; storage answering again brings the slots."""
    from fusefs import HangingFs

    from hlplugin.cdi_spec import SPEC_FILE, render_spec
    from hlplugin.settings import CdiSettings

    node = Node.make(tmp_path)
    spec = render_spec("kvm", 65534, 65534)
    with HangingFs(node.cdi_dir, SPEC_FILE, stat.S_IFREG | 0o644, content=spec) as fs:
        fs.hang()
        args = node.serve_args("--hypervisor", "kvm", "--device-count", "4")
        async with on_kubelet(node, args) as (kubelet, proc):
            try:
                await kubelet.wait_for(lambda: kubelet.registered(RESOURCE), timeout=CdiSettings.budget)
                status, body = await proc.http("/readyz")
                conditions = json.loads(body)["conditions"]
                assert status == 503, conditions
                # The pass is stuck in the kernel for its budget (5 s): not done at Register.
                assert conditions["cdi"]["reason"] == "not checked yet", conditions
                assert kubelet.resources[RESOURCE].lists_received == 0
                await kubelet.wait_for(lambda: kubelet.resources[RESOURCE].lists_received > 0,
                                       timeout=CdiSettings.budget + 20)
                assert kubelet.allocatable(RESOURCE) == 0  # what the timed-out pass found
                fs.release()
                await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, timeout=30)
            finally:
                fs.release()  # a helper stuck in the kernel would keep the daemon from exiting
