"""PluginLifecycle in-process against the kubelet emulator, over real unix sockets: re-registration
after a kubelet restart, a deleted socket or an ended stream, and why registration fails. The
lifecycle is generic: these tests drive it through a generic servicer of their own (Slots), never
through Hyperlight's (tests/test_socket_limit.py has the socket path limit with the bootstrap's)."""

from __future__ import annotations

import ast
import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import emulator, healthy_tracker, running, short_dir, wait_until
from support.waits import quiet

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.metrics import DaemonMetrics
from hlplugin.deviceplugin.metrics import DevicePluginMetrics as Metrics
from hlplugin.deviceplugin.process.daemon import daemon_readiness
from hlplugin.deviceplugin.settings import KubeletSettings
from hlplugin.tools.emulator import KubeletEmulator

RESOURCE = "example.com/slot"
SOCKET = "example.sock"
PREFIX = "example"  # of the metric families
Context = grpc.aio.ServicerContext[Any, Any]


class Slots(TrackedDevicePlugin):
    """A generic resource: four slots, all as the tracker says; Allocate hands each container
    its slot's ID in the environment."""

    def __init__(self, tracker: HealthTracker, metrics: Metrics | None = None) -> None:
        super().__init__([f"slot-{i}" for i in range(4)], tracker, metrics)

    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.AllocateResponse:
        await self.check_request(request, context)
        response = pb.AllocateResponse()
        for container in request.container_requests:
            response.container_responses.add().envs["SLOT"] = ",".join(container.devices_ids)
        return response


@asynccontextmanager
async def lifecycle(plugin_dir: Path, resource: str = RESOURCE, metrics: Metrics | None = None,
                    **options: float) -> AsyncIterator[PluginLifecycle]:
    tracker = healthy_tracker()
    plugin = PluginLifecycle(KubeletSettings(plugin_dir, **options), SOCKET, resource,
                             lambda: Slots(tracker, metrics), metrics=metrics)
    async with running(plugin):
        yield plugin


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def series(metrics: Metrics) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {(s.name, frozenset(s.labels.items())) for family in metrics.registry.collect()
            for s in family.samples if s.name.startswith("example_")}


# --- a restarted kubelet, or our socket deleted: a fresh server, registered ---------------------


@pytest.mark.parametrize("event", ["kubelet restart", "socket deleted"])
async def test_a_restarted_kubelet_or_a_deleted_socket_gets_a_fresh_server_registered(
        event: str) -> None:
    """The kubelet deletes every plugin socket when it restarts; the lifecycle notices (inotify on
    the directory), stops the old server, ending its stream, and registers a new one."""
    plugin_dir = short_dir()
    metrics = Metrics(DaemonMetrics(PREFIX))
    # Rechecks a minute apart: only the directory's inotify watch can notice within the guard.
    async with (emulator(plugin_dir) as kubelet,
                lifecycle(plugin_dir, metrics=metrics, recheck_interval=60) as plugin):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
        socket = plugin_dir / SOCKET
        for round_ in (1, 2):
            served = os.stat(socket).st_ctime_ns  # the inode number may be reused
            calls = kubelet.register_calls
            if event == "kubelet restart":
                await kubelet.restart()  # deletes plugin sockets, as the kubelet does
            else:
                socket.unlink()  # a kubelet that restarted unseen, or an operator's rm
            await kubelet.wait_for(lambda c=calls: kubelet.register_calls > c  # type: ignore[misc]
                                   and kubelet.allocatable(RESOURCE) == 4)
            # The kubelet sees the Register before the plugin has its answer: wait for ours.
            await kubelet.wait_for(lambda r=round_: plugin.open_streams == 1  # type: ignore[misc]
                                   and sample(metrics, "example_registrations_total",
                                              result="success") == r + 1)
            assert plugin.registered
            assert os.stat(socket).st_ctime_ns != served  # a fresh server's socket
        await kubelet.admit(RESOURCE)
        assert sample(metrics, "example_registrations_total", result="failure") == 0


# --- a real kubelet restart: the stream ends, kubelet.sock stays dead, then a new one (issue 21) ---


