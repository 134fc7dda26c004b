"""Process-level lifecycle shared by every daemon: named root tasks, signals, HTTP probes.

Each daemon is a few named asyncio tasks under one TaskGroup (kopf's shape): the first that fails
takes the others down and the process exits non-zero for the orchestrator to restart; SIGTERM or
SIGINT cancels them all, which stops serving and removes our socket (never the files that
producers keep).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.metrics import DaemonMetrics, HealthDirection
from hlplugin.deviceplugin.process.http import HttpServer, format_address
from hlplugin.deviceplugin.process.signals import StopSignals
from hlplugin.deviceplugin.settings import HttpSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
RootTasks = Mapping[str, Coroutine[Any, Any, None]]
Conditions = dict[str, tuple[bool, str]]  # name: (holds, why not)


class KubeletSide(Protocol):
    """The kubelet side of a daemon, whichever protocol it speaks (a device plugin's lifecycle, a
    DRA driver's plugin): all the process asks of it. It runs as one of the root tasks."""

    def conditions(self) -> Conditions:
        """/readyz's kubelet conditions: how the kubelet and we stand (registered, ...)."""
        ...

    async def alive(self, timeout: float) -> bool:
        """/healthz: our own gRPC server answers (within a few ``timeout``s)."""
        ...


@dataclass(frozen=True)
class Started:
    """What a daemon's setup hands back: its kubelet side, its named root tasks (the kubelet
    side's own run among them), and the advisory conditions from then on (DaemonSpec.advisory)."""

    kubelet: KubeletSide
    tasks: RootTasks
    advisory: Callable[[], Conditions] | None = None


@dataclass(frozen=True)
class Launch:
    """What the command line hands a daemon besides its settings: the settings whose environment
    value was ignored (exported as ``<prefix>_settings_ignored`` and listed in every /readyz
    answer, without failing readiness: the default runs), and the process's stop signals (None:
    the event loop's own handlers, for a daemon run inside another program, e.g. a test)."""

    ignored_settings: tuple[str, ...] = ()
    signals: StopSignals | None = None


@dataclass(frozen=True)
class DaemonSpec(Generic[T]):
    """Everything a Daemon needs from one daemon.

    ``wait`` returns what the daemon needs before it can build its plugin (e.g. which device node
    appeared); until it does, /readyz reports the ``pending`` conditions as failing, and the
    kubelet side's as ``unstarted`` says. ``setup`` then builds the plugin from it and returns the
    kubelet side and the root tasks.
    """

    name: str
    http: HttpSettings
    tracker: HealthTracker
    metrics: DaemonMetrics
    wait: Callable[[], Awaitable[T]]
    setup: Callable[[T], Awaitable[Started]]
    pending: Mapping[str, str] = field(default_factory=dict)
    launch: Launch = field(default_factory=Launch)
    # /readyz's kubelet conditions until setup has built the kubelet side.
    unstarted: Mapping[str, tuple[bool, str]] = field(default_factory=dict)
    # Listed under ``warnings`` in every /readyz answer, without failing readiness: what an
    # operator should fix though the daemon serves. The daemon's parts keep it up to date in place.
    warnings: list[str] = field(default_factory=list)
    # Listed under ``advisory`` in every /readyz answer, each as a condition, without failing
    # readiness: parts the kubelet side does not depend on (the DRA driver's ResourceSlice).
    # These until setup returns (Started.advisory from then on); None: the daemon has none.
    advisory: Mapping[str, tuple[bool, str]] | None = None


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """Where a task waits, outermost first: its coroutine, then what each one awaits."""
    frames: list[str] = []
    current: Any = task.get_coro()
    while current is not None:
        frame = (getattr(current, "cr_frame", None) or getattr(current, "gi_frame", None)
                 or getattr(current, "ag_frame", None))
        if frame is not None:  # compiled coroutines (gRPC's) have frames without line numbers
            frames.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        current = (getattr(current, "cr_await", None) or getattr(current, "gi_yieldfrom", None)
                   or getattr(current, "ag_await", None))
    return frames


def dump_tasks() -> None:
    """SIGUSR1: log where every task waits, for an operator chasing a hang."""
    for task in asyncio.all_tasks():
        log.warning("task %s waits in: %s", task.get_name(), " -> ".join(await_chain(task)) or "?")


def daemon_readiness(kubelet: Callable[[], KubeletSide | None], tracker: HealthTracker,
              unstarted: Mapping[str, tuple[bool, str]] | None = None
              ) -> Callable[[], Conditions]:
    """Ready = the kubelet side's conditions hold (``unstarted`` while there is none) AND every
    health condition holds."""

    def conditions() -> Conditions:
        current = kubelet()
        found = current.conditions() if current is not None else dict(unstarted or {})
        found.update((name, (c.ok, c.reason)) for name, c in sorted(tracker.state.conditions.items()))
        return found

    return conditions


def track_health_metrics(tracker: HealthTracker, metrics: DaemonMetrics) -> None:
    def update(old: HealthState, new: HealthState) -> None:
        for name, condition in new.conditions.items():
            metrics.health_condition.labels(condition=name).set(1 if condition.ok else 0)
        if old.healthy != new.healthy:
            to = HealthDirection.HEALTHY if new.healthy else HealthDirection.UNHEALTHY
            metrics.health_transitions.labels(to=to).inc()

    update(tracker.state, tracker.state)
    tracker.add_listener(update)


class SelfCheck:
    """Liveness, proved only while the kubelet's probes ask for it: a daemon nobody probes makes
    no call, and /healthz answers at once, from state (a probe never waits, so a flood of requests
    can neither stall it nor evict it).

    /healthz answers the latest check's verdict, and starts the next check (one at a time) when
    that verdict is failing or began ``fresh_for`` or more ago: under the kubelet's probes, every
    5 s, every other probe starts the check the next one reads (a check costs several times
    what the probe's own HTTP exchange does, and finds a hung server just as surely; the
    restart that follows comes within 26 s, docs/operations.md). The check is the kubelet side's
    ``alive()``: a call to our own gRPC server (the device plugin's over one channel kept open:
    one dial per request let 800 concurrent /healthz take 115 MiB), with a second opinion on a
    failure. A check ends within ``limit`` seconds, passing or failing. An HTTP answer at all
    proves the event loop turns, which is the whole check before the kubelet side is built.
    """

    def __init__(self, kubelet: Callable[[], KubeletSide | None], fresh_for: float = 9.0,
                 timeout: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kubelet = kubelet
        self.fresh_for = fresh_for
        self.timeout = timeout
        self.limit = 3 * timeout + 0.5  # the call, then the second opinion's (and its transport's)
        self.clock = clock
        self.ok = True
        self.reason = ""
        self.began: float | None = None  # clock() when the latest check began
        self._running: asyncio.Task[bool] | None = None

    def liveness(self) -> tuple[bool, str]:
        """The verdict now; starts the next check if this one is due (on the event loop)."""
        running = self._running
        due = not self.ok or self.began is None or self.clock() - self.began >= self.fresh_for
        if due and (running is None or running.done()):
            self._running = asyncio.create_task(self.check(), name="self-check")
        return self.ok, self.reason

    async def check(self) -> bool:
        self.began = self.clock()
        current = self.kubelet()
        try:
            async with asyncio.timeout(self.limit):
                ok = current is None or await current.alive(self.timeout)
            reason = "" if ok else "the gRPC server did not answer on its socket"
        except TimeoutError:
            ok, reason = False, f"the gRPC self-check did not end within {self.limit:g} s"
        self.ok, self.reason = ok, reason
        return ok

    async def close(self) -> None:
        if self._running is not None:
            self._running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._running


class Daemon(Generic[T]):
    """One daemon's process: HTTP first, then the spec's wait() and setup(), then its named root
    tasks until a signal or ``stop()``.

    A root task that fails is logged as one line naming it and its error (one per failed task);
    the others are cancelled and the process exits 1 for the orchestrator to restart it.
    """

    def __init__(self, spec: DaemonSpec[T]) -> None:
        self.spec = spec
        self._roots: list[asyncio.Task[None]] = []
        self._started: Started | None = None
        self._waiting = True
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None  # run()'s, which stop() cancels

    def kubelet(self) -> KubeletSide | None:
        return self._started.kubelet if self._started is not None else None

    def readiness(self) -> Conditions:
        """/readyz's conditions: the kubelet side's and the health ones (see daemon_readiness),
        and while wait() has not returned, the spec's ``pending`` ones, failing."""
        conditions = daemon_readiness(self.kubelet, self.spec.tracker, self.spec.unstarted)()
        if self._waiting:
            conditions.update((name, (False, reason)) for name, reason in self.spec.pending.items())
        return conditions

    def advisory(self) -> Conditions:
        started = self._started
        if started is not None and started.advisory is not None:
            return started.advisory()
        return dict(self.spec.advisory or {})

    def stop(self, again: bool = False) -> None:
        """Cancel everything, and again every 0.25 s while anything still runs: on Python 3.11
        asyncio.wait_for, which gRPC uses inside server shutdown, can swallow a cancellation.
        On the event loop, while run() runs."""
        me = self._task
        if me is None:
            return
        if not again:
            if self._stopping:  # a second signal: already on its way
                return
            self._stopping = True
            log.info("%s stopping", self.spec.name)
        pending = [task for task in self._roots if not task.done()]
        if again and not pending and me.done():
            return
        for task in pending:
            task.cancel()
        if not self._roots or again:
            me.cancel()
        me.get_loop().call_later(0.25, self.stop, True)

    async def run(self) -> None:
        spec = self.spec
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        track_health_metrics(spec.tracker, spec.metrics)
        signals = spec.launch.signals
        if signals is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self.stop)
            loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
        else:  # the process's signals, which outlive this loop (see signals.py)
            def on_loop(function: Callable[[], None]) -> Callable[[], None]:
                def call() -> None:
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(function)

                return call

            signals.connect(on_loop(self.stop), dump=on_loop(dump_tasks))
        for setting in spec.launch.ignored_settings:
            spec.metrics.settings_ignored.labels(setting=setting).set(1)

        # Read at every scrape, from the same conditions as /readyz: a readiness alert needs no
        # kube-state-metrics, and cannot disagree with the probe.
        spec.metrics.ready.set_function(
            lambda: float(all(ok for ok, _ in self.readiness().values())))
        checker = SelfCheck(self.kubelet, spec.http.self_check_fresh_for,
                            spec.http.self_check_timeout)
        details: dict[str, object] = {"ignored_settings": sorted(spec.launch.ignored_settings),
                                      "warnings": spec.warnings}  # the list itself: kept current
        if spec.advisory is not None:
            details["advisory"] = functools.partial(_advisory, self.advisory)  # read per answer
        http = HttpServer(self.readiness, checker.liveness, spec.metrics.registry, details=details)
        try:
            try:
                await http.start(spec.http.address)
            except OSError as exc:  # in use, not an address of ours, unresolvable: the operator's
                log.error("%s: cannot serve HTTP on %s: %s", spec.name,
                          format_address(spec.http.address), _os_reason(exc))
                raise SystemExit(1) from None
            found = await spec.wait()
            self._waiting = False
            self._started = started = await spec.setup(found)
            try:
                async with asyncio.TaskGroup() as group:
                    for task_name, coroutine in started.tasks.items():
                        self._roots.append(group.create_task(coroutine, name=task_name))
            except* Exception as failed:
                _log_failures(spec.name, self._roots, failed)
                raise SystemExit(1) from None
        except asyncio.CancelledError:
            log.debug("%s stopped", spec.name)
        finally:
            # stop() cancels this task again every 0.25 s until it ends: each step must finish.
            with contextlib.suppress(asyncio.CancelledError):
                await http.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await checker.close()
            if signals is not None:
                signals.disconnect()


def _log_failures(name: str, roots: list[asyncio.Task[None]], group: BaseExceptionGroup[Exception]
                  ) -> None:
    """One error line per failed root task: which task, and what it raised (with its traceback
    as the record's exception, which the JSON format keeps in one line). A failure no root task
    holds (the group's own) gets one line too."""
    logged = False
    for task in roots:
        if task.done() and not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("%s: root task %s failed: %s: %s; exiting", name, task.get_name(),
                      type(error).__name__, error, exc_info=error,
                      extra={"task": task.get_name(), "error": type(error).__name__})
            logged = True
    if logged:
        return
    error = group.exceptions[0]
    log.error("%s: a root task failed: %s: %s; exiting", name, type(error).__name__, error,
              exc_info=error, extra={"error": type(error).__name__})


def _advisory(conditions: Callable[[], Conditions]) -> dict[str, object]:
    return {name: {"ok": ok, "reason": reason} for name, (ok, reason) in conditions().items()}


def _os_reason(exc: OSError) -> str:
    """The reason alone: socket.create_server adds the address we already name to strerror."""
    if exc.errno and exc.errno > 0:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc) or type(exc).__name__
