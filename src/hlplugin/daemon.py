"""Process-level lifecycle shared by both daemons: named root tasks, signals, HTTP probes.

Each daemon is a few named asyncio tasks under one TaskGroup (kopf's shape): the first that fails
takes the others down and the process exits non-zero for the orchestrator to restart; SIGTERM or
SIGINT cancels them all, which stops serving and removes our socket (never the CDI spec).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from hlplugin.config import HYPERVISORS, Settings
from hlplugin.health import HealthState, HealthTracker
from hlplugin.http import HttpServer, Readiness
from hlplugin.lifecycle import PluginLifecycle
from hlplugin.metrics import Metrics
from hlplugin.watch import DirWatcher

log = logging.getLogger(__name__)

RootTasks = Mapping[str, Coroutine[Any, Any, None]]


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


def plugin_readiness(lifecycle: Callable[[], PluginLifecycle | None],
                     tracker: HealthTracker) -> Callable[[], dict[str, tuple[bool, str]]]:
    """Ready = registered AND a ListAndWatch stream is open AND every health condition holds."""

    def readiness() -> dict[str, tuple[bool, str]]:
        current = lifecycle()
        registered = current is not None and current.registered
        streams = current.open_streams if current is not None else 0
        conditions = {
            "registered": (registered, current.status if current is not None
                           else "not registered with the kubelet"),
            "listandwatch": (streams > 0, "" if streams else "the kubelet has no ListAndWatch open"),
        }
        state = tracker.state
        for name, condition in sorted(state.conditions.items()):
            conditions[name] = (condition.ok, condition.reason)
        return conditions

    return readiness


def track_health_metrics(tracker: HealthTracker, metrics: Metrics) -> None:
    def update(old: HealthState, new: HealthState) -> None:
        for name, condition in new.conditions.items():
            metrics.health_condition.labels(condition=name).set(1 if condition.ok else 0)
        if old.healthy != new.healthy:
            metrics.health_transitions.labels(to="healthy" if new.healthy else "unhealthy").inc()

    update(tracker.state, tracker.state)
    tracker.add_listener(update)


async def run_daemon(
    name: str,
    http_address: tuple[str, int],
    readiness: Readiness,
    lifecycle: Callable[[], PluginLifecycle | None],
    metrics: Metrics,
    main: Callable[[], Coroutine[Any, Any, RootTasks]],
) -> None:
    """Start HTTP, then run ``main``'s setup and its named root tasks until a signal."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    assert me is not None
    roots: list[asyncio.Task[None]] = []

    def stop(again: bool = False) -> None:
        """Cancel everything, and again every 0.25 s while anything still runs: on Python 3.11
        asyncio.wait_for, which gRPC uses inside server shutdown, can swallow a cancellation."""
        if not again:
            log.info("%s stopping", name)
        pending = [task for task in roots if not task.done()]
        if again and not pending and me.done():
            return
        for task in pending:
            task.cancel()
        if not roots or again:
            me.cancel()
        loop.call_later(0.25, stop, True)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)

    def liveness() -> tuple[bool, str]:
        current = lifecycle()
        if current is None:
            probe: Coroutine[Any, Any, bool] = asyncio.sleep(0, True)
        else:
            probe = current.alive()
        future = asyncio.run_coroutine_threadsafe(probe, loop)
        try:
            ok = future.result(timeout=2.0)
        except TimeoutError:
            future.cancel()
            return False, "the event loop did not answer within 2 s"
        return ok, "" if ok else "the gRPC server did not answer on its socket"

    # Read at every scrape, from the same conditions as /readyz: a readiness alert needs no
    # kube-state-metrics, and cannot disagree with the probe.
    metrics.ready.set_function(lambda: float(all(ok for ok, _ in readiness().values())))
    http = HttpServer(http_address, readiness, liveness, metrics.registry)
    http.start()
    try:
        tasks = await main()
        async with asyncio.TaskGroup() as group:
            for task_name, coroutine in tasks.items():
                roots.append(group.create_task(coroutine, name=task_name))
    except asyncio.CancelledError:
        log.debug("%s stopped", name)
    finally:
        http.stop()


async def wait_for_hypervisor(settings: Settings) -> str:
    """``auto`` with no device yet: stay up (not ready) until /dev/mshv or /dev/kvm appears."""
    found = settings.detect_hypervisor()
    if found is not None:
        return found
    log.warning("no hypervisor device under %s (looked for mshv and kvm); waiting for one",
                settings.dev_dir)
    # aclosing: leaving the loop early must close the watcher now, not whenever the garbage
    # collector finalizes the generator (by then its inotify fd number may belong to another).
    async with contextlib.aclosing(DirWatcher(settings.dev_dir, HYPERVISORS).changes()) as changes:
        async for _ in changes:
            found = settings.detect_hypervisor()
            if found is not None:
                log.info("hypervisor device %s appeared", settings.dev_dir / found)
                return found
    raise AssertionError("unreachable: the watcher never ends")
