"""`hlplugin serve` as a real process against the kubelet emulator over real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from harness import Daemon, Node, needs_kvm, needs_root, on_kubelet, wait_until

from hlplugin.emulator import AdmissionError, KubeletEmulator

RESOURCE = "hyperlight.dev/hypervisor"
CDI_NAME = "hyperlight.dev/hypervisor=kvm"


async def started(node: Node, *extra: str, env: dict[str, str] | None = None,
                  kubelet: KubeletEmulator | None = None) -> tuple[KubeletEmulator, Daemon]:
    if kubelet is None:
        kubelet = KubeletEmulator(node.plugin_dir)
        await kubelet.start()
    proc = await Daemon(node.serve_args(*extra), env).start()
    return kubelet, proc


def running(node: Node, *extra: str, env: dict[str, str] | None = None
            ) -> contextlib.AbstractAsyncContextManager[tuple[KubeletEmulator, Daemon]]:
    """A kubelet emulator and `hlplugin serve` on ``node``; both stopped on the way out."""
    return on_kubelet(node, node.serve_args(*extra), env)


@needs_kvm
async def test_registers_and_advertises_slots(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    async with running(node, "--device-count", "5") as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 5)
        resource = kubelet.resources[RESOURCE]
        assert resource.endpoint == "hyperlight.sock"
        assert not resource.options.pre_start_required
        assert not resource.options.get_preferred_allocation_available
        assert sorted(resource.devices) == sorted(f"kvm-{i}" for i in range(5))
        assert set(resource.devices.values()) == {"Healthy"}
        assert kubelet.rejections == []
        await proc.wait_http("/readyz", 200)


@needs_kvm
async def test_allocate_answers_cdi_reference_per_container(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    async with running(node, "--device-count", "10") as (kubelet, _proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 10)
        one = await kubelet.admit(RESOURCE)
        assert len(one.container_responses) == 1
        assert [d.name for d in one.container_responses[0].cdi_devices] == [CDI_NAME]
        assert not one.container_responses[0].annotations
        assert not one.container_responses[0].devices
        several = await kubelet.allocate(RESOURCE, [["kvm-3"], ["kvm-4", "kvm-5"], ["kvm-6"]])
        assert len(several.container_responses) == 3
        for entry in several.container_responses:
            assert [d.name for d in entry.cdi_devices] == [CDI_NAME]
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(RESOURCE, [["kvm-1"], ["kvm-999"]])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "kvm-999" in refused.value.details


@needs_kvm
async def test_cdi_annotations_for_old_kubelets(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    async with running(node, "--device-count", "2", "--cdi-annotations") as (kubelet, _proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2)
        response = await kubelet.allocate(RESOURCE, [["kvm-1"]])
        entry = response.container_responses[0]
        assert dict(entry.annotations) == {"cdi.k8s.io/hyperlight.dev_kvm-1": CDI_NAME}
        assert [d.name for d in entry.cdi_devices] == [CDI_NAME]


@needs_kvm
async def test_unusable_cdi_path_refuses_allocation_with_reason(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    node.cdi_dir.mkdir()
    (node.cdi_dir / "hyperlight.json").mkdir()  # a directory where our file belongs
    async with running(node, "--device-count", "2") as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2)
        assert kubelet.allocatable(RESOURCE) == 0
        with pytest.raises(AdmissionError) as refused:
            await kubelet.allocate(RESOURCE, [["kvm-0"]])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "cdi" in refused.value.details and "directory" in refused.value.details
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert body["conditions"]["cdi"]["ok"] is False
        (node.cdi_dir / "hyperlight.json").rmdir()
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2)
        await kubelet.admit(RESOURCE)


@needs_kvm
async def test_kubelet_restart_re_registers(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    async with running(node, "--device-count", "3") as (kubelet, _proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 3)
        for _ in range(3):
            calls = kubelet.register_calls
            await kubelet.restart()  # deletes every socket, serves kubelet.sock anew
            assert kubelet.capacity(RESOURCE) == 0
            await kubelet.wait_for(lambda c=calls: kubelet.allocatable(RESOURCE) == 3
                                   and kubelet.register_calls > c, timeout=10)
            await kubelet.admit(RESOURCE)


@needs_kvm
async def test_own_socket_deleted_ends_old_streams_before_registering(tmp_path: Path) -> None:
    """The kubelet keys streams on the resource: an old stream ending after the new registration
    would stop the new endpoint. The emulator reproduces that, so this fails if we register first."""

    node = Node.make(tmp_path)
    async with running(node, "--device-count", "3") as (kubelet, _proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 3)
        for _ in range(3):
            calls = kubelet.register_calls
            os.unlink(node.plugin_dir / "hyperlight.sock")
            await kubelet.wait_for(lambda c=calls: kubelet.register_calls > c
                                   and kubelet.allocatable(RESOURCE) == 3)
            await asyncio.sleep(0.3)  # a late old-stream end would land here
            assert kubelet.registered(RESOURCE)
            assert kubelet.allocatable(RESOURCE) == 3
            await kubelet.admit(RESOURCE)


async def test_kubelet_absent_at_start_then_appears(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    proc = await Daemon(node.serve_args("--device-count", "2", "--hypervisor", "kvm")).start()
    kubelet = KubeletEmulator(node.plugin_dir)
    try:
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert body["conditions"]["registered"]["ok"] is False
        await wait_until(lambda: (node.plugin_dir / "hyperlight.sock").exists())
        await asyncio.sleep(0.5)
        await kubelet.start()
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2, timeout=10)
    finally:
        await proc.stop()
        await kubelet.stop()


async def test_register_that_never_answers_is_bounded_and_retried(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    hanging = KubeletEmulator(node.plugin_dir, mode="hang")
    await hanging.start()
    proc = await Daemon(node.serve_args("--hypervisor", "kvm", "--device-count", "2",
                                        "--register-timeout", "0.3")).start()
    try:
        await hanging.wait_for(lambda: hanging.register_calls >= 3, timeout=20)
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert body["conditions"]["registered"]["ok"] is False
        assert any("registration" in m and "DEADLINE_EXCEEDED" in m for m in proc.messages())
        await hanging.stop(remove_socket=True)
        kubelet = KubeletEmulator(node.plugin_dir)
        await kubelet.start()
        try:
            await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2, timeout=10)
        finally:
            await kubelet.stop()
    finally:
        await proc.stop()


async def test_socket_deleted_during_register_starts_fresh_server(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    hanging = KubeletEmulator(node.plugin_dir, mode="hang")
    await hanging.start()
    proc = await Daemon(node.serve_args("--hypervisor", "kvm", "--register-timeout", "60")).start()
    sock = node.plugin_dir / "hyperlight.sock"
    try:
        await hanging.wait_for(lambda: hanging.register_calls == 1, timeout=10)
        os.unlink(sock)
        # Without the fix the daemon waits out the 60 s register timeout first.
        await wait_until(sock.exists, timeout=10)
        await hanging.wait_for(lambda: hanging.register_calls == 2, timeout=10)
    finally:
        await proc.stop()
        await hanging.stop()


async def test_reset_connections_are_bounded_and_logged_once(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    resetting = KubeletEmulator(node.plugin_dir, mode="reset")
    await resetting.start()
    proc = await Daemon(node.serve_args("--hypervisor", "kvm", "--register-timeout", "1")).start()

    async def failures() -> float:
        _, text = await proc.http("/metrics")
        for line in text.decode().splitlines():
            if line.startswith('hyperlight_registrations_total{result="failure"}'):
                return float(line.split()[-1])
        return 0.0

    try:
        deadline = asyncio.get_running_loop().time() + 30
        while await failures() < 4:
            assert asyncio.get_running_loop().time() < deadline, "registration never retried"
            await asyncio.sleep(0.1)
        await proc.wait_http("/readyz", 503)
        assert (await proc.http("/healthz"))[0] == 200
        # A lasting failure is logged when it begins, not on every retry.
        warned = [line for line in proc.lines
                  if line["level"] == "warning" and "registration" in line["message"]]
        assert len(warned) == 1, warned
        await resetting.stop(remove_socket=True)
        kubelet = KubeletEmulator(node.plugin_dir)
        await kubelet.start()
        try:
            await kubelet.wait_for(lambda: kubelet.registered(RESOURCE), timeout=15)
            await wait_until(lambda: any("after" in m and "failed attempts" in m
                                         for m in proc.messages()))
        finally:
            await kubelet.stop()
    finally:
        await proc.stop()


async def test_sigusr1_logs_every_task_and_keeps_running(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    async with running(node, "--hypervisor", "kvm", "--device-count", "2") as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.registered(RESOURCE))
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGUSR1)
        await wait_until(lambda: any(m.startswith("task ") and " waits in: " in m
                                     for m in proc.messages()))
        assert proc.proc.returncode is None
        assert (await proc.http("/healthz"))[0] == 200


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_quickly_removes_socket_keeps_spec(tmp_path: Path, signum: int) -> None:
    node = Node.make(tmp_path)
    kubelet, proc = await started(node, "--hypervisor", "kvm", "--device-count", "2")
    try:
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2)
        spec = (node.cdi_dir / "hyperlight.json").read_bytes()
        began = time.monotonic()
        code = await proc.signal(signum)
        elapsed = time.monotonic() - began
        assert code == 0
        assert elapsed < 5, f"took {elapsed:.2f}s to stop"  # the contract is 2 s; a guard
        assert not (node.plugin_dir / "hyperlight.sock").exists()
        assert (node.plugin_dir / "kubelet.sock").exists()
        assert (node.cdi_dir / "hyperlight.json").read_bytes() == spec
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0)
    finally:
        await kubelet.stop()


@pytest.mark.parametrize(("argv", "flag"), [
    (["--device-count", "0"], "--device-count"),
    (["--device-count", "abc"], "--device-count"),
    (["--device-uid", "-1"], "--device-uid"),
    (["--device-gid", "4294967296"], "--device-gid"),
    (["--hypervisor", "xen"], "--hypervisor"),
    (["--http-address", "nonsense"], "--http-address"),
    (["--log-format", "xml"], "--log-format"),
    (["--log-level", "loud"], "--log-level"),
    (["--cdi-interval", "-3"], "--cdi-interval"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_invalid_flags_exit_2_naming_the_flag(argv: list[str], flag: str) -> None:
    result = subprocess.run([sys.executable, "-m", "hlplugin", "serve", *argv],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert flag in result.stderr


@needs_kvm
async def test_invalid_env_values_fall_back_with_warning(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    env = {"DEVICE_COUNT": "-4", "DEVICE_UID": "4294967296", "DEVICE_GID": "abc"}
    async with running(node, env=env) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 2000)
        spec = json.loads((node.cdi_dir / "hyperlight.json").read_bytes())
        device_node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
        assert (device_node["uid"], device_node["gid"]) == (65534, 65534)
        warnings = [line["message"] for line in proc.lines if line["level"] == "warning"]
        for name in env:
            assert any(name in w and "default" in w for w in warnings), (name, warnings)


@needs_kvm
async def test_env_twins_apply_and_flags_win(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    env = {"DEVICE_COUNT": "7", "DEVICE_UID": "1000", "DEVICE_GID": "1001"}
    async with running(node, "--device-gid", "2002", env=env) as (kubelet, _proc):
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 7)
        spec = json.loads((node.cdi_dir / "hyperlight.json").read_bytes())
        device_node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
        assert (device_node["uid"], device_node["gid"]) == (1000, 2002)


def test_version_and_help() -> None:
    from hlplugin import __version__

    out = subprocess.run([sys.executable, "-m", "hlplugin", "--version"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and __version__ in out.stdout
    help_text = subprocess.run([sys.executable, "-m", "hlplugin", "serve", "--help"],
                               capture_output=True, text=True, timeout=30).stdout
    for flag, twin in [("--plugin-dir", "HYPERLIGHT_PLUGIN_DIR"), ("--cdi-dir", "HYPERLIGHT_CDI_DIR"),
                       ("--dev-dir", "HYPERLIGHT_DEV_DIR"), ("--host-dev-dir", "HYPERLIGHT_HOST_DEV_DIR"),
                       ("--hypervisor", "HYPERLIGHT_HYPERVISOR"), ("--device-count", "DEVICE_COUNT"),
                       ("--device-uid", "DEVICE_UID"), ("--device-gid", "DEVICE_GID"),
                       ("--http-address", "HYPERLIGHT_HTTP_ADDRESS"),
                       ("--log-format", "HYPERLIGHT_LOG_FORMAT"), ("--log-level", "HYPERLIGHT_LOG_LEVEL"),
                       ("--cdi-annotations", "HYPERLIGHT_CDI_ANNOTATIONS")]:
        assert flag in help_text and twin in help_text, flag


async def test_socket_path_occupied_by_a_non_socket_is_not_deleted(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    blocker = node.plugin_dir / "hyperlight.sock"
    blocker.write_text("not ours")
    async with running(node, "--hypervisor", "kvm") as (kubelet, proc):
        await wait_until(lambda: any("not a socket" in m for m in proc.messages()), 10)
        assert blocker.read_text() == "not ours"
        assert stat.S_ISREG(os.lstat(blocker).st_mode)
        blocker.unlink()
        await kubelet.wait_for(lambda: kubelet.registered(RESOURCE), timeout=15)


def test_plugin_dir_too_long_for_a_socket_exits_2(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 100)
    result = subprocess.run([sys.executable, "-m", "hlplugin", "serve", "--plugin-dir", str(long_dir)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--plugin-dir" in result.stderr and "too long" in result.stderr


@needs_kvm
@needs_root
async def test_no_hypervisor_at_start_stays_up_unready_then_recovers(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    async with running(node, "--device-count", "2") as (kubelet, proc):
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["hypervisor"]["ok"] is False
        await asyncio.sleep(0.5)
        assert kubelet.allocatable(RESOURCE) == 0
        assert (await proc.http("/healthz"))[0] == 200
        os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, os.stat("/dev/kvm").st_rdev)
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2, timeout=10)
        await proc.wait_http("/readyz", 200)
        await kubelet.admit(RESOURCE)


async def test_sigterm_while_register_is_in_flight_exits_promptly(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    hanging = KubeletEmulator(node.plugin_dir, mode="hang")
    await hanging.start()
    proc = await Daemon(node.serve_args("--hypervisor", "kvm", "--register-timeout", "60")).start()
    try:
        await hanging.wait_for(lambda: hanging.register_calls >= 1, timeout=20)
        began = time.monotonic()
        assert await proc.stop() == 0
        assert time.monotonic() - began < 5  # the contract is 2 s; a guard
        assert not (node.plugin_dir / "hyperlight.sock").exists()
    finally:
        await hanging.stop()
