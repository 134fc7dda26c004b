"""The device probers on real nodes (/dev/kvm, mknod'd substitutes) and the BoundedRunner."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import wait_until

from hlplugin.deviceplugin.bounded import BoundedRunner, CheckFailed
from hlplugin.probe import (
    ProbeError,
    check_host_identity,
    probe_device,
    probe_kvm,
    probe_mshv,
)

KVM = Path("/dev/kvm")
KVM_USABLE = KVM.exists() and os.access(KVM, os.R_OK | os.W_OK)
needs_kvm = pytest.mark.skipif(not KVM_USABLE, reason="needs a read/write /dev/kvm")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of device nodes needs root")
NULL_NUMBERS = os.makedev(1, 3)  # /dev/null: a char device on which every KVM ioctl is ENOTTY
ZERO_NUMBERS = os.makedev(1, 5)


def mknod_char(path: Path, rdev: int) -> Path:
    """A character node at ``path``; skips where the filesystem does not honour device nodes."""
    if os.statvfs(path.parent).f_flag & os.ST_NODEV:
        pytest.skip(f"{path.parent} is mounted nodev: device nodes there cannot be opened")
    os.mknod(path, stat.S_IFCHR | 0o600, rdev)
    return path


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def vcpu_mappings() -> int:
    return Path("/proc/self/maps").read_text().count("kvm-vcpu")


# --- KVM -----------------------------------------------------------------------------------------


@needs_kvm
def test_real_kvm_passes_with_and_without_guest() -> None:
    probe_kvm(KVM, guest=False)
    probe_kvm(KVM, guest=True)
    probe_device("kvm", KVM.parent)
    probe_device("kvm", KVM.parent, guest=False)


@needs_kvm
def test_real_kvm_probe_leaves_no_fd_or_mapping_behind() -> None:
    before, maps_before = open_fds(), vcpu_mappings()
    for _ in range(20):
        probe_kvm(KVM, guest=True)
    assert open_fds() == before
    assert vcpu_mappings() == maps_before


@needs_root
def test_non_kvm_char_device_fails_at_api_version_with_enotty(tmp_path: Path) -> None:
    node = mknod_char(tmp_path / "kvm", NULL_NUMBERS)
    before = open_fds()
    with pytest.raises(ProbeError) as info:
        probe_kvm(node)
    err = info.value
    assert err.step == "KVM_GET_API_VERSION"
    assert err.errno == errno.ENOTTY
    assert err.path == node
    assert err.reason == "api_version"
    assert str(err) == (f"KVM_GET_API_VERSION on {node} failed: "
                        f"[Errno {errno.ENOTTY}] {os.strerror(errno.ENOTTY)}")
    assert open_fds() == before  # the fd opened before the failing ioctl is closed
    with pytest.raises(ProbeError, match="KVM_GET_API_VERSION"):
        probe_device("kvm", tmp_path)


# --- refusals without a device: (what is at the path, the check, what it must say) ---------------


def _regular(path: Path) -> None:
    path.write_bytes(b"")


def _symlink(target: str | Path) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


SELF = KVM if KVM.exists() else Path("/dev/null")  # the device whose host twin is checked
Make = Callable[[Path], None] | None
REFUSALS: dict[str, tuple[str, Make, Callable[[Path], None], dict[str, Any], str]] = {
    # id: (node name, what is put there, the check on it, the error's attributes, message text)
    "kvm-missing": ("kvm", None, lambda p: probe_kvm(p),
                    {"step": "open", "errno": errno.ENOENT, "reason": "open"},
                    "open on {path} failed: [Errno 2]"),
    "kvm-regular-file": ("kvm", _regular, lambda p: probe_kvm(p, guest=False),
                         {"step": "KVM_GET_API_VERSION", "errno": errno.ENOTTY}, ""),
    "mshv-regular-file": ("mshv", _regular, lambda p: probe_mshv(p),
                          {"reason": "not_char_device"}, "not a character device (a regular file"),
    "mshv-symlink": ("mshv", _symlink("/dev/null"), lambda p: probe_device("mshv", p.parent),
                     {"reason": "not_char_device"}, "not a character device (a symlink"),
    "mshv-missing": ("mshv", None, lambda p: probe_mshv(p), {"errno": errno.ENOENT}, "{path}"),
    "identity-missing": ("kvm", None, lambda p: check_host_identity(SELF, p),
                         {"reason": "identity_missing", "errno": errno.ENOENT, "path": "{path}"},
                         "host device node {path} is missing"),
    "identity-regular-file": ("kvm", _regular, lambda p: check_host_identity(SELF, p),
                              {"reason": "not_char_device"},
                              "not a character device (a regular file"),
    "identity-symlink-to-the-real-node": ("kvm", _symlink(SELF),
                                          lambda p: check_host_identity(SELF, p),
                                          {"reason": "not_char_device"}, "a symlink"),
}


@pytest.mark.parametrize(("name", "make", "check", "attributes", "message"),
                         list(REFUSALS.values()), ids=list(REFUSALS))
def test_what_is_not_the_device_is_refused_saying_why(
        tmp_path: Path, name: str, make: Make, check: Callable[[Path], None],
        attributes: dict[str, Any], message: str) -> None:
    path = tmp_path / name
    if make is not None:
        make(path)
    with pytest.raises(ProbeError) as info:
        check(path)
    for attribute, want in attributes.items():
        assert getattr(info.value, attribute) == (path if want == "{path}" else want), attribute
    assert message.format(path=path) in str(info.value)


def test_unknown_hypervisor_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="xen"):
        probe_device("xen", tmp_path)


# --- MSHV (no /dev/mshv here: substitute nodes) ---------------------------------------------------


@needs_root
def test_mshv_char_device_that_opens_passes(tmp_path: Path) -> None:
    mknod_char(tmp_path / "mshv", NULL_NUMBERS)
    probe_mshv(tmp_path / "mshv")
    probe_device("mshv", tmp_path)


@needs_root
def test_mshv_char_device_that_does_not_open_fails(tmp_path: Path) -> None:
    # No driver behind 511:511: the node is a char device, but open fails (ENXIO/ENODEV).
    node = mknod_char(tmp_path / "mshv", os.makedev(511, 511))
    with pytest.raises(ProbeError) as info:
        probe_mshv(node)
    assert info.value.step == "open"
    assert info.value.errno in (errno.ENXIO, errno.ENODEV)


# --- host identity --------------------------------------------------------------------------------


@needs_root
def test_host_identity_matching_node_passes(tmp_path: Path) -> None:
    host = mknod_char(tmp_path / "kvm", os.stat(SELF).st_rdev)
    check_host_identity(SELF, host)


@needs_root
def test_host_identity_other_numbers_fail(tmp_path: Path) -> None:
    host = mknod_char(tmp_path / "kvm", ZERO_NUMBERS)
    rdev = os.stat(SELF).st_rdev
    with pytest.raises(ProbeError) as info:
        check_host_identity(SELF, host)
    assert info.value.reason == "identity_mismatch"
    assert f"is 1:5, but {SELF} is {os.major(rdev)}:{os.minor(rdev)}" in str(info.value)


def test_host_identity_requires_the_device_itself(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match=r"device .* is missing") as info:
        check_host_identity(tmp_path / "kvm", Path("/dev/null"))
    assert info.value.errno == errno.ENOENT
    (tmp_path / "kvm").write_bytes(b"")
    with pytest.raises(ProbeError, match="not a character device") as info:
        check_host_identity(tmp_path / "kvm", Path("/dev/null"))
    assert info.value.reason == "not_char_device"


# --- BoundedRunner -------------------------------------------------------------------------------

GUARD = 10.0  # seconds; only ever reached when a test is broken


class Gate:
    """A blocking fn for the runner: records calls, blocks until released (or the guard)."""

    def __init__(self, result: int = 1) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.calls = 0
        self.result = result

    def __call__(self) -> int:
        self.calls += 1
        self.started.set()
        self.release.wait(GUARD)
        self.finished.set()
        return self.result


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()  # never leave a helper stuck past its test


def helpers(runner: BoundedRunner) -> int:
    return sum(t.name.startswith(runner.name + "-") for t in threading.enumerate())


def test_runner_returns_the_result() -> None:
    runner = BoundedRunner()
    assert asyncio.run(runner.run(lambda: 42)) == 42


def test_runner_propagates_the_exception() -> None:
    boom = ValueError("boom")

    def fail() -> None:
        raise boom

    with pytest.raises(ValueError) as info:
        asyncio.run(BoundedRunner().run(fail))
    assert info.value is boom


def test_helper_errors_reach_the_caller_only(caplog: pytest.LogCaptureFixture) -> None:
    """Neither a returned nor an abandoned helper's error shows up as "never retrieved" noise."""
    release = threading.Event()

    def fail() -> None:
        time.sleep(0.05)  # still running when the caller starts waiting
        raise ValueError("boom")

    def fail_late() -> None:
        release.wait(GUARD)
        raise ValueError("late")

    async def scenario() -> None:
        runner = BoundedRunner(budget=GUARD)
        with pytest.raises(ValueError, match="boom"):
            await runner.run(fail)
        with pytest.raises(CheckFailed, match="timed out"):
            await runner.run(fail_late, budget=0.05)
        release.set()
        await wait_until(lambda r=runner: not r.busy)  # type: ignore[misc]
        # A bounded watch, 50 ms: the helper is done, so a late callback is already queued on
        # this loop; a few turns deliver it.
        await asyncio.sleep(0.05)
        del runner  # the helper's future holds whatever waited on it
        gc.collect()

    try:  # sync on purpose: the check below also covers what is logged as the loop closes
        with caplog.at_level(logging.DEBUG):
            asyncio.run(scenario())
    finally:
        release.set()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_stuck_helper_times_out_and_blocks_a_second_helper(gate: Gate) -> None:
    runner = BoundedRunner(budget=0.2, name="stuck-test")
    with pytest.raises(CheckFailed, match=r"timed out after 0\.2s") as info:
        await runner.run(gate)
    assert (info.value.step, info.value.reason) == ("timeout", "timeout")
    assert runner.busy

    count = 0

    def other() -> int:
        nonlocal count
        count += 1
        return 2

    for _ in range(3):
        with pytest.raises(CheckFailed, match="previous check is still stuck") as info:
            await runner.run(other)
        assert info.value.step == "budget"
    assert count == 0
    assert runner.threads_started == 1
    assert helpers(runner) == 1

    gate.release.set()
    assert await runner.run(other, budget=GUARD) == 2
    assert runner.threads_started == 2
    assert gate.calls == 1


