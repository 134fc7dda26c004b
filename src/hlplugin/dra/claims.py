"""The DRA driver's answers to the kubelet: which CDI devices a claim gets, gated on the same proofs
as the main daemon's Allocate, and remembered in a checkpoint across restarts.

Preparing a claim changes nothing on the node: the CDI spec is the node's one hyperlight.json,
kept by the CDI reconciler whether or not any claim is prepared (docs/dra.md: the driver takes the
device plugin's spec over, and declares the device in no second spec). What a claim was answered
is what the checkpoint keeps, so that a repeated Prepare (the kubelet retries, and calls again
after its own restart) gets the same devices, and an Unprepare knows what it undoes.

- Prepare: every call first asks for the CDI spec (the inotify-vouched read): without it no
  claim is answered, recorded or new, since the runtime could not resolve the CDI device named.
  A claim already recorded then gets its recorded answer, whatever the device's health: after a
  kubelet restart the kubelet prepares every running pod's claims again, and refusing them would
  fail pods that hold their device already (their health shows through the health stream). Only
  a new claim passes the device check (begun after the call): an unusable device refuses the
  call's new claims, with the reason, and records none of them; a usable one records each new
  claim before it is answered.
- Unprepare: forgets the claims it knows and accepts those it does not (the kubelet retries an
  Unprepare until it succeeds, and a pod's end must never wait on us for a claim we never had).
- The checkpoint: a corrupt file is refused loudly (Prepare answers why, /readyz says it) and
  left as it is for the operator; a refused record is read again at every call (a trusted one
  at every change, and whenever its file changed), so moving it aside mends the driver without a
  restart.
- Recorded claims only: answered from memory while memory is the record (ClaimPreparer says why
  that holds with two instances sharing the record).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from hlplugin.deviceplugin.health.bounded import BoundedRunner, CheckFailed
from hlplugin.deviceplugin.health.conditions import Condition, HealthState
from hlplugin.deviceplugin.kubelet.dra.checkpoint import Checkpoint, Corrupt, InstanceLock
from hlplugin.deviceplugin.kubelet.dra.draservice import ClaimRef, Prepared, PreparedDevice
from hlplugin.deviceplugin.ownedfile import NotRegular
from hlplugin.dra.record import Entry, Pin, entry
from hlplugin.metrics import ClaimResult, PrepareResult, UnprepareResult
from hlplugin.names import DRA_DRIVER

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKPOINT_FILE = "checkpoint.json"
LOCK_FILE = "checkpoint.lock"  # every instance's (a surge runs two): see checkpoint.InstanceLock
_LOCK_POLL = 0.01  # seconds between tries while another instance holds the lock
CHECKPOINT_KIND = f"{DRA_DRIVER}/prepared-claims"
CHECKPOINT_BUDGET = 5.0  # seconds one read or write of the checkpoint may take: hung storage

# The main daemon's Allocate gate (CDI read, then a device check begun after the call): a new claim.
Gate = Callable[[], Awaitable[HealthState]]
# The CDI read alone (CdiReconciler.ensure): every claim, recorded or new.
CdiCheck = Callable[[], Awaitable[Condition]]
# The devices of ours a claim was allocated: the control plane's answer (issue 31, item 3).
Allocation = Callable[[ClaimRef], Awaitable[tuple[PreparedDevice, ...]]]


class NotAllocated(Exception):
    """The claim has no device of ours to prepare; ``str()`` says why (the kubelet shows it)."""


def node_device(pool: str, hypervisor: str, cdi_name: str) -> Allocation:
    """The one device this node publishes (pool = node name, device = the hypervisor), serving all
    of the claim's requests: right while the node's slice holds that one shareable device. Reading
    the claim's allocation from the API server replaces it (docs/dra.md)."""
    device = PreparedDevice((), pool, hypervisor, (cdi_name,))

    async def allocation(claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        return (device,)

    return allocation


def _no_cdi(cdi: Condition) -> str:
    return (f"{DRA_DRIVER}: the node's CDI spec cannot resolve the hypervisor device: "
            f"cdi: {cdi.reason}")


class ClaimPreparer:
    """The driver's Preparer (deviceplugin.kubelet.dra.draservice): changes one call at a time, so the
    checkpoint on disk is always the record of every answer given.

    A Prepare whose claims are all recorded is answered from memory, without the instances'
    lock, a read or a write (the kubelet calls again for every claim of a pod it restarts, and
    after its own restart): only the CDI check is asked. Memory answers only while it is the
    record: when the record's file is still the one we last read or wrote (``Pin``), checked
    after the last await, with nothing in between. Otherwise the call takes the locked path,
    which reads the record anew. Why that is enough with two instances sharing the record:

    - Another instance that unprepared one of our remembered claims wrote a new record, so the
      file changed and we read anew: the claim is new again, passes the device check and is
      recorded before it is answered. Answering it from stale memory instead would tell the
      kubelet "prepared" for a claim the record no longer holds; after a restart of ours that
      claim would no longer count as recorded (a device that is unhealthy by then would refuse
      the running pod's claim when the kubelet prepares it again).
    - Another instance's change that lands after our check is ordered after our answer, as it
      would be had we held the lock: the kubelet does not unprepare a claim while it prepares it.
    - A claim we answer from memory was recorded before it was first answered, so the answer is
      the recorded one, byte for byte what the locked path would give.
    """

    def __init__(self, checkpoint: Checkpoint, gate: Gate, allocation: Allocation, *,
                 cdi: CdiCheck, budget: float = CHECKPOINT_BUDGET, lock_wait: float | None = None,
                 on_change: Callable[[int], None] | None = None,
                 on_result: Callable[[ClaimResult], None] | None = None) -> None:
        """``gate``: for a new claim; ``cdi``: for every claim (the module docstring says why);
        ``budget``: of each read or write of the record; ``lock_wait``: how long a call waits
        for another instance's change (default: the budget); ``on_change(count)``: the number
        of prepared claims, after each change;
        ``on_result(result)``: each claim's outcome (a PrepareResult or an UnprepareResult),
        for the metrics."""
        self.checkpoint = checkpoint
        self._gate = gate
        self._cdi = cdi
        self._allocation = allocation
        self.runner = BoundedRunner(budget, name="dra-checkpoint")
        self._instances = InstanceLock(checkpoint.file.directory, LOCK_FILE)
        self._lock_wait = budget if lock_wait is None else lock_wait
        self._claims: dict[str, Entry] | None = None  # None: not loaded, or refused
        self._pin: Pin | None = None  # the record's file _claims came from, if any
        self.problem = "the checkpoint is not read yet"
        self._refused = False
        self._lock = asyncio.Lock()
        self._on_change = on_change
        self._on_result = on_result

    @property
    def prepared(self) -> dict[str, Entry]:
        return dict(self._claims or {})

    def condition(self) -> tuple[bool, str]:
        """/readyz's "checkpoint": the record is read and trusted."""
        return self._claims is not None, self.problem

    async def load(self) -> bool:
        """Read the checkpoint; False (and ``problem`` says why, loudly) when it is refused."""
        path = self.checkpoint.path
        try:
            entries, pin = await self.runner.run(self._read)
            claims = {uid: entry(uid, value) for uid, value in entries.items()}
        except Corrupt as exc:
            return self._refuse(f"{exc}")
        except (KeyError, TypeError, ValueError) as exc:
            return self._refuse(f"{path} holds an entry of another shape ({type(exc).__name__}: "
                                f"{str(exc)[:80]})")
        except (OSError, CheckFailed) as exc:
            return self._refuse(f"cannot read {path}: {exc}")
        if self._refused:
            log.info("the checkpoint %s is trusted again", path)
        self._claims, self.problem, self._refused = claims, "", False
        self._repin(pin)
        self._changed()
        log.debug("%d prepared claims in %s", len(claims), path)
        return True

    def _read(self) -> tuple[dict[str, Any], Pin | None]:
        """The record's entries and its file pinned, when the file read is the file pinned (the
        path checked on both sides of the read; in the runner: blocking)."""
        pin = Pin.take(self.checkpoint.path)
        entries = self.checkpoint.load()
        if pin is not None and not pin.current():
            pin.close()
            pin = None
        return entries, pin

    def _write(self, entries: dict[str, Any]) -> Pin | None:
        """Save the record, then pin it (under the instances' lock: nobody else writes between)."""
        self.checkpoint.save(entries)
        return Pin.take(self.checkpoint.path)

    def _repin(self, pin: Pin | None) -> None:
        if self._pin is not None:
            self._pin.close()
        self._pin = pin

    def _remembered(self, claims: Sequence[ClaimRef]) -> dict[str, Entry] | None:
        """Every claim's entry, when all are recorded and memory is the record right now."""
        if self._claims is None or self._pin is None:
            return None
        entries = {c.uid: self._claims.get(c.uid) for c in claims}
        if any(e is None for e in entries.values()) or not self._pin.current():
            return None
        return {uid: e for uid, e in entries.items() if e is not None}

    async def _from_memory(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared] | None:
        """Recorded claims answered without the lock (see the class docstring), or None: the
        locked path answers. The CDI check first, then memory judged with no await after it."""
        if self._remembered(claims) is None:
            return None
        if not (await self._cdi()).ok:
            return None  # the locked path refuses, with the reason
        remembered = self._remembered(claims)
        if remembered is None:
            return None
        for _ in claims:
            self._result(PrepareResult.SUCCESS)
        return {uid: Prepared(entry.devices) for uid, entry in remembered.items()}

    def _refuse(self, problem: str) -> bool:
        if problem != self.problem:
            log.error("refusing the checkpoint of prepared claims: %s; claims are not prepared "
                      "until it is mended or moved aside", problem)
        self._claims, self.problem, self._refused = None, problem, True
        self._repin(None)
        return False

    async def _acquire(self) -> tuple[int | None, str]:
        """The instance lock's descriptor, or None and why not: another instance holding it
        past the budget, or something not ours at its path."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._lock_wait
        path = self._instances.path
        while True:
            try:
                fd = await self.runner.run(self._instances.try_acquire)
            except NotRegular as exc:
                return None, f"{path} is {exc}; refusing to use what we do not own"
            except (OSError, CheckFailed) as exc:
                return None, f"cannot lock {path}: {exc}"
            if fd is not None:
                return fd, ""
            if loop.time() >= deadline:
                return None, (f"another instance of the driver has held {path} for more than "
                              f"{self._lock_wait:g} s")
            await asyncio.sleep(_LOCK_POLL)

    async def _locked(self, work: Callable[[], Awaitable[T]], busy: Callable[[str], T]) -> T:
        """``work()`` under this process's lock and the instances' one; ``busy(why)`` without."""
        async with self._lock:
            fd, problem = await self._acquire()
            if fd is None:
                return busy(problem)
            try:
                return await work()
            finally:
                os.close(fd)

    async def cleanup_leftovers(self) -> int:
        """A crashed write's temp files, under the locks (a surging instance's write has one)."""
        return await self._locked(lambda: self.runner.run(self.checkpoint.cleanup_leftovers),
                                  lambda why: 0)  # busy: left for the next start

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        answers = await self._from_memory(claims)
        if answers is not None:
            return answers
        return await self._locked(lambda: self._prepare(claims), lambda why: self._all(
            claims, f"cannot prepare now: {why}", PrepareResult.ERROR))

    async def _prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        """Under both locks: read the record anew (another instance may have changed it), then
        answer: every claim needs the CDI spec, a new one the device too, and is recorded."""
        if not await self.load():
            return self._all(claims, f"refusing to prepare: {self.problem}",
                             PrepareResult.ERROR)
        cdi = await self._cdi()
        if not cdi.ok:
            return self._all(claims, _no_cdi(cdi), PrepareResult.REFUSED)
        assert self._claims is not None
        answers: dict[str, Prepared] = {}
        pending: dict[str, ClaimRef] = {}  # new claims, once each
        for claim in claims:
            known = self._claims.get(claim.uid)
            if known is not None:
                answers[claim.uid] = Prepared(known.devices)
            else:
                pending.setdefault(claim.uid, claim)
        new: dict[str, Entry] = {}
        refused: set[str] = set()  # new claims the device check refused
        if pending:
            state = await self._gate()  # the device check, once for the call's new claims
            if not state.healthy:
                error = (f"{DRA_DRIVER}: the hypervisor device is not usable on this node: "
                         f"{state.describe()}")
                answers.update({uid: Prepared(error=error) for uid in pending})
                refused.update(pending)
            else:  # read at once: each may wait on the API server
                found = await asyncio.gather(*(self._allocated(c) for c in pending.values()))
                for claim, devices in zip(pending.values(), found, strict=True):
                    if isinstance(devices, str):
                        answers[claim.uid] = Prepared(error=devices)
                    else:
                        new[claim.uid] = Entry(claim, devices)
        if new:
            error = await self._save({**self._claims, **new})
            if error:
                answers.update({uid: Prepared(error=error) for uid in new})
            else:
                self._claims.update(new)
                self._changed()
                answers.update({uid: Prepared(entry.devices) for uid, entry in new.items()})
                for entry in new.values():
                    log.info("prepared claim %s", entry.claim.describe())
        for uid, prepared in answers.items():
            self._result(PrepareResult.REFUSED if uid in refused else
                         PrepareResult.ERROR if prepared.error else PrepareResult.SUCCESS)
        return answers

    async def _allocated(self, claim: ClaimRef) -> tuple[PreparedDevice, ...] | str:
        """The claim's devices, or why it has none of ours (NotAllocated's words)."""
        try:
            return await self._allocation(claim)
        except NotAllocated as exc:
            return str(exc)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        # Busy is transient: the kubelet retries an Unprepare until it succeeds.
        return await self._locked(lambda: self._unprepare(claims),
                                  lambda why: self._done(claims, f"cannot unprepare now: {why}"))

    async def _unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        if not await self.load():
            log.warning("unprepared %d claims without recording it: %s", len(claims), self.problem)
            return self._done(claims, "")
        assert self._claims is not None
        error = await self._drop({c.uid for c in claims}, "unprepared")
        if error:
            answers = {c.uid: error if c.uid in self._claims else "" for c in claims}
            for answer in answers.values():
                self._result(UnprepareResult.ERROR if answer else UnprepareResult.SUCCESS)
            return answers
        return self._done(claims, "")

    async def prune(self, gone: Callable[[ClaimRef], Awaitable[bool]]) -> int:
        """Forget the recorded claims that ``gone`` says are gone from the API server, whose
        Unprepare will never come (their pods were deleted while the node was down, or while the
        driver was away past the kubelet's retries): else the record would fill its bound. Asked
        outside the locks, one at a time (Prepares go on); dropped under both. Returns how many."""
        recorded = [entry.claim for entry in (self._claims or {}).values()]
        stale = {claim.uid for claim in recorded if await gone(claim)}
        if not stale:
            return 0

        async def drop() -> int:
            if not await self.load():
                return 0
            before = len(self._claims or {})
            await self._drop(stale, "pruned (gone from the API server, never unprepared)")
            return before - len(self._claims or {})

        def busy(why: str) -> int:
            log.warning("cannot prune %d claims gone from the API server now: %s", len(stale), why)
            return 0

        return await self._locked(drop, busy)

    async def _drop(self, uids: set[str], what: str) -> str:
        """Under both locks, the record just read: the entries of ``uids`` removed and saved;
        "" when done (none recorded included), else the error (memory then unchanged)."""
        assert self._claims is not None
        gone = uids & self._claims.keys()
        if not gone:
            return ""
        error = await self._save({k: v for k, v in self._claims.items() if k not in gone})
        if error:
            return error
        for uid in sorted(gone):
            log.info("%s claim %s", what, self._claims.pop(uid).claim.describe())
        self._changed()
        return ""

    async def _save(self, claims: dict[str, Entry]) -> str:
        """Write the record; "" when done, else the error every affected claim answers."""
        entries = {uid: entry.to_json() for uid, entry in claims.items()}
        try:
            pin = await self.runner.run(functools.partial(self._write, entries))
        except NotRegular as exc:
            problem = f"{self.checkpoint.path} is {exc}; refusing to replace what we do not own"
        except (OSError, CheckFailed) as exc:
            problem = f"cannot write {self.checkpoint.path}: {exc}"
        else:
            self._repin(pin)  # the caller updates memory next, with no await between
            return ""
        log.error("%s", problem)
        return f"cannot record the claim: {problem}"

    def _all(self, claims: Sequence[ClaimRef], error: str,
             result: PrepareResult) -> dict[str, Prepared]:
        """Every claim of the call answered ``error``, counted as ``result``."""
        for _ in claims:
            self._result(result)
        return {c.uid: Prepared(error=error) for c in claims}

    def _done(self, claims: Sequence[ClaimRef], error: str) -> dict[str, str]:
        for _ in claims:
            self._result(UnprepareResult.ERROR if error else UnprepareResult.SUCCESS)
        return {c.uid: error for c in claims}

    def _result(self, result: ClaimResult) -> None:
        if self._on_result is not None:
            self._on_result(result)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._claims or {}))
