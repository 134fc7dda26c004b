"""The condition-producer primitive and the daemon runner, in process: supervised watchers,
bounded passes, the first pass run once, and a failing root task."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from pathlib import Path

import pytest
from harness import wait_until
from support.observers import Calls
from support.waits import loop_turn, quiet

from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import SPEC_FILE, render_spec
from hlplugin.deviceplugin.health import producer as producer_module
from hlplugin.deviceplugin.health.bounded import BoundedRunner, CheckFailed
from hlplugin.deviceplugin.health.conditions import HealthTracker, until_tick
from hlplugin.deviceplugin.health.producer import Producer, Trigger
from hlplugin.deviceplugin.health.watch import supervise
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.metrics import DaemonMetrics
from hlplugin.deviceplugin.process.daemon import Daemon, DaemonSpec, Started
from hlplugin.deviceplugin.settings import HttpSettings, KubeletSettings
from hlplugin.settings import CdiSettings


async def test_a_dead_child_is_logged_once_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    starts = 0
    settled = asyncio.Event()

    async def watcher() -> None:
        nonlocal starts
        starts += 1
        if starts <= 3:
            raise OSError(24, "Too many open files")
        settled.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.DEBUG, logger="hlplugin.deviceplugin.health.watch"):
        task = asyncio.create_task(supervise("watching /x", watcher, restart_after=0.01))
        await settled.wait()
        task.cancel()
        await asyncio.wait({task})
    assert starts == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["watching /x failed (OSError: [Errno 24] Too many open files); "
                        "restarting it, periodic checks cover the gap"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2


async def test_a_pass_past_its_budget_fails_without_blocking_the_loop() -> None:
    release = threading.Event()
    outcomes: list[str] = []

    async def step(trigger: str) -> bool:
        try:
            await producer.runner.run(release.wait)
        except CheckFailed as exc:
            outcomes.append(str(exc))
            return False
        outcomes.append("ok")
        return True

    producer = Producer("stuck", step, budget=0.2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await quiet(0.01, "a ticker's pace: the loop turns meanwhile")

    ticking = asyncio.create_task(ticker())
    try:
        assert not await producer.check("start")
        assert outcomes == ["check timed out after 0.2s"]
        assert ticks >= 5  # the loop ran other tasks while the pass waited on its helper
        # The stuck helper holds the runner: the next pass fails within its budget, no new thread.
        assert not await producer.check(Trigger.DEMAND)
        assert "still stuck" in outcomes[-1] and producer.runner.threads_started == 1
    finally:
        release.set()
        ticking.cancel()
    producer.runner.budget = 10.0
    assert await producer.check("retry")


async def test_run_goes_on_from_a_pass_that_already_ran() -> None:
    """Start-up's pass (in setup, before registering) is the first: run() does not repeat it.
    Without one, run() starts with its own."""
    triggers: list[str] = []

    async def step(trigger: str) -> bool:
        triggers.append(trigger)
        return True

    for first in ("setup", None):
        triggers.clear()
        producer = Producer("once", step, interval=0)  # the floor: a pass every 0.1 s
        if first is not None:
            await producer.check(first)
        running = asyncio.create_task(producer.run())
        try:
            await wait_until(lambda: len(triggers) >= 3, what="three passes")
        finally:
            running.cancel()
            await asyncio.wait({running})
        assert triggers[:3] == ([first, "periodic", "periodic"] if first
                                else ["start", "periodic", "periodic"])


async def test_a_failing_root_task_is_one_log_line_and_exit_1(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = HealthTracker()
    lifecycle = PluginLifecycle(KubeletSettings(tmp_path), "x.sock", "example.com/x",
                                lambda: TrackedDevicePlugin(["x-0"], tracker))

    async def broken() -> None:
        await loop_turn()
        raise ValueError("the disk is on fire")

    async def patient() -> None:
        await asyncio.Event().wait()

    async def nothing() -> None:
        return None

    async def setup(_: None) -> Started:
        return Started(lifecycle, {"patient": patient(), "broken": broken()})

    spec = DaemonSpec("example daemon", HttpSettings(("127.0.0.1", 0)), tracker,
                      DaemonMetrics("example"), nothing, setup)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        await Daemon(spec).run()
    assert exited.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "example daemon: root task broken failed: ValueError: the disk is on fire; exiting"]
    assert errors[0].task == "broken"  # type: ignore[attr-defined]


async def test_root_tasks_failing_together_are_one_log_line_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two root tasks that fail in the same loop iteration (neither awaits, so the group cannot
    cancel the second first): each gets its line, in the order the tasks were started."""
    tracker = HealthTracker()
    lifecycle = PluginLifecycle(KubeletSettings(tmp_path), "x.sock", "example.com/x",
                                lambda: TrackedDevicePlugin(["x-0"], tracker))

    async def broken(what: str) -> None:
        raise ValueError(what)

    async def nothing() -> None:
        return None

    async def setup(_: None) -> Started:
        return Started(lifecycle, {"first": broken("one"), "second": broken("two")})

    spec = DaemonSpec("example daemon", HttpSettings(("127.0.0.1", 0)), tracker,
                      DaemonMetrics("example"), nothing, setup)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        await Daemon(spec).run()
    assert exited.value.code == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "example daemon: root task first failed: ValueError: one; exiting",
        "example daemon: root task second failed: ValueError: two; exiting"]


