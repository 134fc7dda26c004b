"""Stray signals (issue 30 #4): no signal but SIGKILL ends either daemon without its stop. A stop
signal stops it gracefully (exit 0, its socket removed); every other signal whose default action
would end it is ignored, logged once by name; SIGUSR1 logs every task. Real daemon processes, not
in a container (in a pod the daemon is PID 1, docs/security.md)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from harness import Daemon, Node, emulator, needs_kvm, needs_root, wait_until

from hlplugin.deviceplugin.process.signals import (
    DUMP_SIGNAL,
    IGNORED_SIGNALS,
    STOP_SIGNALS,
    TAKEN,
    signal_name,
)
from hlplugin.names import (
    DEVICE_ACCESS_RESOURCE,
    DEVICE_ACCESS_SOCKET,
    HYPERVISOR_RESOURCE,
    HYPERVISOR_SOCKET,
)

DAEMONS = {"serve": (HYPERVISOR_RESOURCE, HYPERVISOR_SOCKET),
           "bootstrap": (DEVICE_ACCESS_RESOURCE, DEVICE_ACCESS_SOCKET)}
RT = range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
# Each of the ignored signals but the real-time ones, and these of those (all: the burst below).
IGNORED = [s for s in IGNORED_SIGNALS if s not in RT] + [RT[0], RT[1], RT[-2], RT[-1]]
STOPS = [s for s in STOP_SIGNALS if s != signal.SIGTERM]  # SIGTERM: every daemon test


def args(daemon: str, node: Node) -> list[str]:
    if daemon == "serve":
        return node.serve_args("--hypervisor", "kvm")
    return ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(node.dev_dir),
            "--hypervisor", "kvm"]


def mask(pid: int, field: str, task: int | None = None) -> set[int]:
    """The signals in ``field`` (ShdPnd, SigBlk ...) of /proc/<pid>/status (or of one thread's)."""
    path = f"/proc/{pid}/task/{task}/status" if task else f"/proc/{pid}/status"
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            bits = int(value, 16)
            return {n for n in range(1, 65) if bits >> (n - 1) & 1}
    raise AssertionError(f"no {field} in {path}")


def lines_of(proc: Daemon, signum: int) -> list[str]:
    return [m for m in proc.messages() if m.startswith(f"ignored {signal_name(signum)}:")]


async def taken(proc: Daemon, signum: int) -> None:
    """Wait until the daemon has taken every ``signum`` sent (none is pending), then until it has
    handled them: its signals' thread takes one at a time, so a SIGUSR1 sent then is handled after
    them, and its task dump logged."""
    await wait_until(lambda: signum not in mask(proc.pid, "ShdPnd"), what=f"{signal_name(signum)} taken")
    dumps = sum("waits in" in m for m in proc.messages())
    os.kill(proc.pid, DUMP_SIGNAL)
    await wait_until(lambda: sum("waits in" in m for m in proc.messages()) > dumps,
                     what="the task dump after them")


@pytest.mark.parametrize("daemon", DAEMONS)
@pytest.mark.parametrize("signum", IGNORED, ids=signal_name)
async def test_a_stray_signal_is_ignored_and_logged_once_by_name(
        tmp_path: Path, daemon: str, signum: int) -> None:
    """Each daemon as it starts (waiting for its hypervisor: no device here): the signal's default
    action would end it."""
    (tmp_path / "dev").mkdir()
    proc = await Daemon(args(daemon, Node.make(tmp_path, dev_dir=tmp_path / "dev"))).start()
    try:
        await proc.wait_http("/healthz", 200)
        for _ in range(5):
            os.kill(proc.pid, signum)
        await taken(proc, signum)
        os.kill(proc.pid, signum)
        await taken(proc, signum)
        assert proc.exited() is None
        assert len(lines_of(proc, signum)) == 1, lines_of(proc, signum)
        await proc.wait_http("/healthz", 200)
    finally:
        code = await proc.signal(signal.SIGTERM)
    assert code == 0, "\n".join(proc.raw[-20:])


@needs_kvm
@pytest.mark.parametrize("daemon", DAEMONS)
@pytest.mark.parametrize("signum", STOPS, ids=signal_name)
async def test_a_stop_signal_stops_it_gracefully_and_removes_its_socket(
        tmp_path: Path, daemon: str, signum: int) -> None:
    resource, socket = DAEMONS[daemon]
    node = Node.make(tmp_path)
    async with emulator(node.plugin_dir) as kubelet:
        proc = await Daemon(args(daemon, node)).start()
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0)
        assert (node.plugin_dir / socket).exists()
        code = await proc.signal(signum)
    assert code == 0, "\n".join(proc.raw[-20:])
    assert not (node.plugin_dir / socket).exists()
    assert f"received {signal_name(signum)}: stopping" in proc.messages()
    assert f"hlplugin {daemon} stopping" in proc.messages()


