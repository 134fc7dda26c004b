"""Repeated log lines aggregated (deviceplugin.health.repeats): the aggregator with an injected clock, and
the floods it exists for, a CDI spec overwritten rapidly and a flapping condition, with the
metrics still counting every event."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import wait_until
from support.waits import quiet

from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import SPEC_FILE, render_spec
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.health.repeats import RepeatedLines
from hlplugin.deviceplugin.process.daemon import track_health_metrics
from hlplugin.metrics import Metrics
from hlplugin.settings import CdiSettings

INTERVAL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record of logger "hlplugin.test-repeats", as written."""
    captured: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = captured.append  # type: ignore[method-assign]
    logger = logging.getLogger("hlplugin.test-repeats")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield captured
    finally:
        logger.removeHandler(handler)


def events(records: list[logging.LogRecord], text: str = "") -> int:
    """How many events the lines containing ``text`` stand for."""
    return sum(getattr(r, "repeated", 1) for r in records if text in r.getMessage())


def test_a_repeating_cause_is_logged_at_once_then_once_an_interval_with_its_count(
        records: list[logging.LogRecord]) -> None:
    clock = Clock()
    lines = RepeatedLines(logging.getLogger("hlplugin.test-repeats"), INTERVAL, clock=clock)
    for n in range(1000):  # 10 a second for 100 s
        clock.now = 1000 + n / 10
        lines.log("malformed", logging.INFO, "repaired %s (trigger: %s)", "spec", f"t{n}",
                  extra={"cause": "malformed"})
    assert [r.getMessage() for r in records] == [
        "repaired spec (trigger: t0)",  # the first, plainly, at once
        "repaired spec (trigger: t600) (600 times in the last 60 s)"]  # the latest, counted
    assert records[1].repeated == 600 and records[1].cause == "malformed"  # type: ignore[attr-defined]
    assert all(r.levelno == logging.INFO for r in records)
    assert records[0].filename == "test_repeats.py"  # the line that logged it, as logger.log says
    clock.now = 1060 + INTERVAL
    lines.flush()  # the interval's end: what waits is written
    assert records[-1].getMessage() == "repaired spec (trigger: t999) (399 times in the last 60 s)"
    assert events(records) == 1000  # every event in some line, none twice
    lines.flush()
    assert len(records) == 3  # nothing more waits
    # Quiet for an interval: the next one is a first one again.
    clock.now += INTERVAL
    lines.log("malformed", logging.INFO, "repaired %s (trigger: %s)", "spec", "later")
    assert records[-1].getMessage() == "repaired spec (trigger: later)"


def test_causes_are_apart_and_what_waits_is_written_oldest_first(
        records: list[logging.LogRecord]) -> None:
    clock = Clock()
    lines = RepeatedLines(logging.getLogger("hlplugin.test-repeats"), INTERVAL, clock=clock,
                          max_causes=3)
    for state in ("up", "down", "up", "down", "up"):  # a flap: each state is its own cause
        lines.log(state, logging.WARNING, "now %s", state)
        clock.now += 1
    assert [r.getMessage() for r in records] == ["now up", "now down"]
    clock.now += INTERVAL
    lines.flush()
    assert [r.getMessage() for r in records[2:]] == [  # the last line says what happened last
        "now down (1 time in the last 64 s)", "now up (2 times in the last 65 s)"]
    # More causes than it keeps: those past the bound share one line.
    records.clear()
    clock.now += INTERVAL
    for n in range(10):
        lines.log(f"cause {n}", logging.WARNING, "cause %d", n)
    assert [r.getMessage() for r in records] == ["cause 0", "cause 1", "cause 2", "cause 3"]
    clock.now += INTERVAL
    lines.flush()
    assert records[-1].getMessage() == "cause 9 (6 times in the last 60 s)"
    assert events(records) == 10


