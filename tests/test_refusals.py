"""Allocate refusals in the log, aggregated by kind (issue 30 #3): a client that varies the IDs, the
container count or any other field of its requests takes one cause of the log per kind, so a new
real fault still gets its own line at once; malformed requests are refused as a kind of their own.
Both daemons' servicers, in process over a real unix socket."""

from __future__ import annotations

import logging
import random
import string
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from harness import Node, healthy_tracker, needs_kvm, on_kubelet, scrape, value

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.bootstrap import DeviceAccessPlugin
from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.health.repeats import INTERVAL, RepeatedLines
from hlplugin.deviceplugin.kubelet.deviceplugin import servicer
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import new_server
from hlplugin.deviceplugin.kubelet.deviceplugin.servicer import (
    MAX_CONTAINERS,
    MAX_ID_BYTES,
    TrackedDevicePlugin,
)
from hlplugin.metrics import Metrics
from hlplugin.names import (
    DEVICE_ACCESS_RESOURCE,
    DEVICE_ACCESS_SOCKET,
    HYPERVISOR_RESOURCE,
    HYPERVISOR_SOCKET,
)
from hlplugin.plugin import HypervisorPlugin, slots

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNUSABLE = grpc.StatusCode.FAILED_PRECONDITION


def hypervisor_plugin(tracker: HealthTracker) -> TrackedDevicePlugin:
    async def gate() -> HealthState:
        return tracker.state

    return HypervisorPlugin("kvm", slots("kvm", 4), tracker, gate, metrics=Metrics().plugin)


def access_plugin(tracker: HealthTracker) -> TrackedDevicePlugin:
    async def recheck() -> bool:
        return tracker.state.healthy

    return DeviceAccessPlugin("kvm", tracker, recheck, Metrics().plugin)


DAEMONS: dict[str, Callable[[HealthTracker], TrackedDevicePlugin]] = {
    "serve": hypervisor_plugin, "bootstrap": access_plugin}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def served(plugin: TrackedDevicePlugin) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    with tempfile.TemporaryDirectory(prefix="hlp-") as directory:
        path = Path(directory) / "p.sock"
        server = new_server(plugin)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
                yield pb_grpc.DevicePluginStub(channel)
        finally:
            await server.stop(grace=1)


@pytest.fixture
def refusal_lines() -> Iterator[list[logging.LogRecord]]:
    """Every "refused Allocate" record of the servicer's logger, as written."""
    captured: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = captured.append  # type: ignore[method-assign]
    logger = logging.getLogger(servicer.__name__)
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.DEBUG
    try:
        yield captured
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])


async def refused(stub: pb_grpc.DevicePluginStub, allocate: pb.AllocateRequest,
                  code: grpc.StatusCode = INVALID) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refusal:
        await stub.Allocate(allocate, timeout=10)
    assert refusal.value.code() == code, refusal.value.details()
    return refusal.value.details() or ""


def hostile(rng: random.Random, n: int, good: str) -> pb.AllocateRequest:
    """The n-th of a client's requests, every field varied: unknown IDs of any length and number,
    any container count, and each malformed shape in turn."""
    word = "".join(rng.choices(string.ascii_letters, k=rng.randint(1, 40)))
    containers = rng.randint(1, 6)
    shapes = [
        lambda: request(*[[f"nope-{n}-{word}-{c}"] for c in range(containers)]),
        lambda: request([good], [f"{word}{n}"], *[[good]] * containers),
        lambda: request(),  # no container
        lambda: request(*[[good]] * containers, []),  # a container naming no ID
        lambda: request([""], *[[good]] * containers),  # an empty ID
        lambda: request(*[[good]] * (MAX_CONTAINERS + containers)),
        lambda: request(["x" * (MAX_ID_BYTES + n)]),
        lambda: request([good] * (4 + containers)),
    ]
    return shapes[n % len(shapes)]()


def by_kind(records: list[logging.LogRecord]) -> dict[str, list[logging.LogRecord]]:
    kinds: dict[str, list[logging.LogRecord]] = {}
    for record in records:
        assert "refused Allocate" in record.getMessage(), record.getMessage()
        kinds.setdefault(getattr(record, "kind", "?"), []).append(record)
    return kinds


