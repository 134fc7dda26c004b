"""One instance per node and resource (issue 20 #6): a second instance on the same plugin
directory leaves a live instance's socket alone and stands by naming it (Ready: issue 29's surge
rollouts; tests/test_handover.py), takes over as soon as it goes away, and takes a stale socket
file at once. In-process against the kubelet emulator,
and once with two real daemons."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
from harness import (
    Node,
    daemon,
    emulator,
    healthy_tracker,
    needs_kvm,
    on_kubelet,
    running,
    short_dir,
    wait_until,
)

from hlplugin import names
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.deviceplugin.health.conditions import HealthState
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.endpoint import Held, find_holder, private_path, publish
from hlplugin.deviceplugin.process.daemon import daemon_readiness
from hlplugin.deviceplugin.settings import KubeletSettings
from hlplugin.plugin import HypervisorPlugin, slots
from hlplugin.tools.emulator import KubeletEmulator

RESOURCE = "hyperlight.dev/hypervisor"
SOCKET = "hyperlight.sock"
HELD = "is served by another instance"


@asynccontextmanager
async def lifecycle(plugin_dir: Path, **options: float) -> AsyncIterator[PluginLifecycle]:
    tracker = healthy_tracker()

    async def gate() -> HealthState:
        return tracker.state

    plugin = PluginLifecycle(KubeletSettings(plugin_dir, **options), SOCKET, RESOURCE,
                             lambda: HypervisorPlugin("kvm", slots("kvm", 4), tracker, gate))
    async with running(plugin):
        yield plugin


def listener(path: Path) -> socket.socket:
    """A process of our own answering on ``path``: another instance, as the kernel sees it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    return sock


async def time_at_zero(kubelet: KubeletEmulator) -> float:
    """How long the resource's allocatable is 0 before it is 4 again (the kubelet marks every
    device unhealthy when a stream ends, until the plugin registers anew)."""
    await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0)
    began = time.monotonic()
    await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
    return time.monotonic() - began


def warnings_about_holder(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and HELD in r.getMessage()]


