"""The image (issue 7), offline: pinned, small, running the console script; and the example
workload's check as a workload runs it (its UID, PID 1, SIGTERM)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import mknod_char, needs_kvm
from support.deploy import (
    DEPLOY,
    ROOT,
    WORKLOAD_UID,
    run,
)

pytestmark = pytest.mark.deploy


def _python_for(uid: int) -> str | None:
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        with contextlib.suppress(OSError):  # not there, or not executable by that user
            if run([python, "-c", "pass"], user=uid, group=uid, extra_groups=[], timeout=30).returncode == 0:
                return python
    return None


@pytest.fixture
def workload_dir() -> Iterator[Path]:
    """A world-readable directory (pytest's tmp_path is under one the workload's UID cannot enter)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)


@needs_kvm
def test_example_check_runs_as_the_workload_and_stops_on_sigterm_as_pid_1(workload_dir: Path) -> None:
    """The example workloads' script against a CDI-style node, as the kubelet makes it: as root,
    a dev/kvm owned by the workload's UID (else dev is /dev)."""
    shutil.copy(DEPLOY / "examples/vm_check.py", workload_dir)
    cmd = [str(workload_dir / "vm_check.py"), "--dev-dir", str(workload_dir / "dev")]
    python = sys.executable
    as_workload: dict[str, Any] = {}
    if os.geteuid() != 0:
        (workload_dir / "dev").symlink_to("/dev")
    else:
        (workload_dir / "dev").mkdir(mode=0o755)
        kvm = mknod_char(workload_dir / "dev/kvm", os.stat("/dev/kvm").st_rdev)
        os.chown(kvm, WORKLOAD_UID, WORKLOAD_UID)
        as_root = run([sys.executable, *cmd])
        assert as_root.returncode == 1 and "running as root" in as_root.stderr
        python = _python_for(WORKLOAD_UID) or pytest.skip(f"no Python that UID {WORKLOAD_UID} may run")
        as_workload = {"user": WORKLOAD_UID, "group": WORKLOAD_UID, "extra_groups": []}
    result = run([python, *cmd], **as_workload)
    assert result.returncode == 0, result.stderr
    assert re.search(r"created a KVM VM as uid=(\d+) ", result.stdout), result.stdout
    assert "uid=0 " not in result.stdout

    # In a container the script is PID 1, which the kernel gives no default action for SIGTERM:
    # it must handle the signal itself, or every stop of the worker waits out the grace period
    # and ends in SIGKILL. Run as the workload would be: PID 1 of its own PID namespace, UID 65534.
    if os.geteuid() != 0:
        pytest.skip("needs root: a PID namespace and a device node owned by the workload's UID")
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        pytest.skip("needs unshare and setpriv (util-linux)")
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", setpriv, f"--reuid={WORKLOAD_UID}",
         f"--regid={WORKLOAD_UID}", "--clear-groups", python, *cmd, "--interval", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one check done: it now sleeps for 60 s
        assert "created a KVM VM" in first, first + (proc.stderr.read() if proc.stderr else "")
        (child,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        nspid = re.search(r"^NSpid:\s+(.*)$", Path(f"/proc/{child}/status").read_text(), re.M)
        assert nspid and nspid.group(1).split()[-1] == "1", "the script is PID 1 in its namespace"
        started = time.monotonic()
        os.kill(child, signal.SIGTERM)
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - started
    finally:  # unshare and the script in its namespace: a failed test leaves neither behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rest = proc.stdout.read()
    assert code == 0 and "stopping on SIGTERM" in rest, rest
    assert elapsed < 5, f"took {elapsed:.1f} s to stop"


def test_image_is_pinned_small_and_runs_the_console_script() -> None:
    # (INSTRUCTION, arguments, the comments since the one before) with continuation lines joined.
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    found = re.findall(r"((?:^[ \t]*(?:#.*)?\n)*)^[ \t]*(\w+)[ \t]+(.*)$", text, re.M)
    steps = [(op.upper(), args.strip(), "\n".join(re.findall("#.*", notes))) for notes, op, args in found]
    froms = [(i, args, notes) for i, (op, args, notes) in enumerate(steps) if op == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    first = froms[0]
    # The base is a build argument (deploy/local-node.sh passes a stand-in) whose default is the pin.
    args = dict(a.split("=", 1) for op, a, _ in steps[: first[0]] if op == "ARG" and "=" in a)
    pinned = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), first[1])
    assert re.match(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*@sha256:[0-9a-f]{64} AS \w+$", pinned)
    notes = first[2] + "\n".join(n for op, _, n in steps[: first[0]] if op == "ARG")
    assert "digest" in notes, "say beside the pin how to move it"
    stages = {args.split()[2] for _, args, _ in froms if len(args.split()) == 3}
    for _, args, _ in froms[1:]:
        assert args.split()[0] in stages, f"later stages build on the pinned one: {args}"
    final = steps[froms[-1][0] :]
    ops = {op: (args, notes) for op, args, notes in final}
    assert json.loads(ops["ENTRYPOINT"][0]) == ["hlplugin"], "exec-form ENTRYPOINT"
    assert ops["HEALTHCHECK"][0] == "NONE" and "probe" in ops["HEALTHCHECK"][1].lower()
    assert re.fullmatch(r"\d+(:\d+)?", ops["USER"][0]) and not ops["USER"][0].startswith("0")
    assert not any(op == "RUN" for op, _, _ in final), "final stage only copies"
    assert any(op == "COPY" and args.startswith("--from=") for op, args, _ in final)
    build = " ".join(args for op, args, _ in steps if op == "RUN")
    assert "compileall" in build and "a+rX" in build, "readable, precompiled for a read-only root"
    # The build context holds only what the Dockerfile copies.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.strip().startswith("#")]
    assert patterns[0] == "*"
    for op, args, _ in steps:
        if op == "COPY" and not args.startswith("--from="):
            for source in args.split()[:-1]:
                assert f"!{source}" in patterns, f"{source} is copied but ignored"
    # The ENTRYPOINT is the console script, and it serves both daemons.
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hlplugin"]
    cli = (ROOT / "src/hlplugin/cli.py").read_text()
    assert '"serve"' in cli and '"bootstrap"' in cli
