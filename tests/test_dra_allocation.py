"""Claims read in Prepare (hlplugin.dra.allocation): a new claim is answered with what the
scheduler allocated it of ours on this node, request by request and share by share, read from an
API server (the fake of tests/support/fakeapi.py, over real TCP); a recorded one from the record,
with no API server at all; a claim replaced, unallocated or another driver's is refused with the
reason; and claims gone from the API server are pruned from the record."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import mknod_char, needs_kvm, short_dir, wait_until
from support.dracluster import Node, driver, readyz
from support.fakeapi import FakeApiServer
from support.fakeslices import add_node
from support.pluginwatcher import FakePluginWatcher

from hlplugin.deviceplugin.health.conditions import Condition, HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.dra.checkpoint import Checkpoint
from hlplugin.deviceplugin.kubelet.dra.draservice import ClaimRef, PreparedDevice
from hlplugin.dra.allocation import AllocationReader, allocated
from hlplugin.dra.claims import CHECKPOINT_FILE, CHECKPOINT_KIND, ClaimPreparer, NotAllocated
from hlplugin.dra.record import Entry
from hlplugin.kubeapi import RESOURCE_CLAIMS, Backoff, Client, Config
from hlplugin.names import DRA_DRIVER
from hlplugin.tools.process import free_port

NODE, CDI_ID = "node-a", "hyperlight.dev/hypervisor=kvm"
CLAIM = ClaimRef("team-a", "uid-1", "vm-claim")


def result(request: str, share: str = "", driver: str = DRA_DRIVER, pool: str = NODE,
           device: str = "kvm") -> dict[str, Any]:
    found = {"request": request, "driver": driver, "pool": pool, "device": device}
    return {**found, "shareID": share} if share else found


def claim_object(claim: ClaimRef = CLAIM, *results: dict[str, Any],
                 allocated: bool = True) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": claim.name, "namespace": claim.namespace,
                                        "uid": claim.uid}}
    if allocated:
        obj["status"] = {"allocation": {"devices": {"results": list(results)}}}
    return obj


def devices(found: dict[str, Any], claim: ClaimRef = CLAIM) -> tuple[PreparedDevice, ...]:
    return allocated(found, claim, NODE, "kvm", CDI_ID)


def refusal(found: dict[str, Any]) -> str:
    with pytest.raises(NotAllocated) as caught:
        devices(found)
    return str(caught.value)


def test_only_our_results_are_answered_each_with_its_requests_and_share() -> None:
    """A claim holding another driver's device too: only ours, so the kubelet gives the
    hypervisor to the containers that name our requests alone; a share is its own device."""
    found = claim_object(CLAIM, result("vm", "5f1c"), result("gpu", driver="gpu.example.com"),
                         result("sidecar", "77aa"))
    assert devices(found) == (PreparedDevice(("vm",), NODE, "kvm", (CDI_ID,), "5f1c"),
                              PreparedDevice(("sidecar",), NODE, "kvm", (CDI_ID,), "77aa"))
    whole = claim_object(CLAIM, result("b"), result("a"))
    assert devices(whole) == (PreparedDevice(("a", "b"), NODE, "kvm", (CDI_ID,)),)


@pytest.mark.parametrize(("found", "reason"), [
    (claim_object(ClaimRef("team-a", "uid-2", "vm-claim"), result("vm")),
     "is not the claim the API server has under that name (its UID is uid-2): deleted and made again"),
    (claim_object(allocated=False), "is not allocated"),
    (claim_object(CLAIM, result("gpu", driver="gpu.example.com")), f"holds no device of {DRA_DRIVER}"),
    (claim_object(CLAIM, result("vm", pool="node-b")),
     f"was allocated node-b/kvm, which this node ({NODE}/kvm) does not publish"),
    (claim_object(CLAIM, result("vm", device="mshv")),
     f"was allocated {NODE}/mshv, which this node ({NODE}/kvm) does not publish"),
], ids=["uid-changed", "not-allocated", "another-driver", "another-node", "another-device"])
def test_a_claim_with_nothing_of_ours_here_is_refused_with_the_reason(found: dict[str, Any],
                                                                      reason: str) -> None:
    assert refusal(found) == f"{DRA_DRIVER}: claim {CLAIM.describe()} {reason}"


async def healthy() -> HealthState:
    tracker = HealthTracker(required=("cdi", "device"))
    tracker.set_condition("cdi", True)
    tracker.set_condition("device", True)
    return tracker.state


async def cdi_ok() -> Condition:
    return (await healthy()).conditions["cdi"]


def reader(url: str) -> AllocationReader:
    client = Client(Config.from_url(url, connect_timeout=1.0, read_timeout=2.0),
                    Backoff(attempts=1))
    return AllocationReader(client, NODE, "kvm", CDI_ID, budget=5.0)


def preparer(directory: Path, allocation: AllocationReader) -> ClaimPreparer:
    return ClaimPreparer(Checkpoint(directory, CHECKPOINT_FILE, CHECKPOINT_KIND), healthy,
                         allocation, cdi=cdi_ok)


@asynccontextmanager
async def api_with(*claims: dict[str, Any]) -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as server:
        for obj in claims:
            server.put(RESOURCE_CLAIMS.path(obj["metadata"]["namespace"]), obj)
        yield server


async def test_a_new_claim_is_read_and_recorded_a_recorded_one_needs_no_api_server() -> None:
    """The kubelet re-prepares every running pod's claims after its restart: with the API server
    away by then, the recorded claim is still answered, byte for byte."""
    directory = short_dir()
    expected = (PreparedDevice(("vm",), NODE, "kvm", (CDI_ID,), "5f1c"),)
    async with api_with(claim_object(CLAIM, result("vm", "5f1c"))) as server:
        first = preparer(directory, reader(server.url))
        await first.load()
        assert (await first.prepare([CLAIM]))[CLAIM.uid].devices == expected
        assert [s.path for s in server.seen("get")] == [
            RESOURCE_CLAIMS.path(CLAIM.namespace, CLAIM.name)]
    away = reader(f"http://127.0.0.1:{free_port()}")
    again = preparer(directory, away)  # a restarted driver: only the record in common
    await again.load()
    assert (await again.prepare([CLAIM]))[CLAIM.uid].devices == expected
    assert away.condition() == (True, "no claim read yet")


async def test_a_claim_missing_or_unreadable_is_refused_and_readyz_names_a_403() -> None:
    directory = short_dir()
    async with api_with() as server:
        claims = reader(server.url)
        prepared = preparer(directory, claims)
        await prepared.load()
        missing = (await prepared.prepare([CLAIM]))[CLAIM.uid]
        assert missing.error == f"{DRA_DRIVER}: claim {CLAIM.describe()} is not in the API server"
        assert claims.condition() == (True, "the last claim read was answered")
        server.fail(403, "get")
        denied = (await prepared.prepare([CLAIM]))[CLAIM.uid].error
        ok, note = claims.condition()
        assert not ok and note.startswith(f"cannot read claim {CLAIM.describe()}: get "
                                          f"resourceclaims.resource.k8s.io/{CLAIM.name}: 403")
        assert denied == f"{DRA_DRIVER}: {note}"
        assert prepared.prepared == {}, "a refused claim is recorded"


async def test_claims_gone_from_the_api_server_are_pruned_and_only_those() -> None:
    """Recorded: one whose claim is there, one gone, one whose name now holds another claim;
    an API server that does not answer prunes nothing."""
    kept, gone, replaced = (ClaimRef("team-a", f"uid-{n}", f"claim-{n}") for n in range(3))
    directory = short_dir()
    async with api_with(*(claim_object(c, result("vm")) for c in (kept, gone, replaced))) as server:
        claims = reader(server.url)
        prepared = preparer(directory, claims)
        await prepared.load()
        await prepared.prepare([kept, gone, replaced])
        assert set(prepared.prepared) == {"uid-0", "uid-1", "uid-2"}
        server.remove(RESOURCE_CLAIMS.path("team-a"), gone.name)
        server.remove(RESOURCE_CLAIMS.path("team-a"), replaced.name)
        server.put(RESOURCE_CLAIMS.path("team-a"),
                   claim_object(ClaimRef("team-a", "uid-new", replaced.name), result("vm")))
        server.fail(503, "get", times=3)
        assert await prepared.prune(claims.gone) == 0
        assert await prepared.prune(claims.gone) == 2
    assert set(prepared.prepared) == {"uid-0"}
    restarted = preparer(directory, claims)
    await restarted.load()
    assert set(restarted.prepared) == {"uid-0"}, "the record on disk was not pruned"


@needs_kvm
async def test_the_running_driver_reads_a_new_claim_and_prunes_a_leftover_at_start() -> None:
    """`hlplugin dra` in a cluster (its API server the fake): a claim left in the record whose
    claim is gone is forgotten at start, and a new claim that also holds another driver's device
    is answered with our request and share alone; /readyz notes the read."""
    node = Node()
    mknod_char(node.dev_dir / "kvm", os.stat("/dev/kvm").st_rdev)
    leftover = ClaimRef("team-a", "uid-left", "left")
    node.plugin_dir.mkdir(parents=True)
    record = Checkpoint(node.plugin_dir, CHECKPOINT_FILE, CHECKPOINT_KIND)
    record.save({leftover.uid: Entry(leftover, (PreparedDevice((), NODE, "kvm", (CDI_ID,)),)).to_json()})
    watcher = FakePluginWatcher(node.registry)
    found = claim_object(CLAIM, result("vm", "5f1c"), result("gpu", driver="gpu.example.com"))
    async with api_with(found) as server:
        add_node(server)
        async with driver(node, server.url) as proc:
            await wait_until(lambda: leftover.uid not in recorded(record), 30, "the leftover pruned")

            async def registered() -> bool:
                await watcher.sync()
                return bool(watcher.plugins)

            await wait_until(registered, 30, "the driver registered")
            answer = (await watcher.prepare(DRA_DRIVER, (CLAIM.namespace, CLAIM.uid, CLAIM.name)))
            entry = answer.claims[CLAIM.uid]
            assert entry.error == ""
            assert [(list(d.request_names), d.share_id, list(d.cdi_device_ids))
                    for d in entry.devices] == [(["vm"], "5f1c", [CDI_ID])]
            assert recorded(record) == {CLAIM.uid}
            _, body = await readyz(proc)
            assert body["advisory"]["claims"] == {"ok": True,
                                                  "reason": "the last claim read was answered"}


def recorded(record: Checkpoint) -> set[str]:
    return set(json.loads(record.path.read_bytes())["entries"])