async def test_a_second_instance_stands_by_naming_the_first_then_takes_over(
        caplog: pytest.LogCaptureFixture) -> None:
    plugin_dir = short_dir()
    path = plugin_dir / SOCKET
    caplog.set_level(logging.INFO, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle")
    async with emulator(plugin_dir) as kubelet:
        first_stack = AsyncExitStack()
        first = await first_stack.enter_async_context(lifecycle(plugin_dir))
        try:
            await kubelet.wait_for(lambda: first.registered and kubelet.allocatable(RESOURCE) == 4)
            served = os.stat(path).st_ino
            # The newcomer looks every 20 ms: on main it took the socket at once, and the two
            # took turns for ever (4 -> 20 registrations in 10 s, allocatable 0).
            async with lifecycle(plugin_dir, recheck_interval=0.02) as second:
                readiness = daemon_readiness(lambda: second, healthy_tracker())
                await wait_until(lambda: HELD in second.status, what="the newcomer names the other")
                assert second.status == (f"{path} is served by another instance, pid {os.getpid()} "
                                         f"(uid {os.geteuid()}); waiting for it to go away")
                assert second.role.standby and not second.registered
                assert readiness()["registered"] == (True, (
                    f"standby: pid {os.getpid()} (uid {os.geteuid()}) serves {path}; this "
                    f"instance takes over when it goes"))
                # A bounded watch, 1 s (about 50 looks): nothing changes hands.
                with pytest.raises(TimeoutError):
                    await kubelet.wait_for(lambda: kubelet.register_calls != 1
                                           or kubelet.allocatable(RESOURCE) != 4, timeout=1.0)
                assert first.registered and not second.registered
                assert os.stat(path).st_ino == served
                assert len(warnings_about_holder(caplog)) == 1  # logged once, not per look

                # The first goes away (a pod stopped): the newcomer takes over and registers.
                outage = asyncio.create_task(time_at_zero(kubelet))
                await first_stack.aclose()
                gone = time.monotonic()
                await kubelet.wait_for(lambda: kubelet.register_calls == 2
                                       and kubelet.allocatable(RESOURCE) == 4)
                took = time.monotonic() - gone
                zero = await outage
                await kubelet.wait_for(lambda: second.registered and second.open_streams == 1)
                assert readiness()["registered"] == (True, "") and not second.role.standby
                print(f"handover: allocatable 0 for {zero * 1000:.0f} ms; back at 4 "
                      f"{took * 1000:.0f} ms after the first's stop returned")
                await kubelet.admit(RESOURCE)
        finally:
            await first_stack.aclose()
    assert len(warnings_about_holder(caplog)) == 1
    assert any("went away; taking over" in r.getMessage() for r in caplog.records)


async def test_a_kubelet_restart_with_two_instances_leaves_one_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    """The restarted kubelet deletes the socket: both instances race for the name, and one wins
    for good (gRPC's own clean-up never removes the winner's socket)."""
    caplog.set_level(logging.INFO, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle")
    plugin_dir = short_dir()
    async with emulator(plugin_dir) as kubelet, \
            lifecycle(plugin_dir, recheck_interval=0.05) as first, \
            lifecycle(plugin_dir, recheck_interval=0.05) as second:
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
        await wait_until(lambda: HELD in first.status or HELD in second.status)
        for round_ in (1, 2, 3):
            calls = kubelet.register_calls
            await kubelet.restart()
            await kubelet.wait_for(lambda c=calls: kubelet.register_calls > c  # type: ignore[misc]
                                   and kubelet.allocatable(RESOURCE) == 4)
            await wait_until(lambda: first.registered != second.registered
                             and HELD in (first.status + second.status))
            # A bounded watch, 1 s: no more registrations, the winner keeps serving.
            settled = kubelet.register_calls
            with pytest.raises(TimeoutError):
                await kubelet.wait_for(lambda s=settled: kubelet.register_calls != s  # type: ignore[misc]
                                       or kubelet.allocatable(RESOURCE) != 4, timeout=1.0)
            assert settled - calls == 1, round_  # one registration per restart, as alone
        await kubelet.admit(RESOURCE)
    # Logged once at the start, and again only by a loser that had been registered meanwhile.
    assert 1 <= len(warnings_about_holder(caplog)) <= 4


def test_find_holder_and_publish_tell_a_live_socket_from_a_stale_one() -> None:
    directory = short_dir()
    path = directory / SOCKET
    assert find_holder(path) is None  # nothing there
    ours = private_path(path)
    assert len(ours.name) <= len(path.name) and ours.parent == path.parent
    mine = listener(ours)
    path.write_text("")
    assert find_holder(path) is None  # not a socket: the caller refuses it...
    with pytest.raises(FileExistsError):
        publish(ours, path)  # ...and so does publish
    path.unlink()
    live = listener(path)
    holder = find_holder(path)
    assert holder is not None
    assert (holder.pid, holder.uid) == (os.getpid(), os.geteuid())
    holder.close()
    with pytest.raises(Held, match=f"pid {os.getpid()}"):
        publish(ours, path)  # never over a live socket
    assert ours.exists()
    live.close()  # now stale: the file stays, nobody answers
    assert find_holder(path) is None
    publish(ours, path)
    assert not ours.exists() and find_holder(path) is not None
    mine.close()


async def test_a_stale_socket_file_is_taken_at_once() -> None:
    """A SIGKILLed process leaves its socket file, and nobody answers on it."""
    plugin_dir = short_dir()
    path = plugin_dir / SOCKET
    async with emulator(plugin_dir) as kubelet:
        listener(path).close()  # the file stays: connections are refused
        assert path.exists() and find_holder(path) is None
        # Rechecks a minute apart: only taking the stale file at once passes the guard.
        async with lifecycle(plugin_dir, recheck_interval=60) as plugin:
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, timeout=10)
            assert plugin.registered


async def test_a_holder_that_dies_is_noticed_at_once_and_its_file_taken() -> None:
    """The holder is killed: its socket file stays, but our connection to it ends at once."""
    plugin_dir = short_dir()
    path = plugin_dir / SOCKET
    async with emulator(plugin_dir) as kubelet:
        other = listener(path)
        async with lifecycle(plugin_dir, recheck_interval=60) as plugin:
            await wait_until(lambda: HELD in plugin.status)
            assert kubelet.register_calls == 0
            other.close()  # as the kernel does for a killed process; the file stays
            assert path.exists()
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4, timeout=10)
            assert plugin.registered and plugin.status == ""


