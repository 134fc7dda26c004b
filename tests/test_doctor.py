"""`hlplugin doctor` in-process, on this machine's real /dev/kvm and temporary node dirs."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from harness import HAVE_KVM, Node, mknod_char, needs_kvm, needs_root

from hlplugin import cdi_spec
from hlplugin.cli import main
from hlplugin.tools.emulator import KubeletEmulator


def run_doctor(argv: list[str]) -> tuple[int, str]:
    """`hlplugin doctor ARGV` in-process: (exit code, stdout), the root logger it configures put back."""
    out, root = io.StringIO(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out):  # stdout alone: the JSON stays clean
            return main(["doctor", *argv]), out.getvalue()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


async def doctor(node: Node, *extra: str, kubelet: bool = True) -> tuple[int, str, dict[str, Any]]:
    """Doctor on ``node`` as text and as --json, which must exit alike, in a thread so that the
    loop serves the kubelet emulator: (exit code, text, report with its checks by name)."""
    argv = node.serve_args(*extra)[1:]  # serve's node flags are doctor's
    emulator = KubeletEmulator(node.plugin_dir)
    if kubelet:
        await emulator.start()
    try:
        (code, text), (json_code, out) = [await asyncio.to_thread(run_doctor, [*argv, *more])
                                          for more in ([], ["--json"])]
    finally:
        if kubelet:
            await emulator.stop()
    report = json.loads(out)
    assert json_code == code and report["ok"] is (code == 0)
    return code, text, {**report, "checks": {c["name"]: c for c in report["checks"]}}


@needs_kvm
async def test_this_machine_could_serve(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    code, out, report = await doctor(node)
    assert code == 0, out
    assert "verdict: OK" in out
    for name in ("hypervisor", "device node", "KVM API version", "VM creation", "guest run",
                 "host identity", "CDI dir", "CDI spec", "plugin dir", "kubelet socket"):
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert not any(" FAIL " in line for line in out.splitlines())
    assert report["hypervisor"] == "kvm" and report["reason"] == ""
    checks = report["checks"]
    assert checks["KVM API version"] == {**checks["KVM API version"], "status": "ok", "detail": "12"}
    assert checks["guest run"]["status"] == "ok"
    assert checks["kubelet socket"]["status"] == "ok"
    # No spec yet: the daemon would write one, so a warning, not a failure.
    assert checks["CDI spec"]["status"] == "warn"
    assert all(isinstance(c["seconds"], float) for c in checks.values())

    node.cdi_dir.mkdir(exist_ok=True)
    (node.cdi_dir / cdi_spec.SPEC_FILE).write_bytes(cdi_spec.render_spec("kvm", 65534, 65534))
    os.chmod(node.cdi_dir / cdi_spec.SPEC_FILE, cdi_spec.MODE)
    code, _, report = await doctor(node)
    assert report["checks"]["CDI spec"]["status"] == "ok"
    # The writability check leaves nothing behind and never touches the spec.
    assert sorted(os.listdir(node.cdi_dir)) == [cdi_spec.SPEC_FILE]
    # An empty host dev dir turns the identity check off.
    code, _, report = await doctor(node, "--host-dev-dir", "")
    assert report["checks"]["host identity"]["status"] == "skip"


def node_dir(tmp_path: Path, name: str) -> Path:
    """``name`` under ``tmp_path`` ("/dev" stays itself); "null" holds a kvm node with /dev/null's
    numbers: a character device, but not KVM."""
    path = tmp_path / name
    if name == "null" and not path.exists():
        path.mkdir()
        mknod_char(path / "kvm", os.makedev(1, 3))
    return path


NOT_KVM = ("KVM_GET_API_VERSION on {dev}/kvm failed: [Errno 25] Inappropriate ioctl for device; "
           "the node exists but is not a KVM device")


@pytest.mark.parametrize(("dev", "host", "failing", "detail", "others"), [
    pytest.param("no-such-dev", "/dev", "hypervisor", "no mshv or kvm device under {dev}",
                 {"guest run": "skip", "kubelet socket": "ok"}, id="no-device"),
    pytest.param("null", "null", "KVM API version", NOT_KVM,
                 {"device node": "ok", "VM creation": "skip", "host identity": "ok"},  # one node, both views
                 id="not-kvm", marks=needs_root),
    pytest.param("/dev", "null", "host identity", "host device node {host}/kvm is 1:3, but /dev/kvm is",
                 {"KVM API version": "ok", "kubelet socket": "ok"}, id="host-identity-mismatch",
                 marks=[needs_root, needs_kvm]),
])
async def test_a_node_that_could_not_serve_fails_naming_the_check(
        tmp_path: Path, dev: str, host: str, failing: str, detail: str, others: dict[str, str]) -> None:
    node = Node.make(tmp_path, dev_dir=node_dir(tmp_path, dev), host_dev_dir=node_dir(tmp_path, host))
    detail = detail.format(dev=node.dev_dir, host=node.host_dev_dir)
    code, out, report = await doctor(node)
    assert code == 1
    assert "verdict: FAIL" in out
    assert f"{failing}: {detail}" in out
    assert report["reason"].startswith(f"{failing}: {detail}")
    assert report["checks"][failing]["status"] == "fail"
    assert detail in report["checks"][failing]["detail"]
    assert {name: report["checks"][name]["status"] for name in others} == others


async def test_kubelet_socket_and_cdi_problems(tmp_path: Path) -> None:
    node = Node.make(tmp_path, dev_dir=tmp_path, host_dev_dir=tmp_path)
    sock, spec = node.plugin_dir / "kubelet.sock", node.cdi_dir / cdi_spec.SPEC_FILE

    async def expect(want: dict[str, tuple[str, str]]) -> None:
        """Doctor fails (no kubelet here); each named check has its status and says its part."""
        code, _, report = await doctor(node, "--hypervisor", "kvm", kubelet=False)
        assert code == 1
        for name, (status, part) in want.items():
            check = report["checks"][name]
            assert check["status"] == status and part in check["detail"], check

    # No kubelet socket; a missing CDI dir under a writable parent: the daemon would create it.
    await expect({"kubelet socket": ("fail", "no kubelet.sock at"), "CDI dir": ("ok", "does not exist yet")})
    # A socket bound but never listening (a dead kubelet); a spec the daemon rewrites.
    node.cdi_dir.mkdir()
    spec.write_text('{"cdiVersion": "0.3.0"}')
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(sock))
        await expect({"kubelet socket": ("fail", "stale socket"), "CDI spec": ("warn", "rewrites")})
    # Not a socket; not a regular file.
    sock.unlink()
    sock.write_text("")
    spec.unlink()
    spec.mkdir()
    await expect({"kubelet socket": ("fail", "not a socket"), "CDI spec": ("fail", "not a regular file")})
    # A file where the CDI dir belongs.
    spec.rmdir()
    node.cdi_dir.rmdir()
    node.cdi_dir.write_text("a file where the CDI dir belongs")
    await expect({"CDI dir": ("fail", "not a directory")})


@needs_kvm
@pytest.mark.skipif(os.path.exists("/host-dev"), reason="this machine has a /host-dev")
async def test_outside_the_pod_the_host_view_is_dev_and_a_machine_without_kubelet_is_not_a_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain doctor on this machine (a working /dev/kvm, no kubelet), with the default host view:
    host identity passes through /dev and says why; the verdict says this is not a node, and the
    CDI dir row says it wrote and removed a temp file."""
    monkeypatch.delenv("HYPERLIGHT_HOST_DEV_DIR", raising=False)
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    argv = ["--plugin-dir", str(tmp_path / "no-kubelet"), "--cdi-dir", str(cdi_dir), "--json"]
    code, out = await asyncio.to_thread(run_doctor, argv)
    report = json.loads(out)
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1
    identity = checks["host identity"]
    assert identity["status"] == "ok", identity
    assert "/host-dev does not exist, so this is not the daemon's pod: /dev is the host's view" \
        in identity["detail"]
    assert report["verdict"].startswith(f"FAIL - this machine is not a Kubernetes node: there is no "
                                        f"{tmp_path / 'no-kubelet'}")
    assert "--device-only" in report["verdict"]
    assert checks["kubelet socket"]["status"] == "skip"
    assert "wrote, synced and removed a 4 KiB temp file, .hyperlight.json.tmp-doctor-" in \
        checks["CDI dir"]["detail"]
    assert os.listdir(cdi_dir) == []
    # Any other host view that does not exist still fails.
    code, out = await asyncio.to_thread(run_doctor, [*argv, "--host-dev-dir", str(tmp_path / "nope")])
    assert {c["name"]: c for c in json.loads(out)["checks"]}["host identity"]["status"] == "fail"


