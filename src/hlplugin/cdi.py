"""The CDI reconciler: keeps ``<cdi_dir>/hyperlight.json`` equal to the spec, and says so.

The file's content is cdi_spec's; keeping it without trusting the path (no-follow reads, atomic
exchange, never replacing what is not ours) is OwnedFile's. This module decides when to look and
what to tell: condition ``cdi`` for the health tracker, the repair and refusal counters, and the
log. A pass (the producer's: inspect, repair if needed, publish) runs on start, every interval,
on every change inotify sees, and when an Allocate finds the spec not right; a read (a byte
compare of the file) is what most Allocates cost.

While this instance stands by for another that serves the socket (a surge rollout; see
deviceplugin/kubelet/role.py) a pass only looks: the other release may render a different spec
(e.g. ``deviceUid``), and two reconcilers would rewrite it in turn. The look still fails on what
a write could not mend (not a regular file, unreadable storage, a spec of ours that is not well
formed), so a broken release stays NotReady and halts its rollout; taking over, the instance
writes its spec before it registers.

The DRA driver's instances hold no socket in common (each pod serves its own): a ``turn`` decides
instead, in the pass's thread and around the whole pass (deviceplugin/kubelet/dra/writer.py: the
instance the kubelet registered last writes, under a node-wide lock). A pass outside its turn is a
standby's look; the pass that gets the turn after another instance's first removes leftover
temporary files (no other instance writes meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import operator
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from hlplugin.cdi_spec import MAX_READ, MODE, SPEC_FILE, well_formed
from hlplugin.deviceplugin.health import repeats
from hlplugin.deviceplugin.health.bounded import CheckFailed
from hlplugin.deviceplugin.health.conditions import Condition, HealthTracker
from hlplugin.deviceplugin.health.fresh import Fresh
from hlplugin.deviceplugin.health.producer import Producer, Trigger
from hlplugin.deviceplugin.health.watch import FILE_EVENTS, DirWatcher
from hlplugin.deviceplugin.kubelet.role import Role
from hlplugin.deviceplugin.ownedfile import NotRegular, OwnedFile
from hlplugin.dirs import exposure, not_a_directory
from hlplugin.metrics import ProofMetrics, Refusal, RepairCause
from hlplugin.names import ConditionName
from hlplugin.settings import CdiSettings

log = logging.getLogger(__name__)

CONDITION = ConditionName.CDI
# How long the pass's helper thread waits for the next read: one per Allocate needs no new thread.
_LINGER = 1.0
# In a pass's thread, around the whole pass: whether this instance writes (see the module docstring).
Turn = Callable[[], AbstractContextManager[bool]]


@dataclass(frozen=True)
class _Outcome:
    """What one pass found and did; applied to condition, tracker and metrics on the event loop."""

    condition: Condition
    repaired: RepairCause | None = None  # the repair's cause, when we rewrote the file
    refused: Refusal | None = None
    right: bool = True  # the file is exactly the spec (False: a standby left it as it found it)


class CdiReconciler:
    """Keeps ``<cdi_dir>/hyperlight.json`` equal to ``desired``; reports condition ``cdi``."""

    CONDITIONS = (CONDITION,)

    def __init__(
        self,
        settings: CdiSettings,
        desired: bytes,
        *,
        tracker: HealthTracker | None = None,
        metrics: ProofMetrics | None = None,
        max_backoff: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        log_interval: float = repeats.INTERVAL,
        warnings: list[str] | None = None,
        role: Role | None = None,
        turn: Turn | None = None,
    ) -> None:
        """``warnings``: kept, in place, the problems of the directory's exposure (see
        ``dirs.exposure``): the daemon's /readyz lists them without failing readiness.
        ``role``: while it stands by, passes only look; ``turn``: a pass outside it only looks
        (see the module docstring)."""
        self.cdi_dir = cdi_dir = settings.dir
        self.warnings = warnings
        self.exposed: dict[Path, str] = {}  # the latest pass's dirs.exposure
        interval, budget = settings.interval, settings.budget
        self._trust_quiet = settings.trust_quiet
        self.lines = repeats.RepeatedLines(log, log_interval, clock=clock)
        self.file = OwnedFile(cdi_dir, SPEC_FILE, MODE)
        self.path = self.file.path
        self.desired = desired
        self.interval = interval
        self.max_backoff = max_backoff
        self.condition = Condition(False, "not checked yet")
        self._tracker = tracker
        self._metrics = metrics
        # Passes run one at a time in the producer's runner (at most one helper thread, even
        # after a caller gave up), bounded by ``budget``: hung storage fails the condition.
        self.producer = Producer(
            "cdi", self._one_pass, watch=[DirWatcher(cdi_dir, {SPEC_FILE, ""}, events=FILE_EVENTS)],
            interval=interval, max_backoff=max_backoff, budget=budget, linger=_LINGER,
            clock=clock)
        # Concurrent Allocates share one read (the freshness primitive): one that began before
        # a caller arrived answers it if the watch stayed quiet since; a wrong read or a timeout
        # in flight answers at once (a pass or a refusal follows, either safe).
        self._reads = Fresh(self._read, name="cdi-read", settles=operator.not_,
                            mark=self.producer.wakeup.pulse, vouch=self.producer.wakeup.quiet_since)
        # When the latest read that found the spec right began (a quick read or a pass), and the
        # watch pulse taken just before it.
        self._verified: tuple[float, asyncio.Event] | None = None
        self._role = role
        self._turn = turn
        self._writing = False  # the latest pass had the turn (read and set in the pass's thread)
        if role is not None:
            role.on_take_over(self._take_over)

    async def ensure(self) -> Condition:
        """Before every Allocate: the condition, resting on a read that began after the call
        arrived (or on an earlier one that inotify vouches for), off the event loop and bounded.

        Each round judges the first state that holds; after three rounds a pass decides:

            vouched  right, and a right read began after we arrived, or less than
                     trust_quiet before with the watch quiet since     -> answer ok
            stuck    a helper hangs in storage, condition failing      -> answer it at once
            passing  a pass is in flight: share it; it failed          -> answer it
                                                    it succeeded       -> next round
            failing  condition failing, no pass in flight              -> run a pass, answer it
            reading  a read shared through the freshness primitive (health/fresh.py): one
                     begun after we arrived, or one in flight with the watch quiet since:
                     right -> next round (vouched); wrong -> run a pass, answer it; timed
                     out -> fail the condition, answer it

        A change made while a shared read or pass ran is never answered with its stale result.
        """
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        for _ in range(3):
            if self.condition.ok and self._still_right(arrived, loop.time()):
                return self.condition  # vouched
            if self.producer.runner.busy and not self.condition.ok:
                return self.condition  # stuck: passes queued behind it would only wait their budget
            if (in_flight := self.producer.in_flight) is not None:  # passing
                await asyncio.shield(in_flight)
                if not self.condition.ok:
                    return self.condition
                continue
            if not self.condition.ok:
                break  # failing
            try:  # reading
                if not await self._reads.fresh():
                    break
            except CheckFailed as exc:
                if self.condition.ok:
                    self._publish(self._timed_out(exc), Trigger.ALLOCATE)
                return self.condition
        return await self.reconcile(Trigger.ALLOCATE)

    def _still_right(self, arrived: float, now: float) -> bool:
        """The last right read began after ``arrived``, or recently with nothing changed since."""
        verified = self._verified
        return verified is not None and (
            verified[0] >= arrived
            or (now - verified[0] < self._trust_quiet
                and self.producer.wakeup.quiet_since(verified[1])))

    async def reconcile(self, trigger: Trigger) -> Condition:
        """One full pass (inspect, repair if needed, publish the outcome), bounded."""
        await self.producer.check(trigger)
        return self.condition

    async def _one_pass(self, trigger: Trigger) -> bool:
        began, pulse = asyncio.get_running_loop().time(), self.producer.wakeup.pulse()
        standby = self._role is not None and self._role.standby
        exposed: dict[Path, str] | None = None
        try:
            outcome, exposed = await self.producer.runner.run(
                functools.partial(self._inspect, standby))
        except CheckFailed as exc:
            outcome = self._timed_out(exc)
        self._publish(outcome, trigger)
        if exposed is not None:
            self._publish_exposure(exposed)
        if not outcome.right:  # once per interval: the tracker keeps no reason for a holding one
            self.lines.log("standby", logging.INFO, "%s", outcome.condition.reason)
        if outcome.condition.ok and outcome.right:
            self._verify(began, pulse)
        return outcome.condition.ok

    def _timed_out(self, exc: CheckFailed) -> _Outcome:
        return _Outcome(Condition(False, f"cannot check {self.path}: {exc} (its storage does not "
                                         f"answer)"))

    async def _read(self) -> bool:
        """One read of the file, bounded: whether it is exactly the spec (then recorded)."""
        began, pulse = asyncio.get_running_loop().time(), self.producer.wakeup.pulse()
        right = await self.producer.runner.run(self._is_current)
        if right:
            self._verify(began, pulse)
        return right

    def _verify(self, began: float, pulse: asyncio.Event) -> None:
        """Record a right read that began at ``began``; a later one is never replaced by an
        earlier one finishing late."""
        if self._verified is None or began >= self._verified[0]:
            self._verified = (began, pulse)

    def _is_current(self) -> bool:
        with contextlib.suppress(OSError, NotRegular):
            found = self.file.read(len(self.desired) + 1)
            return found is not None and found[0] == self.desired and self.file.metadata_right(found[1])
        return False

    def _publish(self, outcome: _Outcome, trigger: Trigger) -> None:
        """On the event loop: the pass's outcome to the condition, the tracker, metrics and log."""
        if outcome.repaired:  # one line per cause and interval; the counter counts each
            self.lines.log(outcome.repaired, logging.INFO, "repaired CDI spec %s (cause: %s, "
                           "trigger: %s)", self.path, outcome.repaired, trigger,
                           extra={"cause": outcome.repaired, "trigger": trigger})
            if self._metrics is not None:
                self._metrics.cdi_repairs.labels(cause=outcome.repaired).inc()
        if outcome.refused and self._metrics is not None:
            self._metrics.cdi_refusals.labels(reason=outcome.refused).inc()
        new = outcome.condition
        if self._tracker is not None:
            self._tracker.set_condition(CONDITION, new.ok, new.reason)
        elif not new.ok and new != self.condition:
            self.lines.log(new.reason, logging.WARNING, "CDI spec unhealthy: %s", new.reason)
        self.condition = new

    def _publish_exposure(self, exposed: dict[Path, str]) -> None:
        """On the event loop: a directory found exposed is a warning at the first pass that finds
        it so (or so differently), and a line when that ends; the gauge and the warnings always."""
        gone = dict.fromkeys(self.exposed.keys() - exposed.keys(), "")  # or a symlink re-pointed
        for path, problem in {**exposed, **gone}.items():
            before = self.exposed.get(path, "")
            if problem and problem != before:
                self.lines.log(("exposed", problem), logging.WARNING, "%s", problem,
                               extra={"directory": str(path)})
            elif before and not problem:
                log.info("%s is no longer exposed to others than root", path,
                         extra={"directory": str(path)})
            if self._metrics is not None:
                self._metrics.cdi_dir_exposed.labels(directory=str(path)).set(1 if problem else 0)
        self.exposed = exposed
        if self.warnings is not None:
            self.warnings[:] = [problem for problem in exposed.values() if problem]

    def _inspect(self, standby: bool) -> tuple[_Outcome, dict[Path, str]]:
        """In the runner's thread: the pass (a look only, while standing by or outside our
        turn), then how the directory is exposed."""
        if self._turn is None:
            outcome = self._look() if standby else self._check_and_repair()
        else:
            outcome = self._in_turn(self._turn)
        return outcome, exposure(self.cdi_dir, os.geteuid())

    def _in_turn(self, turn: Turn) -> _Outcome:
        try:
            with turn() as mine:
                if mine and not self._writing:  # another instance wrote until now
                    self.file.cleanup_leftovers()
                self._writing = mine
                return self._check_and_repair() if mine else self._look()
        except (OSError, NotRegular) as exc:  # the writers' record is not ours to use
            self._writing = False
            reason = f"cannot tell which instance writes {self.path}: {exc} (refusing to write)"
            return _Outcome(Condition(False, reason))

    def _check_and_repair(self) -> _Outcome:
        """In the runner's thread (one at a time): inspect, and repair if needed."""
        try:
            cause = self._diagnose()
            if cause:
                self.file.replace(self.desired)
        except NotRegular as exc:
            reason = f"{self.path} is {exc}; refusing to replace what we do not own"
            return _Outcome(Condition(False, reason), refused=Refusal.NOT_REGULAR)
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, "unknown error")
            problem = not_a_directory(self.cdi_dir) if exc.errno in (errno.EEXIST, errno.ENOTDIR) else ""
            reason = f"cannot write {self.path}: {problem or exc.strerror} ({name})"
            return _Outcome(Condition(False, reason), refused=Refusal.WRITE_FAILED)
        return _Outcome(Condition(True), repaired=cause)

    def _look(self) -> _Outcome:
        """A standby's pass, in the runner's thread: what a write would do, without writing."""
        if not well_formed(self.desired):
            return _Outcome(Condition(False, "the CDI spec this release renders is not well formed"))
        try:
            cause = self._diagnose()
        except NotRegular as exc:
            reason = f"{self.path} is {exc}; refusing to replace what we do not own"
            return _Outcome(Condition(False, reason), refused=Refusal.NOT_REGULAR)
        if cause is None:
            return _Outcome(Condition(True))
        return _Outcome(Condition(True, f"standby: {self.path} is not this release's spec "
                                        f"({cause}); written when this instance takes over"),
                        right=False)

    def _diagnose(self) -> RepairCause | None:
        """The repair cause, or None when the file is right. Raises NotRegular."""
        try:
            found = self.file.read(MAX_READ)
        except PermissionError:
            return RepairCause.METADATA  # a regular file we may not read: its mode or owner is wrong
        except OSError:
            return RepairCause.MALFORMED  # unreadable (EIO, ...): rewriting is the best we can do
        if found is None:
            return RepairCause.MISSING
        content, st = found
        if content != self.desired:
            return RepairCause.STALE if well_formed(content) else RepairCause.MALFORMED
        return None if self.file.metadata_right(st) else RepairCause.METADATA

    async def run(self) -> None:
        """Reconcile on every change to our file or directory, every ``interval`` seconds, and,
        while failing, with capped exponential backoff (the first pass unless one already ran).
        Runs until cancelled."""
        # A holder's temp file may be in flight; with a turn, a pass cleans up (in its turn).
        if self._turn is None and (self._role is None or not self._role.standby):
            await self._clean_up()
        await self.producer.run()

    async def _take_over(self) -> None:
        """A standby now holds the socket: what it left alone is ours to make right."""
        await self._clean_up()
        await self.reconcile(Trigger.DEMAND)

    async def _clean_up(self) -> None:
        try:
            await self.producer.runner.run(self.file.cleanup_leftovers)
        except CheckFailed as exc:
            log.warning("could not look for leftover temp files in %s: %s", self.cdi_dir, exc)
