"""DeviceMonitor: conditions, freshness, cancellation, stuck probes and event-driven checks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from harness import GUARD, Gate, mknod_char, needs_kvm, needs_root, split_settings, wait_until
from support.observers import Calls
from support.waits import loop_turn, quiet

from hlplugin.deviceplugin.health.conditions import MIN_PERIOD, HealthState, HealthTracker
from hlplugin.health import DeviceMonitor
from hlplugin.metrics import Metrics
from hlplugin.probe import ProbeError
from hlplugin.settings import HealthSettings

KVM = Path("/dev/kvm")
REQUIRED = ("device", "host_identity")


async def wait_state(mon: DeviceMonitor, predicate: Callable[[HealthState], bool]) -> HealthState:
    """The first state satisfying ``predicate``, woken by the tracker itself (no polling)."""
    state = mon.tracker.state
    async with asyncio.timeout(GUARD):
        while not predicate(state):
            state = await mon.tracker.wait_for_change(state.generation)
    return state


def sample(mon: DeviceMonitor, name: str, **labels: str) -> float:
    assert mon.metrics is not None
    return mon.metrics.registry.get_sample_value(f"hyperlight_probe_{name}", labels) or 0.0


@contextlib.asynccontextmanager
async def running(mon: DeviceMonitor) -> AsyncIterator[None]:
    """``mon.run()`` as a task for the block; cancelled after it, and seen to end so."""
    task = asyncio.create_task(mon.run())
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def monitor(dev: Path = Path("/nonexistent-dev"), host: Path | None = Path("/nonexistent-host"),
            **kwargs: Any) -> DeviceMonitor:
    """A monitor with its own tracker and metrics; probes that pass unless given (the identity
    probe only with a host dev dir; ``identity_probe=None`` is the real check)."""
    kwargs.setdefault("device_probe", lambda: None)
    kwargs.setdefault("identity_probe", (lambda: None) if host else None)
    if "budget" in kwargs:
        kwargs["probe_timeout"] = kwargs.pop("budget")
    settings, rest = split_settings(HealthSettings, kwargs, dev_dir=dev, host_dev_dir=host)
    return DeviceMonitor(HealthTracker(REQUIRED), "kvm", settings, metrics=Metrics().proofs, **rest)


@pytest.mark.parametrize("host_dev_dir", [Path("/nonexistent-host"), None])
async def test_healthy_probes_set_both_conditions_and_metrics(host_dev_dir: Path | None) -> None:
    """Without a host dev dir the identity condition is ok, unprobed."""
    state = await (mon := monitor(host=host_dev_dir)).check()
    assert state.healthy
    assert set(state.conditions) == set(REQUIRED)
    for check in REQUIRED:
        probed = check == "device" or host_dev_dir is not None
        assert sample(mon, "duration_seconds_count", check=check) == probed


async def test_failing_probes_set_their_reasons_and_metrics_and_every_change_wakes_waiters() -> None:
    probe, identity = Gate(released=True), Gate(released=True)
    mon = monitor(device_probe=probe, identity_probe=identity)

    async def check() -> HealthState:
        """A check that changes the state, and a waiter woken with that very state."""
        woken = asyncio.create_task(mon.tracker.wait_for_change(mon.tracker.state.generation))
        state = await mon.check()
        async with asyncio.timeout(GUARD):
            assert await woken == state
        return state

    assert (await check()).healthy
    probe.error = ProbeError("KVM_CREATE_VM on /dev/kvm failed: [Errno 25] Inappropriate",
                             step="KVM_CREATE_VM", path=KVM, errno=25, reason="create_vm")
    state = await check()
    assert not state.healthy
    assert state.reasons == {"device": str(probe.error)}
    assert sample(mon, "failures_total", reason="create_vm") == 1

    probe.error = None
    assert (await check()).healthy

    probe.error = RuntimeError("surprise")
    assert (await check()).reasons == {"device": "RuntimeError: surprise"}
    assert sample(mon, "failures_total", reason="error") == 1

    # The identity probe fails while the device is fine.
    probe.error = None
    identity.error = ProbeError("host device node /host-dev/kvm is missing",
                                step="lstat", reason="identity_missing")
    state = await check()
    assert state.reasons == {"host_identity": "host device node /host-dev/kvm is missing"}
    assert state.conditions["device"].ok
    assert sample(mon, "failures_total", reason="identity_missing") == 1

    woken = asyncio.create_task(mon.tracker.wait_for_change(mon.tracker.state.generation))
    await mon.check()  # no transition: no wake-up
    await quiet(0.05, "a bounded watch: a wake-up would be one loop turn away")
    assert not woken.done()
    woken.cancel()


async def test_cancelled_callers_and_stuck_probes_fail_nothing_and_poison_nothing(gate: Gate) -> None:
    mon = monitor(device_probe=gate, budget=GUARD)
    runs = Calls(mon.runner, "run")
    first = asyncio.create_task(mon.for_allocate())  # starts the check
    await wait_until(gate.started.is_set)
    joiner = asyncio.create_task(mon.for_allocate())  # arrived after it began: the next one
    patient = asyncio.create_task(mon.for_allocate())  # the same, and waits it out
    await loop_turn()  # one loop turn: both new callers reach their await on the next check
    for caller in (first, joiner):
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    # A bounded watch, 50 ms: a report caused by the cancellations would be made on the loop
    # while they unwind (already done above), so the next turns are where it would show.
    await quiet(0.05, "a bounded watch for a report the cancellations would cause")
    # Cancelling callers reported nothing: the device is not checked yet, not unhealthy.
    assert mon.tracker.state.conditions["device"].reason == "not checked yet"
    assert mon.tracker.state.generation == 0
    gate.release.set()
    state = await wait_state(mon, lambda s: s.healthy)  # the check's own result lands
    assert state.conditions["device"].ok
    assert (await patient).healthy
    # The first check's Allocate probe and, since nothing was proven yet, its full probe; then
    # the next check's Allocate probe for the callers that came while the first ran.
    assert gate.calls == 3

    # Regression 2 of the upstream Go plugin's review: after a caller is cancelled mid-check, the
    # next check is a fresh one.
    mon.runner.budget = 2.0
    gate.release.clear()
    gate.started.clear()
    caller = asyncio.create_task(mon.check())
    await wait_until(gate.started.is_set)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert mon.tracker.state.healthy  # cancellation is not a device failure
    # The cancelled helper finishes a moment later, within the next check's budget.
    threading.Timer(0.2, gate.release.set).start()
    state = await mon.check()
    assert state.healthy, state.describe()
    assert gate.calls == 5  # the next check ran its own probe, not a leftover result
    assert runs.began == 5

    # A stuck probe times out, and while it is stuck no further helper starts.
    mon.runner.budget = 0.2
    gate.release.clear()
    state = await mon.check()
    assert state.reasons == {"device": "check timed out after 0.2s"}
    assert state.conditions["host_identity"].ok  # ran before the device probe hung
    assert sample(mon, "failures_total", reason="timeout") == 1
    started = mon.runner.threads_started
    for _ in range(3):
        state = await mon.for_allocate()
        assert "still stuck" in state.reasons["device"]
        assert mon.runner.threads_started == started  # no helper started next to the stuck one
        assert mon.runner.busy
    assert gate.calls == 6
    assert sample(mon, "failures_total", reason="budget") == 3
    gate.release.set()
    mon.runner.budget = GUARD
    assert (await mon.check()).healthy


async def test_run_reacts_to_node_events_without_waiting_for_the_interval(tmp_path: Path) -> None:
    dev, host = tmp_path / "dev", tmp_path / "host-dev"
    dev.mkdir()
    host.mkdir()
    (dev / "kvm").touch()
    (host / "kvm").touch()

    def exists(path: Path) -> Callable[[], None]:
        def probe() -> None:
            if not path.exists():
                raise ProbeError(f"{path} is missing", step="lstat", reason="identity_missing")
        return probe

    mon = monitor(dev, host, interval=3600, device_probe=exists(dev / "kvm"),
                  identity_probe=exists(host / "kvm"))
    async with running(mon):
        await wait_state(mon, lambda s: s.healthy)
        for node, condition in ((dev / "kvm", "device"), (host / "kvm", "host_identity")):
            node.unlink()
            state = await wait_state(mon, lambda s: not s.healthy)
            assert state.reasons == {condition: f"{node} is missing"}
            node.touch()
            await wait_state(mon, lambda s: s.healthy)


@needs_root
@needs_kvm
async def test_regression_host_node_disappearance_publishes_unhealthy(tmp_path: Path) -> None:
    """Regression 1 of the upstream Go plugin's review: our /dev/kvm keeps working, but the host
    node new pods get is gone."""
    (tmp_path / "host-dev").mkdir()
    node = mknod_char(tmp_path / "host-dev" / "kvm", os.stat(KVM).st_rdev)
    # The real identity check; the device probe is injected so that only identity is at stake.
    mon = monitor(KVM.parent, node.parent, interval=3600, identity_probe=None)
    async with running(mon):
        await wait_state(mon, lambda s: s.healthy)
        node.unlink()
        state = await wait_state(mon, lambda s: not s.healthy)
        assert set(state.reasons) == {"host_identity"}
        assert f"host device node {node} is missing" in state.reasons["host_identity"]
        mknod_char(node, os.stat(KVM).st_rdev)
        await wait_state(mon, lambda s: s.healthy)


async def test_run_never_checks_more_often_than_the_floor(tmp_path: Path) -> None:
    """An interval of 0 (an in-process caller; the CLI refuses it) is not a busy loop."""
    checks: list[float] = []  # when each check's device probe ran

    async with running(monitor(tmp_path, None, interval=0,
                               device_probe=lambda: checks.append(time.monotonic()))):
        await wait_until(lambda: len(checks) >= 5)
    # The watcher's start may wake the loop once; the checks after it are periodic.
    gaps = [b - a for a, b in itertools.pairwise(checks[1:5])]
    assert min(gaps) >= MIN_PERIOD * 0.9, gaps


async def test_identity_check_switched_off_is_reported_as_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--host-dev-dir '': the condition holds (nothing to compare), and says it is off rather than
    healthy, in its reason (which /readyz shows) and in the log."""
    import logging

    mon = monitor(tmp_path, None)
    with caplog.at_level(logging.INFO):
        state = await mon.check()
    assert state.healthy
    identity = state.conditions["host_identity"]
    assert identity.ok and identity.reason == ("off: the host identity check is off "
                                               "(--host-dev-dir is empty)")
    messages = [r.getMessage() for r in caplog.records]
    assert "condition host_identity is off: the host identity check is off (--host-dev-dir is empty)" \
        in messages
    assert not any(m.startswith("condition host_identity is healthy") for m in messages)
    assert "condition device is healthy" in messages