async def test_a_sub_second_budget_is_reported_as_it_is(gate: Gate) -> None:
    """A 0.25 s budget is "0.25s" in the reason, never rounded to "0.2s" or "0.0s"."""
    runner = BoundedRunner(budget=0.25, name="quarter-test")

    with pytest.raises(CheckFailed) as info:
        await runner.run(gate)
    assert str(info.value).endswith("check timed out after 0.25s")
    with pytest.raises(CheckFailed) as again:
        await runner.run(gate, budget=0.04)
    assert "still stuck after 0.04s" in str(again.value)


async def test_next_call_waits_for_a_helper_that_finishes_within_its_budget(gate: Gate) -> None:
    runner = BoundedRunner(budget=0.1)

    with pytest.raises(CheckFailed, match="timed out"):
        await runner.run(gate)
    threading.Timer(0.2, gate.release.set).start()
    # The previous helper is still running when this call starts; it waits and then runs.
    assert runner.busy
    assert await runner.run(lambda: 3, budget=GUARD) == 3
    assert gate.finished.is_set()


async def test_cancelled_caller_leaves_the_helper_running_and_the_next_call_clean(gate: Gate) -> None:
    runner = BoundedRunner(budget=GUARD)

    task = asyncio.create_task(runner.run(gate))
    await wait_until(gate.started.is_set)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runner.busy and not gate.finished.is_set()  # the helper was not disturbed
    gate.release.set()
    await wait_until(gate.finished.is_set)
    assert await runner.run(lambda: 5) == 5
    assert runner.threads_started == 2


