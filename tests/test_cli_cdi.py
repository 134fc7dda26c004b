"""`hlplugin cdi`: print the desired spec, or --check a file against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hlplugin import cdi


def hlplugin(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "hlplugin", *argv], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


def test_prints_the_spec_the_daemon_writes() -> None:
    out = hlplugin("cdi", "--hypervisor", "kvm", "--device-uid", "1000", "--device-gid", "1001")
    assert out.returncode == 0
    assert out.stdout.encode() == cdi.render_spec("kvm", 1000, 1001)
    spec = json.loads(out.stdout)
    assert spec["kind"] == "hyperlight.dev/hypervisor"
    assert spec["cdiVersion"] == "0.3.0"


def test_env_twins_apply_to_cdi() -> None:
    out = hlplugin("cdi", env={"HYPERLIGHT_HYPERVISOR": "mshv", "DEVICE_UID": "7", "DEVICE_GID": "8"})
    assert out.stdout.encode() == cdi.render_spec("mshv", 7, 8)


def test_check_exact_file_exits_0_and_differences_exit_1(tmp_path: Path) -> None:
    spec = tmp_path / "hyperlight.json"
    spec.write_bytes(cdi.render_spec("kvm", 65534, 65534))
    assert hlplugin("cdi", "--hypervisor", "kvm", "--check", str(spec)).returncode == 0
    spec.write_bytes(cdi.render_spec("kvm", 0, 65534))
    stale = hlplugin("cdi", "--hypervisor", "kvm", "--check", str(spec))
    assert stale.returncode == 1
    assert '"uid": 0' in stale.stderr and '"uid": 65534' in stale.stderr
    missing = hlplugin("cdi", "--hypervisor", "kvm", "--check", str(tmp_path / "nope.json"))
    assert missing.returncode == 1 and missing.stderr.strip()


def test_auto_without_a_device_explains(tmp_path: Path) -> None:
    out = hlplugin("cdi", "--dev-dir", str(tmp_path))
    assert out.returncode == 1
    assert "--hypervisor" in out.stderr


def test_accepts_the_serve_command_line(tmp_path: Path) -> None:
    out = hlplugin("cdi", "--plugin-dir", str(tmp_path), "--cdi-dir", str(tmp_path),
                   "--hypervisor", "kvm", "--device-count", "5", "--http-address", "127.0.0.1:0",
                   "--cdi-annotations")
    assert out.returncode == 0, out.stderr
    assert out.stdout.encode() == cdi.render_spec("kvm", 65534, 65534)