async def test_a_real_kubelet_restart_counts_no_failure_and_logs_no_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Down longer than the stream grace: the lifecycle waits for the new kubelet.sock instead of
    dialling the dead one (which failed, counted and warned, 5-6 times on a real kubelet)."""
    with caplog.at_level(logging.DEBUG, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle"):
        plugin_dir = short_dir()
        metrics = Metrics(DaemonMetrics(PREFIX))
        async with (emulator(plugin_dir) as kubelet,
                    lifecycle(plugin_dir, metrics=metrics, stream_grace=0.2) as plugin):
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
            caplog.clear()
            await kubelet.restart(down=2.0)
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
            await kubelet.admit(RESOURCE)
            assert sample(metrics, "example_registrations_total", result="failure") == 0
            assert sample(metrics, "example_registrations_total", result="success") == 2
            assert sample(metrics, "example_reregistrations_total", reason="stream_ended") == 0
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r for r in records if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in records] == [
        "the kubelet ended its ListAndWatch stream of example.com/slot; waiting for a new "
        "stream or a new kubelet.sock",
        "kubelet restarted or our socket was removed; registering anew",
        "registered example.com/slot with the kubelet",
    ]


async def test_our_socket_deleted_before_the_dead_kubelet_sock_is_not_dialled() -> None:
    """The new kubelet deletes the sockets one by one: ours may go while the dead kubelet.sock
    is still there. The fresh server waits for the new kubelet.sock rather than dial the dead one."""
    plugin_dir = short_dir()
    metrics = Metrics(DaemonMetrics(PREFIX))
    async with (emulator(plugin_dir) as kubelet,
                lifecycle(plugin_dir, metrics=metrics, stream_grace=0.2) as plugin):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
        socket = plugin_dir / SOCKET
        served = os.stat(socket).st_ctime_ns
        await kubelet.stop()  # exits: the stream ends, kubelet.sock stays, dead
        await wait_until(lambda: plugin.open_streams == 0)
        socket.unlink()  # the new kubelet's first deletion
        await wait_until(lambda: socket.exists() and os.stat(socket).st_ctime_ns != served)
        await wait_until(lambda: plugin.status == "waiting for the kubelet to restart (it ended "
                                                  "our ListAndWatch stream)")
        assert sample(metrics, "example_registrations_total", result="failure") == 0
        await kubelet.start()  # deletes the rest (the dead kubelet.sock too), serves anew
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
        assert sample(metrics, "example_registrations_total", result="failure") == 0


async def test_a_new_kubelet_sock_just_after_the_dead_one_was_seen_is_dialled_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fresh server saw the dead kubelet.sock and waits for a new one; the new kubelet
    replaces it right then, before that wait began. The wait must end at once: it compares with
    the socket seen, not with the one there when it starts (CI's kubelet restart, on the real
    kubelet: the main daemon registered 29.7 s late, its whole kubelet_wait)."""
    plugin_dir = short_dir()
    real = PluginLifecycle._sleep_or_kubelet
    replaced = False

    async def replaced_first(self: PluginLifecycle, delay: float, before: Any) -> None:
        nonlocal replaced
        if not replaced:
            replaced = True
            await kubelet.start()  # deletes the sockets, then serves a new kubelet.sock
        await real(self, delay, before)

    async with (emulator(plugin_dir) as kubelet,
                lifecycle(plugin_dir, stream_grace=0.2, kubelet_wait=60) as plugin):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
        await kubelet.stop()  # exits: the stream ends, kubelet.sock stays, dead
        await wait_until(lambda: plugin.open_streams == 0)
        monkeypatch.setattr(PluginLifecycle, "_sleep_or_kubelet", replaced_first)
        (plugin_dir / SOCKET).unlink()  # the new kubelet's first deletion
        await kubelet.wait_for(lambda: replaced and kubelet.allocatable(RESOURCE) == 4
                               and plugin.registered, timeout=10)


async def test_a_kubelet_that_ended_our_stream_but_listens_is_not_waited_for() -> None:
    """The kubelet ended the stream and stayed up, and our socket went too: its kubelet.sock
    still listens, so the fresh server registers at once, not after the restart wait."""
    plugin_dir = short_dir()
    async with (emulator(plugin_dir) as kubelet,
                lifecycle(plugin_dir, stream_grace=60, kubelet_wait=60) as plugin):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
        calls = kubelet.register_calls
        await kubelet.end_stream(RESOURCE)
        await wait_until(lambda: plugin.open_streams == 0)
        (plugin_dir / SOCKET).unlink()
        await kubelet.wait_for(lambda: kubelet.register_calls > calls
                               and kubelet.allocatable(RESOURCE) == 4, timeout=20)