async def test_caller_cancelled_while_waiting_for_a_stuck_helper(gate: Gate) -> None:
    runner = BoundedRunner(budget=0.1)

    with pytest.raises(CheckFailed, match="timed out"):
        await runner.run(gate)
    waiting = asyncio.create_task(runner.run(lambda: 0, budget=GUARD))
    await asyncio.sleep(0)  # one loop turn: it reaches its wait for the stuck helper
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.release.set()
    assert await runner.run(lambda: 6, budget=GUARD) == 6
    assert runner.threads_started == 2


async def test_concurrent_callers_never_run_two_helpers_at_once() -> None:
    runner = BoundedRunner(budget=GUARD)
    running = 0
    peak = 0
    lock = threading.Lock()

    def work() -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return 1

    assert await asyncio.gather(*(runner.run(work) for _ in range(10))) == [1] * 10
    assert peak == 1
    assert runner.threads_started == 10


def test_helper_finishing_after_its_loop_closed_is_quiet(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    # Sync on purpose: the helper must outlive the loop that started it, so one loop per step.
    runner = BoundedRunner(budget=0.05)
    with pytest.raises(CheckFailed, match="timed out"):
        asyncio.run(runner.run(gate))
    with caplog.at_level(logging.DEBUG):
        gate.release.set()
        asyncio.run(wait_until(lambda: not runner.busy, GUARD, "the helper finishing"))
        # A bounded watch, 50 ms: the helper is done; any callback it scheduled on the closed
        # loop has failed (and would have logged) by now.
        time.sleep(0.05)
    assert not runner.busy
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert asyncio.run(runner.run(lambda: 8)) == 8  # a new loop reuses the runner
