"""The device probers on real nodes (/dev/kvm, mknod'd substitutes) and the BoundedRunner."""

from __future__ import annotations

import asyncio
import errno
import functools
import gc
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import GUARD, Gate, mknod_char, needs_kvm, needs_root, wait_until
from support.waits import loop_turn, quiet, quiet_blocking

from hlplugin.deviceplugin.health.bounded import BoundedRunner, CheckFailed
from hlplugin.probe import (
    ProbeError,
    check_host_identity,
    close_deferred,
    probe_device,
    probe_kvm,
    probe_mshv,
)

KVM = Path("/dev/kvm")
SELF = KVM if KVM.exists() else Path("/dev/null")  # the device whose host twin is checked
NULL_NUMBERS = os.makedev(1, 3)  # /dev/null: a char device on which every KVM ioctl is ENOTTY


def open_fds() -> set[str]:
    """This process's fds as "N -> target", to compare before and after a probe."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd, or another test's thread)
    return fds


def opened_since(before: set[str], *wanted: str) -> set[str]:
    """The fds opened since ``before`` on a target naming one of ``wanted``: only those, since
    other tests' threads may open and close unrelated fds meanwhile on a busy machine."""
    return {fd for fd in open_fds() - before if any(w in fd for w in wanted)}


@needs_kvm
def test_real_kvm_passes_with_and_without_guest_leaving_no_fd_or_mapping_behind() -> None:
    def vcpu_mappings() -> int:
        return Path("/proc/self/maps").read_text().count("kvm-vcpu")

    before, maps_before = open_fds(), vcpu_mappings()
    probe_kvm(KVM, guest=False)
    probe_device("kvm", KVM.parent)
    probe_device("kvm", KVM.parent, guest=False)
    for _ in range(20):
        probe_kvm(KVM, guest=True)
    assert not opened_since(before, "kvm")
    assert vcpu_mappings() == maps_before


@needs_root
def test_substitute_nodes_that_are_the_device_pass(tmp_path: Path) -> None:
    """MSHV (absent here) on a char node that opens; the host twin with the device's numbers."""
    mknod_char(tmp_path / "mshv", NULL_NUMBERS)
    probe_mshv(tmp_path / "mshv")
    probe_device("mshv", tmp_path)
    check_host_identity(SELF, mknod_char(tmp_path / "kvm", os.stat(SELF).st_rdev))
    # No driver behind 511:511: the node is a char device, but open fails (ENXIO/ENODEV).
    with pytest.raises(ProbeError) as info:
        probe_mshv(mknod_char(tmp_path / "unbound", os.makedev(511, 511)))
    assert info.value.step == "open"
    assert info.value.errno in (errno.ENXIO, errno.ENODEV)


# --- refusals: (what is at the path, the check, the error's attributes, its whole message) -------


def _symlink(target: str | Path) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


def _char(rdev: int) -> Callable[[Path], object]:
    return lambda path: mknod_char(path, rdev)


