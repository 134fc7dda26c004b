"""`hlplugin demo` end to end: real daemon processes, the in-package kubelet emulator, /dev/kvm."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import needs_kvm

from hlplugin.demo import demo


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: the demo's sockets live under it, and unix socket paths are capped."""
    path = Path(tempfile.mkdtemp(prefix="hlp-demo-test-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@needs_kvm
def test_demo_runs_the_main_job_and_leaves_nothing(short_tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    result = subprocess.run([sys.executable, "-m", "hlplugin", "demo"], env=env,
                            capture_output=True, text=True, timeout=60)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for expected in [
        "hyperlight.dev/hypervisor     capacity 2000   allocatable 2000",
        "hyperlight.dev/device-access  capacity    1   allocatable    1",
        "hlplugin serve      /readyz 200 ready",
        "hlplugin bootstrap  /readyz 200 ready",
        "answered cdi_devices: hyperlight.dev/hypervisor=kvm",
        "deviceNode /dev/kvm (type c, rw, uid 65534, gid 65534)",
        "created a VM and ran a guest",
        "(cause: malformed, trigger: ",
        'hyperlight_cdi_repairs_total{cause="malformed"} 0 -> 1',
        "DeviceSpec container_path=/dev/kvm host_path=/dev/kvm permissions=rw",
        "hlplugin serve      exited 0",
        "hlplugin bootstrap  exited 0",
        "plugin sockets left: none",
        "summary",
        "result: OK",
    ]:
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert "could not" not in out
    assert os.listdir(short_tmp) == [], "the demo left its node root behind"
    assert processes_mentioning(str(short_tmp)) == []


def test_demo_without_a_hypervisor_explains_and_shows_the_rest(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointed at a dev dir with no kvm or mshv (as on a machine without KVM): registration,
    capacity, the plugin's refusals with their reasons and the CDI repair are still shown."""
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    dev = short_tmp / "dev"
    dev.mkdir()
    out = io.StringIO()
    code = demo(keep=True, dev_dir=dev, out=out)
    text = out.getvalue()
    assert code == 1, text
    for expected in [
        f"no kvm or mshv under {dev}",
        "hyperlight.dev/hypervisor     capacity 2000   allocatable    0",
        "hlplugin serve      /readyz 503 not ready",
        f"device: open on {dev / 'kvm'} failed",
        "could not allocate a hypervisor slot: Allocate(kvm-0) anyway: FAILED_PRECONDITION",
        "skipped: no allocation",
        "(cause: malformed, trigger: ",
        "could not grant device access: Allocate(device-access-kvm) anyway: FAILED_PRECONDITION",
        "hlplugin serve      exited 0",
        "result: this machine cannot run Hyperlight workloads: could not allocate a hypervisor "
        "slot, grant device access",
        "hlplugin doctor",
    ]:
        assert expected in text, f"{expected!r} missing from:\n{text}"
    (root,) = [p for p in short_tmp.iterdir() if p.name.startswith("hlplugin-demo-")]
    assert f"kept the node root: {root}" in text
    assert (root / "cdi" / "hyperlight.json").is_file()  # --keep keeps what was made
    assert sorted(p.name for p in (root / "device-plugins").iterdir()) == []  # sockets gone
    assert processes_mentioning(str(root)) == []