async def test_a_lingering_runner_reuses_its_helper_then_lets_it_go() -> None:
    """One read per Allocate must not start a thread per Allocate; an idle runner holds none."""
    runner = BoundedRunner(budget=5.0, name="linger-test", linger=0.2)
    for n in range(20):
        assert await runner.run(lambda n=n: n * 2) == n * 2  # type: ignore[misc]
    assert runner.threads_started == 1

    def helpers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("linger-test")]

    assert helpers()
    await wait_until(lambda: not helpers(), 5, "the idle helper to end")
    assert await runner.run(lambda: "again") == "again"
    assert runner.threads_started == 2


async def test_cdi_ensure_skips_the_read_only_while_inotify_saw_nothing(tmp_path: Path) -> None:
    """With the directory's watch live and quiet, an Allocate's check costs no read at all; a
    change the kernel queued but the loop has not read yet still makes it read (and repair)."""
    desired = render_spec("kvm", 65534, 65534)
    tracker = HealthTracker(required=("cdi",))
    rec = CdiReconciler(CdiSettings(tmp_path, interval=3600), desired, tracker=tracker)
    passes = Calls(rec.producer, "check")
    path = tmp_path / SPEC_FILE
    assert (await rec.reconcile("start")).ok
    running = asyncio.create_task(rec.run())
    try:
        watcher = rec.producer.wakeup.watchers[0]
        await wait_until(lambda: watcher.live_fd is not None, 5, "the watch")
        # The watch reports every name when it starts: one more pass, then quiet.
        await wait_until(lambda: passes.ended >= 2 and rec.producer.in_flight is None, 5,
                         "the pass the watch starts with")
        assert (await rec.ensure()).ok
        reads = Calls(rec.producer.runner, "run")
        for _ in range(10):
            assert (await rec.ensure()).ok
        assert reads.began == 0  # quiet: no read

        # Rewritten in place, same size; ensure() runs before the loop reads the inotify event.
        tampered = desired.replace(b'"rw"', b'"rx"')
        path.write_bytes(tampered)  # truncates and writes the same inode
        assert (await rec.ensure()).ok
        assert reads.began > 0
        assert path.read_bytes() == desired
    finally:
        running.cancel()
        await asyncio.wait({running})


def test_triggers_and_repair_causes_read_as_their_plain_words() -> None:
    """The enums keep label values and log text exactly the words they replaced."""
    from hlplugin.deviceplugin.health.producer import Trigger
    from hlplugin.metrics import CDI_REFUSAL_REASONS, CDI_REPAIR_CAUSES, RepairCause

    assert [f"{t}" for t in Trigger] == ["start", "watch", "periodic", "retry", "demand",
                                         "allocate"]
    record = logging.makeLogRecord({"msg": "trigger: %s", "args": (Trigger.WATCH,)})
    assert record.getMessage() == "trigger: watch"  # as the log lines format it
    assert CDI_REPAIR_CAUSES == ("missing", "malformed", "stale", "metadata")
    assert CDI_REFUSAL_REASONS == ("not_regular", "write_failed")
    assert json.dumps({"cause": RepairCause.STALE}) == '{"cause": "stale"}'


async def test_periodic_passes_of_one_period_share_a_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two producers of the same interval, started apart, wait for the same ticks of the loop's
    clock (one wake-up for both on an idle node), never less than a period apart, and pass after
    each; each producer's passes run in one helper thread that waits between them (none started
    per pass). Asserted on the ticks they wait for and the order of waits and passes, not on when
    the passes land, which a busy machine delays."""
    loop = asyncio.get_running_loop()
    period = 0.3
    events: dict[str, list[tuple[str, float]]] = {"a": [], "b": []}  # ("tick", t) or ("pass", t)

    def recorded(interval: float, now: float) -> float:
        delay = until_tick(interval, now)
        events[asyncio.current_task().get_name()].append(("tick", now + delay))  # type: ignore[union-attr]
        return delay

    monkeypatch.setattr(producer_module, "until_tick", recorded)

    def producer(name: str) -> Producer:
        async def step(trigger: Trigger) -> bool:
            if trigger is Trigger.PERIODIC:
                events[name].append(("pass", loop.time()))
            return True

        async def step_in_helper(trigger: Trigger) -> bool:
            return await made.runner.run(lambda: True) and await step(trigger)

        made = Producer(name, step_in_helper, interval=period)
        producers.append(made)
        return made

    def passes(name: str) -> int:
        return sum(kind == "pass" for kind, _ in events[name])

    producers: list[Producer] = []
    first = asyncio.create_task(producer("a").run(), name="a")
    await quiet(0.13, "out of phase, were passes timed from each one's start")
    second = asyncio.create_task(producer("b").run(), name="b")
    try:
        await wait_until(lambda: passes("a") >= 3 and passes("b") >= 2, 10, "periodic passes")
    finally:
        first.cancel()
        second.cancel()
        await asyncio.wait([first, second])
    for name, seen in events.items():
        kinds = [kind for kind, _ in seen]
        # Order: a wait for a tick, then the pass it wakes (the last wait may not have ended).
        assert kinds[: 2 * passes(name)] == ["tick", "pass"] * passes(name), seen
        ticks = [t for kind, t in seen if kind == "tick"]
        # Every tick waited for is a multiple of the period: the same ticks for both producers.
        assert all(abs(t / period - round(t / period)) < 1e-6 for t in ticks), ticks
        assert all(round((b - a) / period) >= 1 for a, b in itertools.pairwise(ticks)), ticks
        waited = iter(seen[: 2 * passes(name)])
        for (_, tick), (_, passed) in zip(waited, waited, strict=True):
            assert passed >= tick - 0.001, seen  # not before its tick
    assert [made.runner.threads_started for made in producers] == [1, 1]