HOST_TWIN = functools.partial(check_host_identity, SELF)
# The identity check also requires the device itself to be a character device.
ITSELF = functools.partial(check_host_identity, host_path=Path("/dev/null"))
SELF_NUMBERS = f"{os.major(os.stat(SELF).st_rdev)}:{os.minor(os.stat(SELF).st_rdev)}"
MISSING = "is missing: [Errno 2] No such file or directory"
REGULAR, SYMLINK = "is not a character device (a regular file)", "is not a character device (a symlink)"
ENOTTY = f"KVM_GET_API_VERSION on {{path}} failed: [Errno {errno.ENOTTY}] {os.strerror(errno.ENOTTY)}"
NOT_KVM = {"step": "KVM_GET_API_VERSION", "errno": errno.ENOTTY, "path": "{path}", "reason": "api_version"}
NOT_CHAR = {"reason": "not_char_device"}
Make = Callable[[Path], object] | None
REFUSALS: list[tuple[str, str, Make, Callable[[Path], None], dict[str, Any], str]] = [
    ("kvm-missing", "kvm", None, probe_kvm, {"step": "lstat", "errno": errno.ENOENT, "reason": "open"},
     f"device {{path}} {MISSING}"),
    # Only a character device is opened, and never through a symlink (upstream: lstat, O_NOFOLLOW).
    ("kvm-regular-file", "kvm", Path.touch, lambda p: probe_kvm(p, guest=False), NOT_CHAR,
     f"device {{path}} {REGULAR}"),
    ("kvm-symlink-to-the-real-node", "kvm", _symlink(SELF), probe_kvm, NOT_CHAR,
     f"device {{path}} {SYMLINK}"),
    ("kvm-symlink-by-dir", "kvm", _symlink(SELF), lambda p: probe_device("kvm", p.parent, guest=False),
     NOT_CHAR, f"device {{path}} {SYMLINK}"),
    ("kvm-char-device-not-kvm", "kvm", _char(NULL_NUMBERS), probe_kvm, NOT_KVM, ENOTTY),
    ("kvm-char-device-not-kvm-by-dir", "kvm", _char(NULL_NUMBERS), lambda p: probe_device("kvm", p.parent),
     NOT_KVM, ENOTTY),
    ("mshv-regular-file", "mshv", Path.touch, probe_mshv, NOT_CHAR, f"device {{path}} {REGULAR}"),
    ("mshv-symlink", "mshv", _symlink("/dev/null"), lambda p: probe_device("mshv", p.parent), NOT_CHAR,
     f"device {{path}} {SYMLINK}"),
    ("mshv-missing", "mshv", None, probe_mshv, {"errno": errno.ENOENT}, f"device {{path}} {MISSING}"),
    ("identity-missing", "kvm", None, HOST_TWIN, {"reason": "identity_missing", "errno": errno.ENOENT,
                                                   "path": "{path}"}, f"host device node {{path}} {MISSING}"),
    ("identity-regular-file", "kvm", Path.touch, HOST_TWIN, NOT_CHAR, f"host device node {{path}} {REGULAR}"),
    ("identity-symlink-to-the-real-node", "kvm", _symlink(SELF), HOST_TWIN, NOT_CHAR,
     f"host device node {{path}} {SYMLINK}"),
    ("identity-other-numbers", "kvm", _char(os.makedev(1, 5)), HOST_TWIN, {"reason": "identity_mismatch"},
     f"host device node {{path}} is 1:5, but {SELF} is {SELF_NUMBERS}"),
    ("identity-device-missing", "kvm", None, ITSELF, {"errno": errno.ENOENT}, f"device {{path}} {MISSING}"),
    ("identity-device-symlink-to-the-real-node", "kvm", _symlink(SELF), ITSELF, NOT_CHAR,
     f"device {{path}} {SYMLINK}"),
    ("identity-device-regular-file", "kvm", Path.touch, ITSELF, NOT_CHAR, f"device {{path}} {REGULAR}"),
]
ROOT_ONLY = {"kvm-char-device-not-kvm", "kvm-char-device-not-kvm-by-dir", "identity-other-numbers"}


@pytest.mark.parametrize(("name", "make", "check", "attributes", "message"), [
    pytest.param(*row, id=key, marks=[needs_root] if key in ROOT_ONLY else []) for key, *row in REFUSALS])
def test_what_is_not_the_device_is_refused_saying_why(
        tmp_path: Path, name: str, make: Make, check: Callable[[Path], None],
        attributes: dict[str, Any], message: str) -> None:
    path = tmp_path / name
    if make is not None:
        make(path)
    before = open_fds()
    with pytest.raises(ProbeError) as info:
        check(path)
    for attribute, want in attributes.items():
        assert getattr(info.value, attribute) == (path if want == "{path}" else want), attribute
    assert str(info.value) == message.format(path=path)
    # A descriptor opened before the failing step is closed.
    assert not opened_since(before, str(tmp_path), "/dev/", "kvm")


def test_unknown_hypervisor_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="xen"):
        probe_device("xen", tmp_path)


# --- BoundedRunner -------------------------------------------------------------------------------

def test_results_errors_and_late_helpers_reach_the_caller_only(
        gate: Gate, caplog: pytest.LogCaptureFixture) -> None:
    """The result and the very exception reach the caller; neither a returned nor an abandoned
    helper's error shows up as "never retrieved" noise, nor does a helper finishing after its loop
    closed. Sync on purpose: a helper must outlive its loop (one loop per phase), and the check
    below also covers what is logged as each loop closes."""
    boom = ValueError("boom")
    late = Gate()
    late.error = ValueError("late")

    def fail() -> None:
        quiet_blocking(0.05, "still running when the caller starts waiting")
        raise boom

    async def scenario() -> None:
        runner = BoundedRunner(budget=GUARD)
        assert await runner.run(lambda: 42) == 42
        with pytest.raises(ValueError) as info:
            await runner.run(fail)
        assert info.value is boom
        with pytest.raises(CheckFailed, match="timed out"):
            await runner.run(late, budget=0.05)
        late.release.set()
        await wait_until(lambda r=runner: not r.busy)  # type: ignore[misc]
        # A bounded watch, 50 ms: the helper is done, so a late callback is already queued on
        # this loop; a few turns deliver it.
        await quiet(0.05, "a bounded watch for a late callback on this loop")
        del runner  # the helper's future holds whatever waited on it
        gc.collect()

    outliving = BoundedRunner(budget=0.05)
    try:
        with caplog.at_level(logging.DEBUG):
            asyncio.run(scenario())
            with pytest.raises(CheckFailed, match="timed out"):
                asyncio.run(outliving.run(gate))
            gate.release.set()
            asyncio.run(wait_until(lambda: not outliving.busy, GUARD, "the helper finishing"))
            # A bounded watch, 50 ms: the helper is done; any callback it scheduled on the closed
            # loop has failed (and would have logged) by now.
            quiet_blocking(0.05, "a bounded watch for a callback on the closed loop")
    finally:
        late.release.set()
    assert not outliving.busy
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert asyncio.run(outliving.run(lambda: 8)) == 8  # a new loop reuses the runner