async def test_a_kubelet_down_past_the_wait_counts_and_warns_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """No new kubelet.sock within ``kubelet_wait`` of the stream's end: from then on the attempts
    count as failures (the dead socket is unreachable), warned once, as any lasting failure."""
    with caplog.at_level(logging.DEBUG, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle"):
        plugin_dir = short_dir()
        metrics = Metrics(DaemonMetrics(PREFIX))
        loop = asyncio.get_running_loop()
        async with (emulator(plugin_dir) as kubelet,
                    lifecycle(plugin_dir, metrics=metrics, stream_grace=0.2, kubelet_wait=1.5,
                              max_backoff=0.2) as plugin):
            await kubelet.wait_for(lambda: plugin.registered)
            caplog.clear()
            await kubelet.stop()  # a crash: kubelet.sock stays, dead
            stopped = loop.time()
            await wait_until(lambda: sample(metrics, "example_registrations_total",
                                            result="failure") > 0)
            assert loop.time() - stopped >= 1.5, "counted a failure within the wait"
            await wait_until(lambda: sample(metrics, "example_registrations_total",
                                            result="failure") >= 3)
            assert "is unreachable" in plugin.status
            await kubelet.start()
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4 and plugin.registered)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "is unreachable" in warned[0], warned
    last = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO][-1]
    assert last.startswith("registered example.com/slot with the kubelet after "), last


# --- the kubelet ends its stream and stays up (issue 11 #3) --------------------------------------


