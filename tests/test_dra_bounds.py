"""Bounds on what a client of the DRA socket may ask (docs/security.md, "Bounds on the DRA
socket"): a call over MAX_CLAIMS_PER_CALL claims is refused whole before the preparer is asked, a
message over MAX_REQUEST_BYTES before it is parsed, and the largest call that passes, as well as
the floods that are refused, grow a real `hlplugin dra` process's peak memory by at most 16 MiB.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from harness import daemon, needs_kvm, proc_status, short_dir, wait_until
from support.pluginwatcher import FakePluginWatcher
from support.waits import quiet

from hlplugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from hlplugin.deviceplugin.kubelet.dra.draservice import (
    MAX_CLAIMS_PER_CALL,
    MAX_REQUEST_BYTES,
    ClaimRef,
    Prepared,
    new_dra_server,
)
from hlplugin.names import DRA_DRIVER

VERSIONS = {"v1": (dra_v1_pb2, dra_v1_pb2_grpc), "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}
METHODS = ("NodePrepareResources", "NodeUnprepareResources")
# The API's longest names: a namespace is a DNS label (63), a claim's name a DNS subdomain (253),
# its UID the UUID the API server assigns (36).
LONGEST = (63, 253, 36)
# 256 of them with a UID of 180 bytes: the most the size bound lets through.
FILLING = (63, 253, 180)
GROWTH_KIB = 16 * 1024
EMPTY_CLAIM = b"\x0a\x00"  # field 1 (claims), length-delimited, length 0


def request(api: ModuleType, method: str, count: int, lengths: tuple[int, int, int] = (7, 5, 6)
            ) -> Any:
    """``count`` claims, their (namespace, name, UID) of ``lengths`` characters, the UIDs distinct
    (the claim's number, zero-padded)."""
    ns, name, uid = lengths
    claims = [api.Claim(namespace="n" * ns, name="c" * name, uid=f"{i:0{uid}d}")
              for i in range(count)]
    return getattr(api, f"{method}Request")(claims=claims)


class Recording:
    """A Preparer that records every call and answers every claim."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        self.calls.append(len(claims))
        return {c.uid: Prepared(error="recorded") for c in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        self.calls.append(len(claims))
        return {c.uid: "" for c in claims}


@contextlib.asynccontextmanager
async def served(preparer: Recording) -> AsyncIterator[str]:
    """The DRA service over ``preparer`` on a unix socket; yields its address."""
    address = f"unix://{short_dir() / 'dra.sock'}"
    server = new_dra_server(preparer)
    server.add_insecure_port(address)
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def call(address: str, version: str, method: str, message: Any) -> Any:
    _, api_grpc = VERSIONS[version]
    async with grpc.aio.insecure_channel(address) as channel:
        return await getattr(api_grpc.DRAPluginStub(channel), method)(message, timeout=30)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("version", list(VERSIONS))
async def test_a_call_over_the_claim_bound_is_refused_whole_before_the_preparer_is_asked(
        version: str, method: str) -> None:
    api, _ = VERSIONS[version]
    preparer = Recording()
    async with served(preparer) as address:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(address, version, method, request(api, method, MAX_CLAIMS_PER_CALL + 1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            f"257 claims in one {method}; at most 256 are served (the kubelet sends one pod's "
            f"claims for this driver)")
        assert preparer.calls == []  # no work: the checkpoint, its lock and the gate are the preparer's
        response = await call(address, version, method, request(api, method, MAX_CLAIMS_PER_CALL,
                                                                 LONGEST))
        assert preparer.calls == [MAX_CLAIMS_PER_CALL]
        assert len(response.claims) == MAX_CLAIMS_PER_CALL


async def test_a_message_over_the_size_bound_is_refused_by_grpc_and_the_largest_call_fits() -> None:
    """The issue's 100,000 claims (about 2 MB) are refused before they are parsed; 256 claims at
    the API's longest names fit, with room for a UID of 180 bytes."""
    api, _ = VERSIONS["v1"]
    flood = request(api, "NodePrepareResources", 100_000, (7, 1, 6))
    assert 1_900_000 < flood.ByteSize() < 4 * 1024 * 1024
    largest = request(api, "NodePrepareResources", MAX_CLAIMS_PER_CALL, FILLING)
    assert largest.ByteSize() <= MAX_REQUEST_BYTES
    preparer = Recording()
    async with served(preparer) as address:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(address, "v1", "NodePrepareResources", flood)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert preparer.calls == []
        response = await call(address, "v1", "NodePrepareResources", largest)
        assert preparer.calls == [MAX_CLAIMS_PER_CALL]
        assert len(response.claims) == MAX_CLAIMS_PER_CALL


async def test_refused_calls_take_one_log_line_whatever_their_claims(
        caplog: pytest.LogCaptureFixture) -> None:
    """Logged as the device plugin's Allocate refusals are: one cause per kind (``malformed``),
    so a client varying its calls cannot flood the log; both API versions share it."""
    preparer = Recording()
    caplog.set_level(logging.WARNING, "hlplugin.deviceplugin.kubelet.dra.draservice")
    async with served(preparer) as address:
        for n, version in enumerate(["v1", "v1beta1"] * 3):
            for method in METHODS:
                api, _ = VERSIONS[version]
                with pytest.raises(grpc.aio.AioRpcError):
                    await call(address, version, method,
                               request(api, method, MAX_CLAIMS_PER_CALL + 1 + n))
    lines = [r for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [(r.getMessage(), getattr(r, "kind", None)) for r in lines] == [
        ("refused NodePrepareResources: 257 claims in one NodePrepareResources; at most 256 are "
         "served (the kubelet sends one pod's claims for this driver)", "malformed")]


def driver_args(root: Path) -> list[str]:
    registry, cdi_dir = root / "plugins_registry", root / "cdi"
    registry.mkdir()
    cdi_dir.mkdir()
    return ["dra", "--registry-dir", str(registry), "--dra-dir", str(root / "plugins" / DRA_DRIVER),
            "--pod-uid", "5b8e0c6a-1f2d-4e3b-8a9c-0d1e2f3a4b5c", "--node-name", "node-a",
            "--cdi-dir", str(cdi_dir), "--dev-dir", "/dev", "--host-dev-dir", "",
            "--hypervisor", "kvm"]


@needs_kvm
async def test_the_largest_call_and_the_refused_floods_grow_peak_memory_by_16_mib_at_most() -> None:
    """A real driver: its peak memory (VmHWM) after the largest legal calls (256 claims at the
    API's longest names, prepared, prepared again, unprepared; then 256 filling the size bound),
    then after the floods that are refused (2 MB of 100,000 claims; the most claims a message
    under the size bound carries; 4 MB of empty claims, under gRPC's default bound, which took
    +142 MiB to parse), at most 16 MiB over its peak when idle after one call."""
    root = short_dir()
    args = driver_args(root)
    watcher = FakePluginWatcher(root / "plugins_registry")
    api, api_grpc = VERSIONS["v1"]
    growth: dict[str, float] = {}

    async with daemon(args, graceful=True) as proc:
        async def registered() -> bool:
            await watcher.sync()
            return bool(watcher.plugins)

        await wait_until(registered, 30, "the plugin watcher registered the driver")
        endpoint = watcher.newest(DRA_DRIVER).info.endpoint
        async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
            stub = api_grpc.DRAPluginStub(channel)

            async def answered(method: str, message: Any) -> None:
                response = await getattr(stub, method)(message, timeout=30)
                assert len(response.claims) == len(message.claims)
                assert not any(c.error for c in response.claims.values())

            raw = channel.unary_unary(f"/{api.DESCRIPTOR.package}.DRAPlugin/NodePrepareResources")

            async def refused(message: bytes, code: grpc.StatusCode) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await raw(message, timeout=30)
                assert error.value.code() == code, error.value.details()

            await answered("NodePrepareResources", request(api, "NodePrepareResources", 1))
            await answered("NodeUnprepareResources", request(api, "NodeUnprepareResources", 1))
            await quiet(1.0, "the first call's work settles: part of idle")
            idle = proc_status(proc.pid)["VmHWM"]

            for lengths, what in ((LONGEST, "256 longest"), (FILLING, "256 filling the bound")):
                for method in ("NodePrepareResources", "NodePrepareResources",
                               "NodeUnprepareResources"):
                    await answered(method, request(api, method, MAX_CLAIMS_PER_CALL, lengths))
                growth[what] = (proc_status(proc.pid)["VmHWM"] - idle) / 1024
            flood = request(api, "NodePrepareResources", 100_000, (7, 1, 6)).SerializeToString()
            await refused(flood, grpc.StatusCode.RESOURCE_EXHAUSTED)
            growth["100,000 claims, 2 MB"] = (proc_status(proc.pid)["VmHWM"] - idle) / 1024
            # An empty claim is 2 bytes on the wire (its field's tag and length 0): the most
            # claims per byte, written directly rather than built as 2,000,000 messages here.
            await refused(EMPTY_CLAIM * (MAX_REQUEST_BYTES // 2), grpc.StatusCode.INVALID_ARGUMENT)
            growth["65,536 empty claims, 128 KiB"] = (proc_status(proc.pid)["VmHWM"] - idle) / 1024
            await refused(EMPTY_CLAIM * 2_000_000, grpc.StatusCode.RESOURCE_EXHAUSTED)
            growth["2,000,000 empty claims, 4 MB"] = (proc_status(proc.pid)["VmHWM"] - idle) / 1024
            await answered("NodePrepareResources", request(api, "NodePrepareResources", 1))
    print(f"idle peak {idle / 1024:.1f} MiB; growth after, cumulative (MiB): "
          + ", ".join(f"{what} +{mib:.1f}" for what, mib in growth.items()))
    assert proc.exited() == 0
    assert max(growth.values()) <= GROWTH_KIB / 1024, growth