async def test_one_helper_at_a_time_stuck_waited_for_or_cancelled(gate: Gate) -> None:
    # Timed out: a 0.25 s budget is "0.25s" in the reason, never rounded to "0.2s" or "0.0s".
    runner = BoundedRunner(budget=0.25, name="stuck-test")
    with pytest.raises(CheckFailed) as info:
        await runner.run(gate)
    assert str(info.value).endswith("check timed out after 0.25s")
    assert (info.value.step, info.value.reason) == ("timeout", "timeout")
    assert runner.busy

    # Stuck: the next calls fail within their own budgets without starting a helper.
    count = running = peak = 0
    lock = threading.Lock()

    def other() -> int:
        nonlocal count, running, peak
        with lock:
            count += 1
            running += 1
            peak = max(peak, running)
        quiet_blocking(0.01, "each check holds the helper a while: concurrency shows")
        with lock:
            running -= 1
        return 2

    for budget in (None, 0.04, 0.04):
        with pytest.raises(CheckFailed, match="previous check is still stuck") as info:
            await runner.run(other, budget=budget)
        assert info.value.step == "budget"
    assert "still stuck after 0.04s" in str(info.value)
    assert count == 0
    assert runner.threads_started == 1
    assert sum(t.name.startswith("stuck-test-") for t in threading.enumerate()) == 1

    # A caller cancelled while it waits for the stuck helper leaves nothing behind.
    waiting = asyncio.create_task(runner.run(other, budget=GUARD))
    await loop_turn()  # one loop turn: it reaches its wait for the stuck helper
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting

    # The helper finishes while the next call waits for it, within that call's budget; then it runs.
    threading.Timer(0.2, gate.release.set).start()
    assert runner.busy
    assert await runner.run(other, budget=GUARD) == 2
    assert gate.finished.is_set()
    assert runner.threads_started == 2
    assert gate.calls == 1
    assert count == 1

    # A caller cancelled while its own helper runs leaves the helper undisturbed, the next call clean.
    for event in (gate.release, gate.started, gate.finished):
        event.clear()
    task = asyncio.create_task(runner.run(gate, budget=GUARD))
    await wait_until(gate.started.is_set)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runner.busy and not gate.finished.is_set()
    gate.release.set()
    await wait_until(gate.finished.is_set)
    assert await runner.run(lambda: 5) == 5
    assert runner.threads_started == 4

    # Concurrent callers queue: never two helpers at once.
    runner.budget = GUARD
    assert await asyncio.gather(*(runner.run(other) for _ in range(10))) == [2] * 10
    assert peak == 1
    assert runner.threads_started == 14


async def test_after_runs_once_the_answer_is_out_and_a_stuck_one_stalls_the_next_call(
        gate: Gate) -> None:
    """A lingering helper runs ``after`` past its caller's answer, before the next call; stuck in
    it, the helper is stuck as in a call: the next call times out and no helper is added."""
    runner = BoundedRunner(budget=GUARD, linger=GUARD)
    order: list[str] = []
    answered = threading.Event()

    def cleanup() -> None:
        answered.wait(GUARD)  # blocks until the caller has its answer: the answer went first
        order.append("after")

    runner.after = cleanup
    assert await runner.run(lambda: order.append("call") or 1) == 1
    answered.set()
    assert await runner.run(lambda: order.append("next") or 2) == 2
    assert order[:3] == ["call", "after", "next"]  # (and "after" again, once "next" is out)

    runner.after = gate  # stuck after the next answer
    assert await runner.run(lambda: 3) == 3
    await wait_until(gate.started.is_set)
    with pytest.raises(CheckFailed, match=r"timed out after 0\.2s"):
        await runner.run(lambda: 4, budget=0.2)
    assert runner.threads_started == 1
    gate.release.set()
    runner.after = None
    assert await runner.run(lambda: 5) == 5  # the stuck cleanup ended: the helper goes on


@needs_kvm
def test_a_check_that_closes_later_leaves_one_vm_open_until_close_deferred() -> None:
    before = open_fds()
    probe_kvm(KVM, guest=False, close_later=True)
    assert len(open_fds() - before) == 2  # the node and the VM, until the helper closes them
    probe_kvm(KVM, guest=False, close_later=True)  # the previous one is closed first: never more
    assert len(open_fds() - before) == 2
    close_deferred()
    assert open_fds() == before
    close_deferred()  # nothing left: a no-op