async def test_stream_ended_by_the_kubelet_registers_anew_after_the_grace(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle"):
        plugin_dir = short_dir()
        metrics = Metrics(DaemonMetrics(PREFIX))
        async with (emulator(plugin_dir) as kubelet,
                    lifecycle(plugin_dir, metrics=metrics, stream_grace=0.3) as plugin):
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
            await kubelet.wait_for(lambda: plugin.open_streams == 1)
            for round_ in (1, 2):
                calls = kubelet.register_calls
                await kubelet.end_stream(RESOURCE)  # the kubelet stays up, kubelet.sock too
                assert kubelet.allocatable(RESOURCE) == 0
                await kubelet.wait_for(lambda c=calls: kubelet.register_calls > c  # type: ignore[misc]
                                       and kubelet.allocatable(RESOURCE) == 4)
                await kubelet.wait_for(lambda: plugin.open_streams == 1 and plugin.registered)
                assert sample(metrics, "example_reregistrations_total",
                              reason="stream_ended") == round_
            await kubelet.admit(RESOURCE)
            assert sample(metrics, "example_registrations_total", result="success") == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["the kubelet ended its ListAndWatch stream of example.com/slot and "
                      "opened none for 0.3 s; registering anew"] * 2


async def test_a_stream_that_reopens_within_the_grace_changes_nothing() -> None:
    plugin_dir = short_dir()
    metrics = Metrics(DaemonMetrics(PREFIX))
    async with (emulator(plugin_dir) as kubelet,
                lifecycle(plugin_dir, metrics=metrics, stream_grace=30) as plugin):
        await kubelet.wait_for(lambda: plugin.open_streams == 1)
        await kubelet.end_stream(RESOURCE)
        await kubelet.wait_for(lambda: plugin.open_streams == 0)
        assert plugin.registered  # within the grace: still the same registration
        assert kubelet.register_calls == 1
        assert sample(metrics, "example_reregistrations_total",
                      reason="stream_ended") == 0
        readiness = daemon_readiness(lambda: plugin, healthy_tracker())
        assert readiness()["listandwatch"] == (False, "the kubelet has no ListAndWatch open")
        # Losing the kubelet: not registered either, and alive (not restarted).
        await kubelet.stop(remove_socket=True)
        await wait_until(lambda: not readiness()["registered"][0])
        await wait_until(plugin.alive)


# --- registration failures say why and count every attempt (issue 12) ----------------------------


@pytest.mark.parametrize("cause", ["missing dir", "no kubelet.sock", "refused", "hangs", "resets"])
async def test_registration_failure_names_its_cause_and_counts_every_attempt(
        cause: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle"):
        base = short_dir()
        plugin_dir = base / "device-plugins" if cause == "missing dir" else base
        resource = "example.kubernetes.io/hypervisor" if cause == "refused" else RESOURCE
        mode = {"refused": "normal", "hangs": "hang", "resets": "reset"}.get(cause)
        broken = KubeletEmulator(plugin_dir, mode=mode) if mode else None
        if broken is not None:
            await broken.start()
        metrics = Metrics(DaemonMetrics(PREFIX))
        first = series(metrics)
        want = {
            "missing dir": f"{plugin_dir} does not exist",
            "no kubelet.sock": f"no kubelet.sock at {plugin_dir / 'kubelet.sock'}",
            "refused": "the kubelet refused with UNKNOWN: invalid name of device plugin socket",
            "hangs": "Register timed out after 0.2 s (DEADLINE_EXCEEDED",
            "resets": f"the kubelet at {plugin_dir / 'kubelet.sock'} is unreachable",
        }[cause]
        try:
            async with lifecycle(plugin_dir, resource, metrics, register_timeout=0.2,
                                 min_backoff=0.01, max_backoff=0.05, recheck_interval=0.1,
                                 ) as plugin:
                readiness = daemon_readiness(lambda: plugin, healthy_tracker())
                failed = {"result": "failure"}
                await wait_until(
                    lambda: sample(metrics, "example_registrations_total", **failed) >= 3)
                ok, reason = readiness()["registered"]
                assert not ok
                assert want in reason, reason
                # Failures move series that exist from the start, and nothing else.
                assert series(metrics) == first
                assert sample(metrics, "example_registrations_total", result="success") == 0
                assert sample(metrics, "example_listandwatch_streams") == 0
                if broken is not None:
                    await broken.stop(remove_socket=True)
                if cause != "refused":  # a refusal is checked: the rest is for the others
                    async with emulator(plugin_dir) as kubelet:
                        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
                        # The kubelet lists before the plugin has Register's answer: wait for it.
                        await wait_until(lambda: readiness()["registered"] == (True, ""))
                        assert plugin.problem == ""
        finally:
            if broken is not None:
                await broken.stop()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # A lasting state is logged when it starts (and when it changes), not on every attempt...
    assert len(warned) == 1, warned
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
             and "attempt" in r.getMessage()]
    assert len(debug) >= 2
    if cause != "refused":
        # ...and when it ends, with the number of attempts that failed.
        assert any("registered example.com/slot with the kubelet after" in r.getMessage()
                   and "failed attempts" in r.getMessage() for r in caplog.records)


# --- idle: no loop wake-up every second while inotify watches the directory ----------------------


async def test_an_idle_registered_plugin_rechecks_its_sockets_rarely_while_inotify_watches() -> None:
    """The stats that cover a missed event run every second only while the directory is polled;
    with its inotify watch live they run every live_recheck_interval (a wake-up a second was over a
    third of an idle daemon's CPU). The waits are observed, not changed."""
    plugin_dir = short_dir()
    async with emulator(plugin_dir) as kubelet, lifecycle(plugin_dir, recheck_interval=0.2,
                                                          live_recheck_interval=5) as plugin:
        await kubelet.wait_for(lambda: plugin.open_streams == 1 and plugin.registered)
        await wait_until(plugin._wakeup.live, what="the inotify watch")
        limits: list[float] = []
        wait = plugin._wakeup.wait
        loop = asyncio.get_running_loop()

        def on_tick(period: float) -> bool:  # every wait ends on a tick of its period
            return all(limit <= period and min(end % period, period - end % period) < 0.02
                       for limit, end in zip(limits, ends, strict=True))

        ends: list[float] = []

        async def observed(pulse: asyncio.Event, limit: float) -> bool:
            limits.append(limit)
            ends.append(loop.time() + limit)
            return await wait(pulse, limit)

        plugin._wakeup.wait = observed  # type: ignore[method-assign]
        plugin._wakeup.fire()  # a change: the lifecycle looks, then waits anew
        await wait_until(lambda: bool(limits), what="a wait")
        await quiet(0.5, "a bounded watch: a few 0.2 s rechecks, were they still made")
        # One wait, or two when the first began just before a tick: on the 5 s ticks
        # (conditions.until_tick, shared with the daemon's other periodic work).
        assert len(limits) <= 2 and on_tick(5), limits
        limits.clear()
        ends.clear()
        # Polled (no inotify), the short recheck is all that notices a change.
        for watcher in plugin._wakeup.watchers:
            watcher.live_fd = None
        plugin._wakeup.fire()
        await wait_until(lambda: len(limits) >= 4, what="rechecks at the short interval")
        del limits[0], ends[0]  # the 5 s wait the change ended
        assert on_tick(0.2), limits


def test_these_tests_reach_the_lifecycle_through_generic_code_only() -> None:
    """The lifecycle is generic: proved here through Slots, never through Hyperlight's daemons
    (plugin, bootstrap, cdi, health, probe) or their metrics."""
    tree = ast.parse(Path(__file__).read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {m for m in imported if m.split(".")[0] == "hlplugin"}
    generic = {m for m in ours if m.startswith("hlplugin.deviceplugin.")}
    assert ours - generic == {"hlplugin.api", "hlplugin.tools.emulator"}, ours
