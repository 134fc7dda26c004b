"""`hlplugin doctor` in-process, on this machine's real /dev/kvm and temporary node dirs."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from harness import Node, needs_kvm, needs_root

from hlplugin import cdi
from hlplugin.cli import main
from hlplugin.emulator import KubeletEmulator


async def doctor(*argv: str) -> tuple[int, str]:
    """`hlplugin doctor` in-process, in a thread so that the loop keeps serving the kubelet
    emulator: (exit code, stdout). The root logger, which the command configures, is put back."""
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out):  # stdout alone: the JSON stays clean
            code = await asyncio.to_thread(main, ["doctor", *argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, out.getvalue()


def node_args(node: Node, *extra: str) -> list[str]:
    return ["--plugin-dir", str(node.plugin_dir), "--cdi-dir", str(node.cdi_dir),
            "--dev-dir", str(node.dev_dir), "--host-dev-dir", str(node.host_dev_dir), *extra]


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


@needs_kvm
async def test_this_machine_could_serve(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    kubelet = KubeletEmulator(node.plugin_dir)
    await kubelet.start()
    try:
        code, out = await doctor(*node_args(node))
        assert code == 0, out
        assert "verdict: OK" in out
        for name in ("hypervisor", "device node", "KVM API version", "VM creation", "guest run",
                     "host identity", "CDI dir", "CDI spec", "plugin dir", "kubelet socket"):
            assert any(line.startswith(name) for line in out.splitlines()), name
        assert not any(" FAIL " in line for line in out.splitlines())

        code, out = await doctor(*node_args(node), "--json")
        assert code == 0
        report = json.loads(out)
        assert report["ok"] is True and report["hypervisor"] == "kvm" and report["reason"] == ""
        checks = by_name(report)
        assert checks["KVM API version"] == {**checks["KVM API version"], "status": "ok",
                                             "detail": "12"}
        assert checks["guest run"]["status"] == "ok"
        assert checks["kubelet socket"]["status"] == "ok"
        # No spec yet: the daemon would write one, so a warning, not a failure.
        assert checks["CDI spec"]["status"] == "warn"
        assert all(isinstance(c["seconds"], float) for c in report["checks"])

        node.cdi_dir.mkdir(exist_ok=True)
        (node.cdi_dir / cdi.SPEC_FILE).write_bytes(cdi.render_spec("kvm", 65534, 65534))
        os.chmod(node.cdi_dir / cdi.SPEC_FILE, cdi.MODE)
        code, out = await doctor(*node_args(node), "--json")
        assert by_name(json.loads(out))["CDI spec"]["status"] == "ok"
        # The writability check leaves nothing behind and never touches the spec.
        assert sorted(os.listdir(node.cdi_dir)) == [cdi.SPEC_FILE]
    finally:
        await kubelet.stop()


async def test_missing_dev_dir_fails_with_the_reason(tmp_path: Path) -> None:
    node = Node.make(tmp_path, dev_dir=tmp_path / "no-such-dev")
    kubelet = KubeletEmulator(node.plugin_dir)
    await kubelet.start()
    try:
        code, out = await doctor(*node_args(node))
        assert code == 1
        assert "verdict: FAIL" in out
        assert f"no mshv or kvm device under {tmp_path / 'no-such-dev'}" in out
        code, out = await doctor(*node_args(node), "--json")
        report = json.loads(out)
        assert code == 1 and report["ok"] is False
        assert report["reason"].startswith("hypervisor: no mshv or kvm device")
        assert by_name(report)["guest run"]["status"] == "skip"
        assert by_name(report)["kubelet socket"]["status"] == "ok"
    finally:
        await kubelet.stop()


async def test_kubelet_socket_missing_stale_or_not_a_socket(tmp_path: Path) -> None:
    node = Node.make(tmp_path, dev_dir=tmp_path, host_dev_dir=tmp_path)
    sock = node.plugin_dir / "kubelet.sock"

    async def kubelet_check() -> dict[str, Any]:
        code, out = await doctor(*node_args(node, "--hypervisor", "kvm"), "--json")
        assert code == 1
        return by_name(json.loads(out))["kubelet socket"]

    check = await kubelet_check()
    assert check["status"] == "fail" and "is missing" in check["detail"]
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never listening: a dead kubelet
        stale.bind(str(sock))
        check = await kubelet_check()
        assert check["status"] == "fail" and "stale socket" in check["detail"]
    sock.unlink()
    sock.write_text("")
    check = await kubelet_check()
    assert check["status"] == "fail" and "not a socket" in check["detail"]


async def test_cdi_problems(tmp_path: Path) -> None:
    node = Node.make(tmp_path, dev_dir=tmp_path, host_dev_dir=tmp_path)

    async def checks() -> dict[str, dict[str, Any]]:
        _, out = await doctor(*node_args(node, "--hypervisor", "kvm"), "--json")
        return by_name(json.loads(out))

    # Missing CDI dir under a writable parent: the daemon would create it.
    found = await checks()
    assert found["CDI dir"]["status"] == "ok" and "does not exist yet" in found["CDI dir"]["detail"]
    node.cdi_dir.mkdir()
    (node.cdi_dir / cdi.SPEC_FILE).write_text('{"cdiVersion": "0.3.0"}')
    found = await checks()
    assert found["CDI spec"]["status"] == "warn" and "rewrites" in found["CDI spec"]["detail"]
    (node.cdi_dir / cdi.SPEC_FILE).unlink()
    (node.cdi_dir / cdi.SPEC_FILE).mkdir()
    found = await checks()
    assert found["CDI spec"]["status"] == "fail" and "not a regular file" in found["CDI spec"]["detail"]
    (node.cdi_dir / cdi.SPEC_FILE).rmdir()
    node.cdi_dir.rmdir()
    node.cdi_dir.write_text("a file where the CDI dir belongs")
    found = await checks()
    assert found["CDI dir"]["status"] == "fail" and "not a directory" in found["CDI dir"]["detail"]


@needs_root
async def test_device_that_is_not_kvm_fails_naming_the_step(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "kvm", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    kubelet = KubeletEmulator(node.plugin_dir)
    await kubelet.start()
    try:
        code, out = await doctor(*node_args(node))
        assert code == 1
        assert "verdict: FAIL" in out and "KVM API version: KVM_GET_API_VERSION" in out
        assert "not a KVM device" in out
        code, out = await doctor(*node_args(node), "--json")
        checks = by_name(json.loads(out))
        assert checks["device node"]["status"] == "ok"
        assert checks["KVM API version"]["status"] == "fail"
        assert "Errno 25" in checks["KVM API version"]["detail"]
        assert checks["VM creation"]["status"] == "skip"
        assert checks["host identity"]["status"] == "ok"  # same node in both views
    finally:
        await kubelet.stop()


@needs_root
@needs_kvm
async def test_host_identity_mismatch(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    os.mknod(host / "kvm", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    node = Node.make(tmp_path, host_dev_dir=host)
    code, out = await doctor(*node_args(node), "--json")
    check = by_name(json.loads(out))["host identity"]
    assert code == 1 and check["status"] == "fail" and "1:3" in check["detail"]
    code, out = await doctor(*node_args(node)[:-2], "--host-dev-dir", "", "--json")
    assert by_name(json.loads(out))["host identity"]["status"] == "skip"
