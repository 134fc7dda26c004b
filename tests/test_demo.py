"""`hlplugin demo` end to end: real daemon processes, the in-package kubelet emulator, /dev/kvm."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import needs_kvm

from hlplugin import cli
from hlplugin.tools.demo import demo
from hlplugin.tools.demo_hold import HOLDING
from hlplugin.tools.emulator import CHECKPOINT


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: the demo's sockets live under it, and unix socket paths are capped."""
    path = Path(tempfile.mkdtemp(prefix="hlp-demo-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def processes_mentioning(text: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", re.escape(text)], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if line.split()[0] != str(os.getpid())]


def doctor_device_only(*args: str) -> subprocess.CompletedProcess[str]:
    """`hlplugin doctor --device-only`, the verdict the demo gives, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "hlplugin", "doctor", "--device-only", *args],
                          capture_output=True, text=True, timeout=60)


def explains_itself(out: str, root: Path) -> None:
    """One "why" per step, the words a newcomer needs (device plugin, CDI, the 2,000 slots, the
    bootstrap daemon), and the daemons' real command lines: the CLI parses them, and they point
    at the demo's node root."""
    flat = " ".join(out.split())
    intro, *steps = re.split(r"^(?=\d+\. )", out, flags=re.M)
    assert len(steps) >= 7, out
    for block in (intro, *steps):
        assert "\n   why: " in block, f"no why in:\n{block}"
    for phrase in ["a device plugin is a daemon on each node that tells the kubelet",
                   "CDI (Container Device Interface) is a JSON file on the node",
                   "the 2,000 slots are not 2,000 devices",
                   "the bootstrap daemon's three hyperlight.dev/device-access units are for the "
                   "main daemon's own pods"]:
        assert phrase in flat, f"{phrase!r} missing from:\n{out}"
    commands = {}
    for match in re.finditer(r"^ *\$ ((?:.*\\\n)*.*)$", out, re.M):  # "$ ..." and its continuations
        argv = shlex.split(match.group(1).replace("\\\n", " "))
        commands[argv[argv.index("hlplugin") + 1]] = argv
    assert set(commands) == {"serve", "bootstrap"}, out
    for name, argv in commands.items():
        assert argv[:3] == [sys.executable, "-m", "hlplugin"], argv
        assert cli.build_parser().parse_args(argv[3:]).command == name
        assert str(root / "device-plugins") in argv, argv


