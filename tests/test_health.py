"""DeviceMonitor: conditions, freshness, cancellation, stuck probes and event-driven checks."""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import wait_until

from hlplugin.deviceplugin.conditions import HealthState, HealthTracker
from hlplugin.health import DeviceMonitor
from hlplugin.metrics import Metrics
from hlplugin.probe import ProbeError

GUARD = 10.0  # seconds; only ever reached when a test is broken
KVM = Path("/dev/kvm")
REQUIRED = ("device", "host_identity")


def ok() -> None:
    pass


async def wait_state(
    tracker: HealthTracker, predicate: Callable[[HealthState], bool]
) -> HealthState:
    """The first state satisfying ``predicate``, woken by the tracker itself (no polling)."""
    state = tracker.state
    async with asyncio.timeout(GUARD):
        while not predicate(state):
            state = await tracker.wait_for_change(state.generation)
    return state


def sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


class Gate:
    """An injected probe that blocks until released (or the guard), counting its calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self.started.set()
        self.release.wait(GUARD)


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()


class Switch:
    """An injected probe that fails with ``error`` while it is set, counting its calls."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


def monitor(tracker: HealthTracker, **kwargs: Any) -> DeviceMonitor:
    kwargs.setdefault("device_probe", ok)
    kwargs.setdefault("identity_probe", ok)
    return DeviceMonitor(tracker, "kvm", Path("/nonexistent-dev"), Path("/nonexistent-host"),
                         **kwargs)


@pytest.mark.parametrize("host_dev_dir", [Path("/nonexistent-host"), None])
async def test_healthy_probes_set_both_conditions_and_metrics(host_dev_dir: Path | None) -> None:
    """Without a host dev dir the identity condition is ok, unprobed."""
    tracker = HealthTracker(REQUIRED)
    metrics = Metrics()
    identity = {"identity_probe": ok} if host_dev_dir else {}
    mon = DeviceMonitor(tracker, "kvm", Path("/nonexistent-dev"), host_dev_dir, metrics=metrics,
                        device_probe=ok, **identity)
    state = await mon.check()
    assert state.healthy
    assert set(state.conditions) == set(REQUIRED)
    for check in REQUIRED:
        probed = check == "device" or host_dev_dir is not None
        assert sample(metrics, "hyperlight_probe_duration_seconds_count",
                      {"check": check}) == probed


async def test_failing_device_probe_is_unhealthy_with_its_reason_then_recovers() -> None:
    tracker = HealthTracker(REQUIRED)
    metrics = Metrics()
    probe = Switch()
    probe.error = ProbeError("KVM_CREATE_VM on /dev/kvm failed: [Errno 25] Inappropriate",
                             step="KVM_CREATE_VM", path=KVM, errno=25, reason="create_vm")
    mon = monitor(tracker, metrics=metrics, device_probe=probe)
    state = await mon.check()
    assert not state.healthy
    assert state.reasons == {"device": str(probe.error)}
    assert sample(metrics, "hyperlight_probe_failures_total", {"reason": "create_vm"}) == 1

    probe.error = None
    assert (await mon.check()).healthy

    probe.error = RuntimeError("surprise")
    state = await mon.check()
    assert state.reasons == {"device": "RuntimeError: surprise"}
    assert sample(metrics, "hyperlight_probe_failures_total", {"reason": "error"}) == 1


async def test_failing_identity_probe_is_unhealthy_while_the_device_is_fine() -> None:
    tracker = HealthTracker(REQUIRED)
    metrics = Metrics()
    identity = Switch()
    identity.error = ProbeError("host device node /host-dev/kvm is missing",
                                step="lstat", reason="identity_missing")
    state = await monitor(tracker, metrics=metrics, identity_probe=identity).check()
    assert state.reasons == {"host_identity": "host device node /host-dev/kvm is missing"}
    assert state.conditions["device"].ok
    assert sample(metrics, "hyperlight_probe_failures_total",
                  {"reason": "identity_missing"}) == 1