@pytest.mark.parametrize("daemon", DAEMONS)
async def test_a_client_varying_every_field_takes_one_line_per_kind_and_a_real_fault_its_own(
        daemon: str, refusal_lines: list[logging.LogRecord]) -> None:
    tracker = healthy_tracker()
    plugin = DAEMONS[daemon](tracker)
    clock = Clock()
    plugin.refusals = RepeatedLines(plugin.refusals.logger, clock=clock)
    good = sorted(plugin.device_ids)[0]
    rng = random.Random(30)
    sent = 400
    async with served(plugin) as stub:
        for n in range(sent):
            await refused(stub, hostile(rng, n, good))
            clock.now += 0.01  # 4 s of them: within one interval
        # Only the first of each kind was written: a malformed one, then an unknown ID.
        kinds = by_kind(refusal_lines)
        assert sorted(kinds) == ["malformed", "unknown_ids"], kinds
        assert all(len(lines) == 1 for lines in kinds.values()), kinds
        assert "nope-0-" in kinds["unknown_ids"][0].getMessage()
        # A real fault in the same interval: its own line at once, and so is the next one.
        tracker.set_condition("device", False, "open on /dev/kvm failed")
        problem = await refused(stub, request([good]), UNUSABLE)
        assert "open on /dev/kvm failed" in problem
        assert refusal_lines[-1].getMessage() == f"refused Allocate: {problem}"
        assert getattr(refusal_lines[-1], "kind", None) == "unusable"
        tracker.set_condition("device", False, "/dev/kvm is gone")
        await refused(stub, request([good]), UNUSABLE)
        assert "/dev/kvm is gone" in refusal_lines[-1].getMessage()
        written = len(refusal_lines)
        await refused(stub, request([good]), UNUSABLE)  # the same fault again: counted
        assert len(refusal_lines) == written
        # The interval over, each kind says how many it stood for, with its latest example.
        clock.now += INTERVAL
        tracker.set_condition("device", True)
        await refused(stub, hostile(rng, 1, good))  # an unknown ID: the next line writes what is due
    aggregated = by_kind(refusal_lines[written:])
    stood_for = {kind: [getattr(r, "repeated", 1) for r in lines] for kind, lines in aggregated.items()}
    malformed, unknown = sent * 6 // 8, sent * 2 // 8  # hostile()'s shapes: six malformed, two unknown
    assert stood_for == {"malformed": [malformed - 1], "unknown_ids": [unknown], "unusable": [1]}
    assert all("in the last 6" in r.getMessage() for r in refusal_lines[written:])
    # Each with its latest example: the last malformed request named too many IDs.
    assert "device IDs; this plugin advertises" in aggregated["malformed"][0].getMessage()
    counted = plugin.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "hyperlight_allocations_total", {"result": "invalid"})
    assert counted == sent + 1


@pytest.mark.parametrize("daemon", DAEMONS)
@pytest.mark.parametrize(("shape", "says"), [
    (lambda good: request(), "no container requests"),
    (lambda good: request([good], []), "container request 1 names no device IDs"),
    (lambda good: request([good], [""]), "container request 1 names an empty device ID"),
    (lambda good: request(*[[good]] * (MAX_CONTAINERS + 1)), f"at most {MAX_CONTAINERS}"),
    (lambda good: request(["y" * (MAX_ID_BYTES + 1)]), f"longer than {MAX_ID_BYTES} bytes"),
])
async def test_a_request_the_kubelet_never_sends_is_refused_as_malformed(
        daemon: str, shape: Callable[[str], pb.AllocateRequest], says: str,
        refusal_lines: list[logging.LogRecord]) -> None:
    """The kubelet sends one container naming the IDs it picked; before, no container at all or
    a container naming none was granted (an empty answer, counted as a success)."""
    plugin = DAEMONS[daemon](healthy_tracker())
    good = sorted(plugin.device_ids)[0]
    async with served(plugin) as stub:
        details = await refused(stub, shape(good))
        granted = await stub.Allocate(request([good]), timeout=10)
    assert says in details, details
    assert len(granted.container_responses) == 1
    [line] = refusal_lines
    assert getattr(line, "kind", None) == "malformed" and says in line.getMessage()
    samples = {result: plugin.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "hyperlight_allocations_total", {"result": result}) for result in ("invalid", "success")}
    assert samples == {"invalid": 1, "success": 1}


@needs_kvm
@pytest.mark.parametrize("daemon", DAEMONS)
async def test_the_running_daemon_logs_a_flood_of_varied_refusals_in_two_lines(
        tmp_path: Path, daemon: str) -> None:
    """The real process, beside the kubelet emulator: hundreds of refusals, each request unlike
    the others, are two JSON lines (one per kind, field ``kind``) and all counted."""
    node = Node.make(tmp_path)
    resource, socket = {"serve": (HYPERVISOR_RESOURCE, HYPERVISOR_SOCKET),
                        "bootstrap": (DEVICE_ACCESS_RESOURCE, DEVICE_ACCESS_SOCKET)}[daemon]
    args = (node.serve_args("--device-count", "4") if daemon == "serve" else
            ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(node.dev_dir)])
    good = "kvm-0" if daemon == "serve" else "device-access-kvm"
    rng, sent = random.Random(29917), 240
    async with on_kubelet(node, args) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0)
        async with grpc.aio.insecure_channel(f"unix://{node.plugin_dir / socket}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            for n in range(sent):
                await refused(stub, hostile(rng, n, good))
        samples = await scrape(proc)
        lines = [line for line in proc.lines if "refused Allocate" in str(line.get("message"))]
    assert value(samples, "hyperlight_allocations_total", result="invalid") == sent
    assert sorted(line["fields"]["kind"] for line in lines) == ["malformed", "unknown_ids"], lines