@needs_kvm
@pytest.mark.parametrize("keep", [False, True])
def test_demo_runs_the_main_job(short_tmp: Path, keep: bool) -> None:
    """As the README runs it. Without --keep it leaves nothing behind; with it, the node root and
    the daemons' logs stay, and it says where."""
    result = subprocess.run([sys.executable, "-m", "hlplugin", "demo", *(["--keep"] if keep else [])],
                            env={**os.environ, "TMPDIR": str(short_tmp)},
                            capture_output=True, text=True, timeout=60)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # The same verdict as doctor --device-only on the same machine (no kubelet needed by either).
    assert doctor_device_only().returncode == result.returncode
    root = Path(re.search(r"node root +(\S+)", out).group(1))  # type: ignore[union-attr]
    explains_itself(out, root)
    for expected in [
        "hyperlight.dev/hypervisor     capacity 2000   allocatable 2000",
        "hyperlight.dev/device-access  capacity    3   allocatable    3",
        "hlplugin serve      /readyz 200 ready", "hlplugin bootstrap  /readyz 200 ready",
        "answered cdi_devices: hyperlight.dev/hypervisor=kvm",
        "deviceNode /dev/kvm (type c, rw, uid 65534, gid 65534)",
        "created a VM and ran a guest", "(cause: malformed, trigger: ",
        'hyperlight_cdi_repairs_total{cause="malformed"} 0 -> 1',
        "DeviceSpec container_path=/dev/kvm host_path=/dev/kvm permissions=rw",
        "hlplugin serve      exited 0", "hlplugin bootstrap  exited 0",
        "plugin sockets left: none", "summary", "result: OK",
    ]:
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert "could not" not in out
    assert processes_mentioning(str(short_tmp)) == []
    if not keep:
        assert "--keep keeps it and the daemons' logs" in out
        assert "nothing was left behind" in out
        assert "kept the" not in out
        assert os.listdir(short_tmp) == [], "the demo left its node root behind"
        return
    assert list(short_tmp.iterdir()) == [root]
    logs = root / "logs"
    assert f"node root   {root} (kept, with the daemons' logs in {logs})" in out
    assert "nothing was left behind" not in out, "--keep leaves the node root and the logs"
    assert "the node root and the daemons' logs are kept (--keep)" in out
    for name, message in (("serve", "repaired CDI spec"),
                          ("bootstrap", "registered hyperlight.dev/device-access")):
        path = logs / f"{name}.log"
        assert f"kept the log of hlplugin {name}: {path}" in out
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert any(message in line["message"] for line in lines), lines
    assert (root / "cdi" / "hyperlight.json").is_file()


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
    assert doctor_device_only("--dev-dir", str(dev)).returncode == code
    assert "modprobe kvm_intel or kvm_amd" in text and "nested virtualisation" in text
    for expected in [
        f"no kvm or mshv under {dev}",
        "hyperlight.dev/hypervisor     capacity 2000   allocatable    0",
        "hlplugin serve      /readyz 503 not ready",
        f"device: device {dev / 'kvm'} is missing",
        "could not allocate a hypervisor slot: Allocate(kvm-0) anyway: FAILED_PRECONDITION",
        "skipped: no allocation", "(cause: malformed, trigger: ",
        "could not grant device access: Allocate(device-access-kvm) anyway: FAILED_PRECONDITION",
        "hlplugin serve      exited 0", "hlplugin doctor --device-only",
        "result: this machine cannot run Hyperlight workloads: could not allocate a hypervisor "
        "slot, grant device access",
    ]:
        assert expected in text, f"{expected!r} missing from:\n{text}"
    (root,) = [p for p in short_tmp.iterdir() if p.name.startswith("hlplugin-demo-")]
    assert f"kept the node root: {root}" in text
    explains_itself(text, root)
    assert "nothing was left behind" not in text
    assert f"kept the log of hlplugin serve: {root / 'logs' / 'serve.log'}" in text
    assert "repaired CDI spec" in (root / "logs" / "serve.log").read_text()
    assert (root / "cdi" / "hyperlight.json").is_file()  # --keep keeps what was made
    left = sorted(p.name for p in (root / "device-plugins").iterdir())
    assert left in ([], [CHECKPOINT]), left  # sockets gone; the kubelet's checkpoint may stay
    assert processes_mentioning(str(root)) == []


@needs_kvm
async def test_demo_hold_stays_up_allocates_on_request_and_stops_on_ctrl_c(short_tmp: Path) -> None:
    """`hlplugin demo --hold`: both daemons registered and kept running; /readyz answers 200 at the
    URL it prints, the metrics show the 2000 slots, an allocation made through the emulator from
    another process (`demo --allocate SOCKET`) and one typed at it are answered; SIGINT (Ctrl-C)
    exits 0 and leaves nothing behind."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hlplugin", "demo", "--hold", env={**os.environ, "TMPDIR": str(short_tmp)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None and proc.stdin is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):  # a guard: it holds after about a second
            while HOLDING not in lines:
                line = (await proc.stdout.readline()).decode()
                assert line, "\n".join(lines)
                lines.append(line.rstrip("\n"))
        out = "\n".join(lines)
        readyz = re.search(r"hlplugin serve +pid \d+, (http://127\.0\.0\.1:\d+)/readyz", out)
        assert readyz is not None, out
        code, body = await asyncio.to_thread(fetch, readyz.group(1) + "/readyz")
        assert code == 200 and json.loads(body)["status"] == "ready", body
        _, metrics = await asyncio.to_thread(fetch, readyz.group(1) + "/metrics")
        assert "hyperlight_devices_advertised 2000.0" in metrics
        for command in re.findall(r"^ {3}(\S+ -m hlplugin demo --allocate .*)$", out, re.M):
            done = await asyncio.to_thread(subprocess.run, shlex.split(command), capture_output=True,
                                           text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            assert done.stdout.startswith("ok: Allocate("), done.stdout
            assert ("cdi_devices: hyperlight.dev/hypervisor=kvm" in done.stdout
                    or "devices: /dev/kvm (rw)" in done.stdout), done.stdout
        proc.stdin.write(b"allocate\n")
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            while not any(line.startswith("ok: Allocate(kvm-1)") for line in lines):
                lines.append((await proc.stdout.readline()).decode().rstrip("\n"))
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = rest.decode()
    assert proc.returncode == 0, out + text
    assert "hlplugin serve      exited 0" in text and "hlplugin bootstrap  exited 0" in text
    assert os.listdir(short_tmp) == [], "the held demo left its node root behind"
    assert processes_mentioning(str(short_tmp)) == []


def fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(response.status), response.read().decode()
