"""Process-level lifecycle shared by both daemons: named root tasks, signals, HTTP probes.

Each daemon is a few named asyncio tasks under one TaskGroup (kopf's shape): the first that fails
takes the others down and the process exits non-zero for the orchestrator to restart; SIGTERM or
SIGINT cancels them all, which stops serving and removes our socket (never the CDI spec).
"""

from __future__ import annotations

import asyncio
import io
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


def dump_tasks() -> None:
    """SIGUSR1: log where every task waits, for an operator chasing a hang."""
    for task in asyncio.all_tasks():
        stream = io.StringIO()
        task.print_stack(file=stream)
        log.warning("task %s:\n%s", task.get_name(), stream.getvalue())


def plugin_readiness(lifecycle: Callable[[], PluginLifecycle | None],
                     tracker: HealthTracker) -> Callable[[], dict[str, tuple[bool, str]]]:
    """Ready = registered AND a ListAndWatch stream is open AND every health condition holds."""

    def readiness() -> dict[str, tuple[bool, str]]:
        current = lifecycle()
        registered = current is not None and current.registered
        streams = current.open_streams if current is not None else 0
        conditions = {
            "registered": (registered, "" if registered else "not registered with the kubelet"),
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
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, me.cancel)
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

    http = HttpServer(http_address, readiness, liveness, metrics.registry)
    http.start()
    try:
        tasks = await main()
        async with asyncio.TaskGroup() as group:
            for task_name, coroutine in tasks.items():
                group.create_task(coroutine, name=task_name)
    except asyncio.CancelledError:
        log.info("%s stopping", name)
    finally:
        http.stop()


async def wait_for_hypervisor(settings: Settings) -> str:
    """``auto`` with no device yet: stay up (not ready) until /dev/mshv or /dev/kvm appears."""
    found = settings.detect_hypervisor()
    if found is not None:
        return found
    log.warning("no hypervisor device under %s (looked for mshv and kvm); waiting for one",
                settings.dev_dir)
    async for _ in DirWatcher(settings.dev_dir, HYPERVISORS).changes():
        found = settings.detect_hypervisor()
        if found is not None:
            log.info("hypervisor device %s appeared", settings.dev_dir / found)
            return found
    raise AssertionError("unreachable: the watcher never ends")