async def test_the_incumbent_does_not_fight_for_a_socket_taken_over(
        caplog: pytest.LogCaptureFixture) -> None:
    """Something live replaced our socket (an older release that removes any socket): we stop
    serving and wait; we never remove its socket, and take the name back when it is gone."""
    caplog.set_level(logging.INFO, logger="hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle")
    plugin_dir = short_dir()
    path = plugin_dir / SOCKET
    async with emulator(plugin_dir) as kubelet, \
            lifecycle(plugin_dir, recheck_interval=60) as plugin:
        await kubelet.wait_for(lambda: plugin.registered and kubelet.allocatable(RESOURCE) == 4)
        aside = plugin_dir / "other.sock"
        other = listener(aside)
        os.replace(aside, path)
        theirs = os.stat(path).st_ino
        await wait_until(lambda: HELD in plugin.status and plugin.open_streams == 0)
        assert os.stat(path).st_ino == theirs  # still theirs: not removed by us or by gRPC
        assert kubelet.register_calls == 1
        other.close()
        os.unlink(path)
        await kubelet.wait_for(lambda: kubelet.register_calls == 2
                               and kubelet.allocatable(RESOURCE) == 4, timeout=10)
        assert plugin.registered
    assert len(warnings_about_holder(caplog)) == 1


@needs_kvm
@pytest.mark.parametrize("late", [0.0, 0.3], ids=["prompt", "busy-kubelet"])
@pytest.mark.parametrize("kind", ["serve", "bootstrap"])
async def test_two_daemons_on_one_node_one_serves_the_other_waits(kind: str, late: float,
                                                                 tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    if kind == "serve":
        args = node.serve_args("--device-count", "10")
        resource, count, socket_name = RESOURCE, 10, names.HYPERVISOR_SOCKET
    else:
        args = ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", "/dev"]
        resource, count, socket_name = (names.DEVICE_ACCESS_RESOURCE, ACCESS_SLOTS,
                                        names.DEVICE_ACCESS_SOCKET)
    async with on_kubelet(node, args) as (kubelet, first):
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) == count, timeout=20)
        await first.wait_http("/readyz", 200)
        async with daemon(args) as second:
            reason = ""

            async def names_the_other() -> bool:
                nonlocal reason
                status, body = await second.get("/readyz")
                if status == 200:  # a standby is Ready once its own checks pass
                    reason = json.loads(body)["conditions"]["registered"]["reason"]
                return "standby" in reason

            await wait_until(names_the_other, timeout=20, step=0.05, what="/readyz names the other")
            assert reason == (f"standby: pid {first.pid} (uid {os.geteuid()}) serves "
                              f"{node.plugin_dir / socket_name}; this instance takes over when it goes")
            # A bounded watch, 2 s: on main the two took turns (allocatable ended at 0).
            with pytest.raises(TimeoutError):
                await kubelet.wait_for(lambda: kubelet.register_calls != 1
                                       or kubelet.allocatable(resource) != count, timeout=2.0)
            assert (await first.get("/readyz"))[0] == 200
            assert (await second.get("/healthz"))[0] == 200  # waiting is not a restart loop
            assert sum(HELD in m for m in second.messages()) == 1

            # The first is SIGKILLed: its socket file stays, and the second takes it at once.
            seen = len(kubelet.events)
            kubelet.stream_end_delay = late  # a kubelet that reads the killed one's end late
            await first.signal(signal.SIGKILL)
            killed = time.monotonic()

            def taken_over() -> bool:
                """The kubelet read the killed one's stream end, then the second registered; or,
                the kubelet busy (a loaded machine), the second registered first, and the late
                end disconnected it as the kubelet's rule has it (one client a resource), and it
                registered again. Any other registration is one too many."""
                kinds = [e.kind for e in kubelet.events[seen:] if e.kind != "list"]
                return kinds in (["stream_end", "disconnect", "register"],
                                 ["register", "stream_end", "disconnect", "register"])

            await kubelet.wait_for(lambda: taken_over() and kubelet.allocatable(resource) == count,
                                   timeout=10)
            print(f"takeover after SIGKILL: {resource} allocatable again "
                  f"{(time.monotonic() - killed) * 1000:.0f} ms after the first exited, "
                  f"registrations {kubelet.register_calls}")
            await second.wait_http("/readyz", 200)
            assert sum(HELD in m for m in second.messages()) == 1