@needs_kvm
@pytest.mark.parametrize("daemon", DAEMONS)
async def test_every_stray_signal_at_once_changes_nothing_and_sigterm_still_stops_it(
        tmp_path: Path, daemon: str) -> None:
    """All of them, the 31 real-time signals too, three times each as fast as they can be sent, at
    a daemon serving the kubelet (faulthandler on: a handler per signal once nested on its
    alternate stack until it overflowed). Every thread, gRPC's included,
    blocks them all."""
    resource, socket = DAEMONS[daemon]
    node = Node.make(tmp_path)
    stray = [s for s in sorted(TAKEN) if s not in STOP_SIGNALS and s != DUMP_SIGNAL]
    async with emulator(node.plugin_dir) as kubelet:
        proc = await Daemon(args(daemon, node)).start()
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0)
        # The one that does not is the signals' thread, waiting in sigwaitinfo: while a thread
        # waits, the kernel shows its mask without the signals it waits for.
        threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        open_to = [t for t in threads if not mask(proc.pid, "SigBlk", t) >= TAKEN]
        assert len(threads) > 3 and len(open_to) == 1, (threads, open_to)
        for _ in range(3):
            for signum in stray:
                os.kill(proc.pid, signum)
        await wait_until(lambda: not mask(proc.pid, "ShdPnd") & set(stray), what="all taken")
        await taken(proc, stray[-1])
        assert {s: len(lines_of(proc, s)) for s in stray} == dict.fromkeys(stray, 1)
        await proc.wait_http("/readyz", 200)
        assert kubelet.allocatable(resource) > 0
        code = await proc.signal(signal.SIGTERM)
    assert code == 0, "\n".join(proc.raw[-20:])
    assert not (node.plugin_dir / socket).exists()


UNSHARE = shutil.which("unshare")


def pid_1_under(unshare: int) -> int:
    """The pid (ours) of unshare's one child, which is PID 1 of its namespace."""
    [child] = Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()
    nspid = next(line for line in Path(f"/proc/{child}/status").read_text().splitlines()
                 if line.startswith("NSpid:"))
    assert nspid.split()[-1] == "1", nspid
    return int(child)


@needs_root
@pytest.mark.skipif(UNSHARE is None, reason="needs unshare (util-linux) for a PID namespace")
@pytest.mark.parametrize("daemon", DAEMONS)
async def test_as_pid_1_it_sees_every_signal_as_outside(tmp_path: Path, daemon: str) -> None:
    """As a pod's PID 1, where the kernel drops a signal whose action is the default (from the
    host too, but SIGKILL and SIGSTOP): the daemon, which blocks and takes them, still ignores a
    stray one with its line and stops gracefully on SIGHUP."""
    (tmp_path / "dev").mkdir()
    proc = Daemon(args(daemon, Node.make(tmp_path, dev_dir=tmp_path / "dev")))
    assert UNSHARE is not None
    proc.args = [UNSHARE, "--pid", "--fork", "--kill-child", *proc.args]
    await proc.start()
    try:
        await proc.wait_http("/healthz", 200)
        pid = pid_1_under(proc.pid)
        os.kill(pid, signal.SIGUSR2)
        await wait_until(lambda: len(lines_of(proc, signal.SIGUSR2)) == 1, what="SIGUSR2's line")
        os.kill(pid, signal.SIGHUP)
        code = await proc.signal(0)  # only waits: SIGHUP stops it, and unshare exits with its code
    finally:
        if proc.exited() is None:
            await proc.signal(signal.SIGKILL)
    assert code == 0, "\n".join(proc.raw[-20:])
    assert "received SIGHUP: stopping" in proc.messages()