async def test_ensure_fresh_burst_probes_once_and_reprobes_after_max_age() -> None:
    now = [100.0]

    tracker = HealthTracker(REQUIRED)
    probe = Switch()
    mon = monitor(tracker, device_probe=probe, clock=lambda: now[0])
    states = await asyncio.gather(*(mon.ensure_fresh() for _ in range(50)))
    assert probe.calls == 1
    assert all(s.healthy for s in states)

    now[0] += 0.9
    await asyncio.gather(*(mon.ensure_fresh() for _ in range(10)))
    assert probe.calls == 1

    now[0] += 0.2  # 1.1 s after the check completed
    await mon.ensure_fresh()
    assert probe.calls == 2
    await mon.ensure_fresh(max_age=0.0)
    assert probe.calls == 3


async def test_cancelled_ensure_fresh_caller_neither_stops_nor_fails_the_check(gate: Gate) -> None:
    tracker = HealthTracker(REQUIRED)
    mon = monitor(tracker, device_probe=gate, budget=GUARD)
    first = asyncio.create_task(mon.ensure_fresh())  # starts the check
    await wait_until(gate.started.is_set)
    joiner = asyncio.create_task(mon.ensure_fresh())  # shares it
    patient = asyncio.create_task(mon.ensure_fresh())  # shares it, and waits it out
    await asyncio.sleep(0)  # one loop turn: both new callers reach their await on the shared check
    for caller in (first, joiner):
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    # A bounded watch, 50 ms: a report caused by the cancellations would be made on the loop
    # while they unwind (already done above), so the next turns are where it would show.
    await asyncio.sleep(0.05)
    # Cancelling callers reported nothing: the device is not checked yet, not unhealthy.
    assert tracker.state.conditions["device"].reason == "not checked yet"
    assert tracker.state.generation == 0
    gate.release.set()
    state = await wait_state(tracker, lambda s: s.healthy)  # the check's own result lands
    assert state.conditions["device"].ok
    assert (await patient).healthy
    assert gate.calls == 1


async def test_regression_cancelled_helper_does_not_poison_the_next_check(gate: Gate) -> None:
    """Regression 2 of the upstream Go plugin's review: after a caller is cancelled mid-check, the
    next check is a fresh one."""

    tracker = HealthTracker(REQUIRED)
    mon = monitor(tracker, device_probe=gate, budget=2.0)
    assert (await wait_healthy_after(mon, gate)).healthy

    gate.release.clear()
    gate.started.clear()
    caller = asyncio.create_task(mon.check())
    await wait_until(gate.started.is_set)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert tracker.state.healthy  # cancellation is not a device failure
    # The cancelled helper finishes a moment later, within the next check's budget.
    threading.Timer(0.2, gate.release.set).start()
    state = await mon.check()
    assert state.healthy, state.describe()
    assert gate.calls == 3  # the next check ran its own probe, not a leftover result
    assert mon.runner.threads_started == 3


async def wait_healthy_after(mon: DeviceMonitor, gate: Gate) -> HealthState:
    gate.release.set()
    return await mon.check()


async def test_stuck_probe_times_out_with_at_most_one_helper(gate: Gate) -> None:
    tracker = HealthTracker(REQUIRED)
    metrics = Metrics()
    mon = monitor(tracker, device_probe=gate, budget=0.2, metrics=metrics)
    state = await mon.check()
    assert state.reasons == {"device": "check timed out after 0.2s"}
    assert state.conditions["host_identity"].ok  # ran before the device probe hung
    assert sample(metrics, "hyperlight_probe_failures_total", {"reason": "timeout"}) == 1

    for _ in range(3):
        state = await mon.ensure_fresh(max_age=0.0)
        assert "still stuck" in state.reasons["device"]
        alive = [t for t in threading.enumerate() if t.name.startswith(mon.runner.name)]
        assert len(alive) <= 1
    assert gate.calls == 1
    assert mon.runner.threads_started == 1
    assert sample(metrics, "hyperlight_probe_failures_total", {"reason": "budget"}) == 3

    gate.release.set()
    mon.runner.budget = GUARD
    assert (await mon.check()).healthy