async def test_what_waits_is_written_at_the_interval_end_without_another_event(
        records: list[logging.LogRecord]) -> None:
    lines = RepeatedLines(logging.getLogger("hlplugin.test-repeats"), 0.05)  # the real clock
    for _ in range(5):
        lines.log("cause", logging.WARNING, "it broke")
    assert len(records) == 1
    await wait_until(lambda: len(records) == 2, 10, "the interval's line, from a timer")
    assert records[1].getMessage().startswith("it broke (4 times in the last 0 s)")


def test_a_flapping_condition_logs_a_bounded_number_of_lines_and_every_transition_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    """A host node that flaps 5 times a second for 100 s: 1,000 transitions, a handful of
    lines, and the transitions counter has every one."""
    clock = Clock()
    tracker = HealthTracker(required=("host_identity",), clock=clock)
    metrics = Metrics()
    track_health_metrics(tracker, metrics.daemon)
    with caplog.at_level(logging.INFO, logger="hlplugin.deviceplugin.health.conditions"):
        for n in range(1000):
            clock.now = 1000 + n / 10
            tracker.set_condition("host_identity", n % 2 == 1, "host device node is 1:3, not 10:232")
        clock.now += INTERVAL
        tracker.lines.flush()
    lines = [r for r in caplog.records if r.name == "hlplugin.deviceplugin.health.conditions"]
    # Per state: the first, one a minute (100 s: one), the rest at the end.
    assert len(lines) == 6, [r.getMessage() for r in lines]
    assert events(lines, "is unhealthy") == events(lines, "is healthy") == 500
    assert lines[-1].getMessage().startswith("condition host_identity is healthy (")  # as it is
    assert tracker.state.generation == 1000

    def transitions(to: str) -> float:
        return metrics.registry.get_sample_value("hyperlight_health_transitions_total",
                                                 {"to": to}) or 0.0

    # Overall health flips on each but the first (from "not checked yet", unhealthy too).
    assert transitions("healthy") == 500 and transitions("unhealthy") == 499


async def test_a_spec_overwritten_rapidly_is_repaired_every_time_and_logged_bounded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Garbage written over the spec 100 times a second for 2 s, seen by inotify: every write
    repaired and counted, at most a line a cause and interval (here 0.5 s), and every repair in
    some line once the last interval ended."""
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    metrics = Metrics()
    desired = render_spec("kvm", 65534, 65534)
    rec = CdiReconciler(CdiSettings(cdi_dir, interval=3600), desired, metrics=metrics.proofs,
                        log_interval=0.5)

    def repairs() -> float:
        return metrics.registry.get_sample_value("hyperlight_cdi_repairs_total",
                                                 {"cause": "malformed"}) or 0.0

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "repaired CDI spec" in r.getMessage()
                and "malformed" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="hlplugin.cdi"):
        task = asyncio.create_task(rec.run())
        try:
            await wait_until(lambda: (cdi_dir / SPEC_FILE).exists(), 10, "the first write")
            loop = asyncio.get_running_loop()
            began = loop.time()
            for n in range(200):
                temp = cdi_dir / "tamper"
                temp.write_bytes(b"{not json %d" % n)
                os.replace(temp, cdi_dir / SPEC_FILE)
                await quiet(0.01, "paces the flood; the repairs run meanwhile")
            flood = loop.time() - began
            await wait_until(lambda: (cdi_dir / SPEC_FILE).read_bytes() == desired, 10,
                             "the last write repaired")
            await wait_until(lambda: events(lines()) == repairs(), 10,
                             "every repair in some line, once the last interval ended")
        finally:
            task.cancel()
            await asyncio.wait({task})
    assert repairs() >= 20, repairs()  # a flood (each write is repaired unless the next came first)
    # The first line, then at most one an interval (and the one that waited at the end).
    assert len(lines()) <= (flood + 10) / 0.5 + 2, (flood, [r.getMessage() for r in lines()])
    assert len(lines()) < repairs() / 4
