"""Liveness proved while the kubelet's probes ask: a real gRPC server, a real HTTP port, in process.

A daemon nobody probes makes no gRPC call of its own (an idle node pays nothing for liveness).
/healthz answers at once from the latest verdict and starts the next check (one at a time) when
that verdict is failing or ``fresh_for`` old: under the kubelet's 5 s probes, each probe starts
the check the next one reads, so a gRPC server that stops answering fails the probe after next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from harness import wait_until
from prometheus_client import CollectorRegistry
from support.observers import Calls

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.deviceplugin.health.conditions import HealthTracker
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import TrackedDevicePlugin
from hlplugin.deviceplugin.process.daemon import SelfCheck
from hlplugin.deviceplugin.process.http import HttpServer
from hlplugin.deviceplugin.settings import KubeletSettings


class Counted(TrackedDevicePlugin):
    """Counts the options calls it answers; ``hang`` makes it stop answering them, as a wedged
    gRPC server would (the call arrives and nothing comes back)."""

    def __init__(self) -> None:
        super().__init__(["x-0"], HealthTracker())
        self.calls = 0
        self.hang = False

    async def GetDevicePluginOptions(self, request: pb.Empty, context: object) -> pb.DevicePluginOptions:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        return pb.DevicePluginOptions()


class Probed:
    """A served lifecycle, its SelfCheck on a clock the test moves, and /healthz over real TCP."""

    def __init__(self, lifecycle: PluginLifecycle, plugin: Counted, check: SelfCheck,
                 http: HttpServer, now: list[float]) -> None:
        self.lifecycle, self.plugin, self.check, self.http, self.now = lifecycle, plugin, check, http, now
        self.checks = Calls(check, "check")

    async def healthz(self) -> tuple[int, dict[str, str]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.http.port)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(body)

    def settled(self) -> bool:
        """No check in flight."""
        running = self.check._running
        return running is None or running.done()


@contextlib.asynccontextmanager
async def probed(tmp_path: Path) -> AsyncIterator[Probed]:
    plugin = Counted()
    lifecycle = PluginLifecycle(KubeletSettings(tmp_path), "x.sock", "example.com/x", lambda: plugin)
    serving = asyncio.create_task(lifecycle.run())
    now = [1000.0]
    check = SelfCheck(lambda: lifecycle, fresh_for=4.0, timeout=0.5, clock=lambda: now[0])
    http = HttpServer(lambda: {}, check.liveness, CollectorRegistry())
    await http.start(("127.0.0.1", 0))
    try:
        await wait_until(lambda: (tmp_path / "x.sock").exists(), 10, "the plugin's socket")
        yield Probed(lifecycle, plugin, check, http, now)
    finally:
        await http.stop()
        await check.close()
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


async def test_no_probe_no_call_and_a_burst_of_probes_is_one_call(tmp_path: Path) -> None:
    async with probed(tmp_path) as p:
        assert p.plugin.calls == 0 and p.checks.began == 0  # nothing runs on its own
        answers = await asyncio.gather(*(p.healthz() for _ in range(40)))
        assert {code for code, _ in answers} == {200}  # none waited for the check
        await wait_until(p.settled, 10, "the check")
        assert p.plugin.calls == 1 and p.checks.began == 1


async def test_a_pass_stands_for_fresh_for_then_the_next_probe_checks_again(tmp_path: Path) -> None:
    async with probed(tmp_path) as p:
        assert (await p.healthz())[0] == 200
        await wait_until(lambda: p.settled() and p.plugin.calls == 1, 10, "the first check")
        p.now[0] += 3.9
        assert (await p.healthz())[0] == 200 and p.settled() and p.plugin.calls == 1
        p.now[0] += 0.2
        assert (await p.healthz())[0] == 200
        await wait_until(lambda: p.settled() and p.plugin.calls == 2, 10, "the next check")


async def test_a_server_that_stops_answering_fails_the_probe_after_the_one_that_checks(
        tmp_path: Path) -> None:
    """The check ends within its bound (the call, then the lifecycle's second opinion), before
    the next probe; a failing verdict is checked again at every probe, and recovers."""
    async with probed(tmp_path) as p:
        assert (await p.healthz())[0] == 200
        await wait_until(p.settled, 10, "the first check")
        p.plugin.hang = True
        p.now[0] += 4.0
        began = time.monotonic()
        assert (await p.healthz())[0] == 200  # the latest verdict; this probe starts a check
        await wait_until(p.settled, 10, "the check of the hung server")
        assert time.monotonic() - began < p.check.limit + 1.0
        code, body = await p.healthz()
        assert code == 503 and body == {
            "status": "failing", "reason": "the gRPC server did not answer on its socket"}, body
        await wait_until(p.settled, 10, "the check this failing probe started")
        calls = p.plugin.calls
        p.plugin.hang = False
        assert (await p.healthz())[0] == 503  # failing: every probe checks again
        await wait_until(p.settled, 10, "the check after the server recovered")
        assert p.plugin.calls > calls
        assert await p.healthz() == (200, {"status": "ok", "reason": ""})