async def test_waiter_wakes_on_every_transition() -> None:
    tracker = HealthTracker(REQUIRED)
    probe = Switch()
    mon = monitor(tracker, device_probe=probe)
    seen: asyncio.Queue[HealthState] = asyncio.Queue()

    async def waiter() -> None:
        state = tracker.state
        while True:
            state = await tracker.wait_for_change(state.generation)
            await seen.put(state)

    task = asyncio.create_task(waiter())
    try:
        for failing in (False, True, False, True):
            probe.error = RuntimeError("down") if failing else None
            await mon.check()
            async with asyncio.timeout(GUARD):
                state = await seen.get()
            assert state.healthy is not failing
        await mon.check()  # no transition: no wake-up
        await asyncio.sleep(0.05)
        assert seen.empty()
    finally:
        task.cancel()


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

    tracker = HealthTracker(REQUIRED)
    mon = DeviceMonitor(tracker, "kvm", dev, host, interval=3600,
                        device_probe=exists(dev / "kvm"), identity_probe=exists(host / "kvm"))
    task = asyncio.create_task(mon.run())
    try:
        await wait_state(tracker, lambda s: s.healthy)
        for node, condition in ((dev / "kvm", "device"), (host / "kvm", "host_identity")):
            node.unlink()
            state = await wait_state(tracker, lambda s: not s.healthy)
            assert state.reasons == {condition: f"{node} is missing"}
            node.touch()
            await wait_state(tracker, lambda s: s.healthy)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of the host device node needs root")
@pytest.mark.skipif(not KVM.exists(), reason="needs /dev/kvm")
async def test_regression_host_node_disappearance_publishes_unhealthy(tmp_path: Path) -> None:
    """Regression 1 of the upstream Go plugin's review: our /dev/kvm keeps working, but the host
    node new pods get is gone."""
    host = tmp_path / "host-dev"
    host.mkdir()
    if os.statvfs(host).f_flag & os.ST_NODEV:
        pytest.skip(f"{host} is mounted nodev")
    rdev = os.stat(KVM).st_rdev
    node = host / "kvm"

    def make_node() -> None:
        os.mknod(node, stat.S_IFCHR | 0o600, rdev)

    make_node()

    tracker = HealthTracker(REQUIRED)
    # The real identity check; the device probe is injected so that only identity is at stake.
    mon = DeviceMonitor(tracker, "kvm", KVM.parent, host, interval=3600, device_probe=ok)
    task = asyncio.create_task(mon.run())
    try:
        await wait_state(tracker, lambda s: s.healthy)
        node.unlink()
        state = await wait_state(tracker, lambda s: not s.healthy)
        assert set(state.reasons) == {"host_identity"}
        assert f"host device node {node} is missing" in state.reasons["host_identity"]
        make_node()
        await wait_state(tracker, lambda s: s.healthy)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_never_checks_more_often_than_the_floor(tmp_path: Path) -> None:
    """An interval of 0 (an in-process caller; the CLI refuses it) is not a busy loop."""
    from hlplugin.deviceplugin.conditions import MIN_PERIOD

    checks: list[float] = []

    def clock() -> float:  # called once at the end of every check
        checks.append(time.monotonic())
        return checks[-1]

    mon = DeviceMonitor(HealthTracker(REQUIRED), "kvm", tmp_path, None, interval=0,
                        device_probe=ok, clock=clock)
    task = asyncio.create_task(mon.run())
    try:
        await wait_until(lambda: len(checks) >= 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # The watcher's start may wake the loop once; the checks after it are periodic.
    gaps = [b - a for a, b in itertools.pairwise(checks[1:5])]
    assert min(gaps) >= MIN_PERIOD * 0.9, gaps