async def test_device_only_checks_the_hypervisor_and_the_cdi_device_alone(tmp_path: Path) -> None:
    """--device-only: no host identity, CDI dir, plugin dir or kubelet rows; with no hypervisor
    it fails naming it, with what to look at (the kvm module, nested virtualisation)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    code, out = await asyncio.to_thread(run_doctor, ["--device-only", "--dev-dir", str(dev), "--json"])
    report = json.loads(out)
    assert code == 1
    assert [c["name"] for c in report["checks"]] == [
        "hypervisor", "device node", "KVM API version", "VM creation", "guest run", "CDI device"]
    assert report["verdict"].startswith("FAIL - this machine could not run Hyperlight workloads. "
                                        f"hypervisor: no mshv or kvm device under {dev}")
    assert "modprobe kvm_intel or kvm_amd" in report["reason"]
    assert "nested virtualisation" in report["reason"]
    if HAVE_KVM:
        code, text = await asyncio.to_thread(run_doctor, ["--device-only"])
        assert code == 0, text
        assert "CDI device       OK      hyperlight.dev/hypervisor=kvm resolves to /dev/kvm" in text
        assert "verdict: OK - this machine could run Hyperlight workloads (kvm)" in text


def test_cdi_device_resolution_names_what_a_runtime_would_miss(tmp_path: Path) -> None:
    """--device-only's CDI row resolves the daemon's spec as a runtime would: the kind, the device,
    one node, and that node a character device here."""
    from hlplugin.tools.cdi_resolve import device_node, resolves_to

    spec = cdi_spec.render_spec("kvm", 65534, 65534)
    assert device_node(spec, "hyperlight.dev/hypervisor=kvm")["path"] == "/dev/kvm"
    for qualified, says in (("other.dev/x=kvm", "not 'other.dev/x'"),
                            ("hyperlight.dev/hypervisor=mshv", "declares no device")):
        with pytest.raises(ValueError, match=says):
            device_node(spec, qualified)
    doubled = json.loads(spec)
    nodes = doubled["devices"][0]["containerEdits"]["deviceNodes"]
    nodes.append(nodes[0])
    with pytest.raises(ValueError, match="creates 2 device nodes"):
        device_node(json.dumps(doubled).encode(), "hyperlight.dev/hypervisor=kvm")
    (tmp_path / "kvm").write_text("a file")
    with pytest.raises(ValueError, match="is not a character device"):
        resolves_to(spec, "hyperlight.dev/hypervisor=kvm", tmp_path)
    with pytest.raises(ValueError, match="No such file"):
        resolves_to(spec, "hyperlight.dev/hypervisor=kvm", tmp_path / "none")
