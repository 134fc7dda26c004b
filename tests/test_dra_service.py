"""The DRA driver's kubelet side against a fake kubelet plugin watcher (tests/support/
pluginwatcher.py) over real unix sockets and gRPC: registration, both API versions, Prepare and
Unprepare idempotency, refusal on an unhealthy device, and the checkpoint across restarts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import short_dir, wait_until
from support.pluginwatcher import FakePluginWatcher, NoHealthStream
from support.waits import quiet

from hlplugin.deviceplugin.health.conditions import Condition, HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.dra.checkpoint import Checkpoint
from hlplugin.deviceplugin.kubelet.dra.drahealth import HealthStream
from hlplugin.deviceplugin.kubelet.dra.draservice import (
    DRA_SERVICES,
    HEALTH_SERVICE,
    SERVICES,
    ClaimRef,
    PreparedDevice,
    new_dra_server,
)
from hlplugin.deviceplugin.kubelet.dra.pluginwatcher import DRA_PLUGIN, WatcherPlugin
from hlplugin.dra.claims import (
    CHECKPOINT_FILE,
    CHECKPOINT_KIND,
    LOCK_FILE,
    Allocation,
    ClaimPreparer,
    NotAllocated,
    node_device,
)
from hlplugin.names import DRA_DRIVER, dra_socket_names

CDI_ID = "hyperlight.dev/hypervisor=kvm"
UID = "7d3c1a1e-0b7f-4c52-9d2e-2f8f6c1b0a11"
CLAIM = ("team-a", "claim-uid-1", "vm-claim")


class Node:
    """The kubelet's two directories for one test, and a CDI spec and a device whose health the
    test sets; ``device_checks`` counts the gate's device checks."""

    def __init__(self) -> None:
        root = short_dir()
        self.registry = root / "plugins_registry"
        self.plugin_dir = root / "plugins" / DRA_DRIVER
        self.registry.mkdir()
        self.tracker = HealthTracker(required=("cdi", "device"))
        self.tracker.set_condition("cdi", True)
        self.tracker.set_condition("device", True)
        self.device_checks = 0

    @property
    def checkpoint(self) -> Path:
        return self.plugin_dir / CHECKPOINT_FILE

    async def gate(self) -> HealthState:
        self.device_checks += 1
        return self.tracker.state

    async def cdi(self) -> Condition:
        return self.tracker.state.conditions["cdi"]

    def preparer(self, allocation: Allocation | None = None, **options: Any) -> ClaimPreparer:
        checkpoint = Checkpoint(self.plugin_dir, CHECKPOINT_FILE, CHECKPOINT_KIND,
                                **options.pop("checkpoint", {}))
        return ClaimPreparer(checkpoint, options.pop("gate", self.gate),
                             allocation or node_device("node-a", "kvm", CDI_ID), cdi=self.cdi,
                             **options)

    def recorded(self) -> set[str]:
        return set(json.loads(self.checkpoint.read_bytes())["entries"])


@dataclass
class Pod:
    plugin: WatcherPlugin
    preparer: ClaimPreparer
    task: asyncio.Task[None]
    verdicts: list[bool]  # the kubelet's, as on_status hears them (the daemon counts them)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.plugin, self.preparer))


@contextlib.asynccontextmanager
async def driver(node: Node, uid: str = UID, preparer: ClaimPreparer | None = None, *,
                 fails: bool = False, health: HealthStream | None = None) -> AsyncIterator[Pod]:
    """One driver pod's kubelet side, serving until the block ends (or its task is cancelled);
    with ``fails``, its task is expected to have failed by then (the block awaits it). With
    ``health`` it serves the health stream and lists it, as the daemon does; without, it lists
    only the DRAPlugin services."""
    preparer = preparer or node.preparer()
    await preparer.load()
    registration, service = dra_socket_names(uid)
    verdicts: list[bool] = []
    plugin = WatcherPlugin(node.registry, registration, node.plugin_dir / service, DRA_PLUGIN,
                           DRA_DRIVER, SERVICES if health else DRA_SERVICES,
                           functools.partial(new_dra_server, preparer, health), recheck=0.2,
                           on_status=verdicts.append)
    task = asyncio.create_task(plugin.run())
    try:
        yield Pod(plugin, preparer, task, verdicts)
    finally:
        task.cancel()
        await asyncio.wait({task})
        assert task.done() and not task.cancelled() if fails else task.cancelled(), task


async def registered(watcher: FakePluginWatcher, plugin: WatcherPlugin) -> None:
    async def done() -> bool:
        await watcher.sync()
        return plugin.registered and any(
            p.info.endpoint == str(plugin.endpoint_path) for p in watcher.plugins.values())

    await wait_until(done, 20, "the plugin watcher registered the driver")


def devices(response: object, uid: str) -> list[tuple[list[str], str, str, list[str]]]:
    entry = response.claims[uid]  # type: ignore[attr-defined]
    assert not entry.error, entry.error
    return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
            for d in entry.devices]


async def test_the_plugin_watcher_registers_the_driver_by_its_per_pod_socket() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        (info,) = watcher.infos
        assert (info.type, info.name) == ("DRAPlugin", "hyperlight.dev")
        assert info.endpoint == str(node.plugin_dir / f"dra-{UID}.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        (socket_path,) = watcher.plugins
        assert socket_path == node.registry / f"hyperlight.dev-{UID}-reg.sock"
        assert watcher.newest(DRA_DRIVER).service == "v1.DRAPlugin"
        assert plugin.status == ""
    assert os.listdir(node.registry) == [] and os.listdir(node.plugin_dir) == []


async def test_until_the_kubelet_calls_the_status_names_the_registry_dir() -> None:
    node = Node()
    async with driver(node) as (plugin, _):
        await wait_until(lambda: plugin.registration_path.exists(), 20, "the registration socket")
        assert not plugin.registered
        assert str(plugin.registration_path) in plugin.status
        assert "is the registry directory the kubelet's plugins_registry?" in plugin.status


async def test_a_registration_the_kubelet_refuses_is_said_in_the_status() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry, services=("v2.DRAPlugin",))
    async with driver(node) as pod:
        plugin = pod.plugin

        async def refused() -> bool:
            await watcher.sync()
            return bool(watcher.refused) and len(pod.verdicts) > 0

        await wait_until(refused, 20, "the kubelet refused the registration")
        assert not plugin.registered
        assert "the kubelet refused the registration: none of services" in plugin.status
        watcher.services = ("v1.DRAPlugin",)  # the kubelet retries; one that knows v1 accepts
        await registered(watcher, plugin)
        assert plugin.status == ""


async def test_a_restarted_kubelet_registers_the_same_socket_again() -> None:
    """Nothing in the registry directory is removed by a kubelet restart: the new kubelet's
    watcher finds our socket, calls GetInfo and notifies again, and the driver serves on."""
    node = Node()
    async with driver(node) as pod:
        plugin = pod.plugin
        await registered(FakePluginWatcher(node.registry), plugin)
        restarted = FakePluginWatcher(node.registry)
        await registered(restarted, plugin)
        assert len(pod.verdicts) == 2 and len(restarted.infos) == 1
        assert devices(await restarted.prepare(DRA_DRIVER, CLAIM), CLAIM[1])


async def test_the_kubelet_registers_a_socket_once_though_its_inode_changes_after() -> None:
    """publish() links the socket at its name, then unlinks its private name: the inode's ctime
    changes after the kubelet may have seen the socket. That is no new socket: a watcher that took
    it for one notified the driver twice, and a surge's old driver took the CDI spec back."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as pod:
        plugin = pod.plugin
        await registered(watcher, plugin)
        other = plugin.registration_path.with_name(".another-name")
        os.link(plugin.registration_path, other)
        os.unlink(other)  # as publish() removes the private name: only the ctime changes
        await watcher.sync()
        assert len(pod.verdicts) == 1 and len(watcher.infos) == 1


async def test_a_kubelet_that_knows_only_v1beta1_prepares_through_it() -> None:
    node = Node()
    for services, chosen in ((("v1beta1.DRAPlugin",), "v1beta1.DRAPlugin"),
                             (("v1.DRAPlugin", "v1beta1.DRAPlugin"), "v1.DRAPlugin")):
        watcher = FakePluginWatcher(node.registry, services=services)
        async with driver(node) as (plugin, _):
            await registered(watcher, plugin)
            newest = watcher.newest(DRA_DRIVER)
            assert newest.service == chosen
            response = await watcher.prepare(DRA_DRIVER, CLAIM)
            assert type(response).DESCRIPTOR.full_name == (
                f"k8s.io.kubelet.pkg.apis.dra.{chosen.split('.')[0]}.NodePrepareResourcesResponse")
            assert devices(response, CLAIM[1]) == [([], "node-a", "kvm", [CDI_ID])]


async def test_both_versions_answer_the_same_claim_the_same_and_record_it_once() -> None:
    """Prepare is idempotent whichever version asks: the same devices, one record, no rewrite."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        v1 = watcher.newest(DRA_DRIVER)
        first = devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
        written = os.stat(node.checkpoint).st_ino
        assert node.recorded() == {CLAIM[1]}
        v1beta1 = type(v1)(v1.socket, v1.identity, v1.info, "v1beta1.DRAPlugin")
        again = devices(await watcher.prepare(DRA_DRIVER, CLAIM, plugin=v1beta1), CLAIM[1])
        assert again == first
        assert os.stat(node.checkpoint).st_ino == written  # nothing new: not rewritten


async def test_a_share_of_a_shared_device_is_answered_in_v1_and_kept_across_a_restart() -> None:
    """Consumable capacity: the claim's share ID goes into v1's Device.share_id (1.36); v1beta1,
    which has no such field, answers the same device without it."""
    node = Node()
    shared = PreparedDevice((), "node-a", "kvm", (CDI_ID,), share="5f1c")

    async def allocation(claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        return (shared,)

    watcher = FakePluginWatcher(node.registry)
    async with driver(node, preparer=node.preparer(allocation)) as (plugin, _):
        await registered(watcher, plugin)
        entry = (await watcher.prepare(DRA_DRIVER, CLAIM)).claims[CLAIM[1]]
        assert [d.share_id for d in entry.devices] == ["5f1c"]
    async with driver(node) as (plugin, preparer):
        assert preparer.prepared[CLAIM[1]].devices == (shared,)
        await registered(watcher, plugin)
        v1 = watcher.newest(DRA_DRIVER)
        v1beta1 = type(v1)(v1.socket, v1.identity, v1.info, "v1beta1.DRAPlugin")
        old = (await watcher.prepare(DRA_DRIVER, CLAIM, plugin=v1beta1)).claims[CLAIM[1]]
        assert devices_of(old) == [([], "node-a", "kvm", [CDI_ID])]
        assert "share_id" not in type(old.devices[0]).DESCRIPTOR.fields_by_name


def devices_of(entry: Any) -> list[tuple[list[str], str, str, list[str]]]:
    return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
            for d in entry.devices]


async def test_every_claim_of_a_call_is_answered_by_its_uid() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        claims = [("ns", f"uid-{i}", f"claim-{i}") for i in range(5)]
        response = await watcher.prepare(DRA_DRIVER, *claims)
        assert set(response.claims) == {uid for _, uid, _ in claims}
        assert node.recorded() == {uid for _, uid, _ in claims}


async def test_unprepare_forgets_a_claim_is_idempotent_and_accepts_an_unknown_one() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        await watcher.prepare(DRA_DRIVER, CLAIM, ("ns", "other", "kept"))
        for _ in range(2):
            response = await watcher.unprepare(DRA_DRIVER, CLAIM, ("ns", "never-seen", "x"))
            assert {uid: e.error for uid, e in response.claims.items()} == {
                CLAIM[1]: "", "never-seen": ""}
            assert node.recorded() == {"other"}
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])  # prepared anew


async def test_an_unhealthy_device_refuses_every_claim_with_the_reason_and_records_none() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        node.tracker.set_condition("device", False, "KVM_CREATE_VM failed: EIO")
        response = await watcher.prepare(DRA_DRIVER, CLAIM, ("ns", "second", "c"))
        for uid in (CLAIM[1], "second"):
            error = response.claims[uid].error
            assert "not usable on this node" in error and "KVM_CREATE_VM failed: EIO" in error
            assert not response.claims[uid].devices
        assert not node.checkpoint.exists()
        node.tracker.set_condition("device", True)
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])


async def test_a_recorded_claim_keeps_its_answer_on_an_unhealthy_device_a_new_one_is_refused(
        ) -> None:
    """After a kubelet restart the kubelet prepares every running pod's claims again: on a node
    whose device turned unhealthy, a claim already recorded gets its recorded answer without a
    device check (here, also by a restarted driver, from the checkpoint alone), while a new
    claim of the same call is refused with the reason and not recorded."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        before = devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
        node.tracker.set_condition("device", False, "KVM_CREATE_VM failed: EIO")
        checks = node.device_checks
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1]) == before
        assert node.device_checks == checks  # a recorded claim asks no device check
        response = await watcher.prepare(DRA_DRIVER, CLAIM, ("ns", "new", "c"))
        assert devices(response, CLAIM[1]) == before
        error = response.claims["new"].error
        assert "not usable on this node" in error and "KVM_CREATE_VM failed: EIO" in error
        assert node.recorded() == {CLAIM[1]}
    async with driver(node) as (plugin, _):  # the driver restarted too
        await registered(watcher, plugin)
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1]) == before
        node.tracker.set_condition("device", True)
        assert devices(await watcher.prepare(DRA_DRIVER, ("ns", "new", "c")), "new")
        assert node.recorded() == {CLAIM[1], "new"}


async def test_no_claim_recorded_or_new_is_answered_without_the_cdi_spec() -> None:
    """The CDI check applies to every claim: a recorded claim is never answered with a CDI
    device the node has no spec for (the runtime could not resolve it), and stays recorded."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        before = devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
        node.tracker.set_condition("cdi", False, "/var/run/cdi/hyperlight.json is missing")
        response = await watcher.prepare(DRA_DRIVER, CLAIM, ("ns", "new", "c"))
        for uid in (CLAIM[1], "new"):
            error = response.claims[uid].error
            assert "CDI spec cannot resolve" in error and "hyperlight.json is missing" in error
            assert not response.claims[uid].devices
        assert node.recorded() == {CLAIM[1]}
        node.tracker.set_condition("cdi", True)
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1]) == before


async def test_prepared_claims_survive_a_restart_of_the_driver() -> None:
    """After a restart a claim prepared before gets its recorded answer, not a new one: here the
    new driver's allocation would refuse every claim, so only the checkpoint can answer."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        before = devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])

    async def refuse(claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        raise NotAllocated(f"claim {claim.describe()} has no device of hyperlight.dev")

    async with driver(node, preparer=node.preparer(refuse)) as (plugin, preparer):
        assert set(preparer.prepared) == {CLAIM[1]}
        await registered(watcher, plugin)
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1]) == before
        response = await watcher.prepare(DRA_DRIVER, ("ns", "new", "c"))
        assert "has no device of hyperlight.dev" in response.claims["new"].error


async def test_a_corrupt_checkpoint_is_refused_loudly_left_alone_and_mended_by_moving_it() -> None:
    node = Node()
    node.plugin_dir.mkdir(parents=True)
    torn = b'{"kind": "hyperlight.dev/prepared-claims", "version": 1, "entr'
    node.checkpoint.write_bytes(torn)
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, preparer):
        ok, reason = preparer.condition()
        assert not ok and str(node.checkpoint) in reason and "is not JSON" in reason
        await registered(watcher, plugin)  # still serving: the kubelet is told why, per claim
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        assert response.claims[CLAIM[1]].error.startswith("refusing to prepare: ")
        assert str(node.checkpoint) in response.claims[CLAIM[1]].error
        response = await watcher.unprepare(DRA_DRIVER, CLAIM)  # a pod's end never waits on us
        assert response.claims[CLAIM[1]].error == ""
        assert node.checkpoint.read_bytes() == torn  # never half-read, never overwritten
        node.checkpoint.rename(node.plugin_dir / "checkpoint.json.broken")
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
        assert preparer.condition() == (True, "")


async def test_a_checkpoint_whose_entries_have_another_shape_is_refused() -> None:
    """A checksum proves the bytes are the ones written, not that this version wrote them: an
    entry it cannot read field by field refuses the record, as a corrupt one."""
    from hlplugin.deviceplugin.kubelet.dra.checkpoint import encode

    node = Node()
    node.plugin_dir.mkdir(parents=True)
    node.checkpoint.write_bytes(encode(CHECKPOINT_KIND, {"uid-1": {"claim": "vm", "slots": 3}}))
    preparer = node.preparer()
    assert not await preparer.load()
    ok, reason = preparer.condition()
    assert not ok and "holds an entry of another shape (KeyError" in reason
    answers = await preparer.prepare([ClaimRef("ns", "uid-1", "vm")])
    assert answers["uid-1"].error.startswith("refusing to prepare: ")


async def test_a_symlinked_checkpoint_is_refused_and_its_target_untouched() -> None:
    node = Node()
    node.plugin_dir.mkdir(parents=True)
    target = node.plugin_dir.parent / "precious"
    target.write_text("not a checkpoint")
    node.checkpoint.symlink_to(target)
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, preparer):
        await registered(watcher, plugin)
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        assert "a symlink" in response.claims[CLAIM[1]].error
        assert not preparer.condition()[0]
    assert target.read_text() == "not a checkpoint" and node.checkpoint.is_symlink()


async def test_a_claim_that_cannot_be_recorded_is_not_answered_as_prepared() -> None:
    """A record that cannot be written (here: it would outgrow what it may read back) fails the
    claim with the reason (the kubelet retries); something not ours at the checkpoint's path
    after the start is refused when the record is read anew, and stays."""
    node = Node()
    small = node.preparer(checkpoint={"max_bytes": 256})
    watcher = FakePluginWatcher(node.registry)
    async with driver(node, preparer=small) as (plugin, _):
        await registered(watcher, plugin)
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        error = response.claims[CLAIM[1]].error
        assert error.startswith("cannot record the claim: cannot write ") and "over the 256" in error
        assert not response.claims[CLAIM[1]].devices and not node.checkpoint.exists()
        node.checkpoint.mkdir()
        response = await watcher.prepare(DRA_DRIVER, CLAIM)
        error = response.claims[CLAIM[1]].error
        assert error.startswith("refusing to prepare: ") and "is a directory" in error
        assert node.checkpoint.is_dir()


async def test_two_pods_of_a_surging_upgrade_serve_side_by_side() -> None:
    """Per-pod names: the new pod registers beside the old, the kubelet calls the newest, and the
    old one's exit removes only its own sockets."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    new_uid = "0a1b2c3d-0000-4000-8000-000000000002"
    async with driver(node) as old:
        await registered(watcher, old.plugin)
        async with driver(node, uid=new_uid) as new:
            await registered(watcher, new.plugin)
            assert len(watcher.plugins) == 2
            assert watcher.newest(DRA_DRIVER).info.endpoint == str(new.plugin.endpoint_path)
            await watcher.prepare(DRA_DRIVER, CLAIM)
            old.task.cancel()  # the old pod exits
            await asyncio.wait({old.task})
            await watcher.sync()
            assert [p.info.endpoint for p in watcher.plugins.values()] == [
                str(new.plugin.endpoint_path)]
            assert sorted(os.listdir(node.plugin_dir)) == sorted(
                [CHECKPOINT_FILE, LOCK_FILE, new.plugin.endpoint_path.name])
            assert os.listdir(node.registry) == [new.plugin.registration_path.name]
            assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])  # recorded


async def test_a_stopping_driver_withdraws_its_registration_and_stays_ready() -> None:
    """Stopped (cancelled), the registration socket goes first and the kubelet unregisters us,
    but readiness holds: a terminating pod's probe must not fail (a Warning event) while its
    servers stop. Removed by someone else, the registration is a failure (the next test)."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as pod:
        await registered(watcher, pod.plugin)
        pod.task.cancel()
        await asyncio.wait({pod.task})
        await watcher.sync()
        assert not watcher.plugins and os.listdir(node.registry) == []
        assert not pod.plugin.registered and pod.plugin.stopping and pod.plugin.ready
        assert pod.plugin.status.startswith("stopping: ")


async def test_a_removed_registration_socket_is_published_again() -> None:
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        os.unlink(plugin.registration_path)
        await watcher.sync()
        assert not watcher.plugins  # the kubelet unregistered us
        await wait_until(lambda: not plugin.ready, 20, "not ready while unregistered")
        assert not plugin.stopping
        await registered(watcher, plugin)
        assert len(watcher.infos) == 2


async def test_the_health_stream_reports_the_device_at_once_on_every_change_and_on_refresh() -> None:
    from hlplugin.api import dra_health_v1alpha1_pb2 as health_pb

    node = Node()
    open_streams: list[int] = []  # as the driver's hyperlight_dra_health_streams gauge is told
    health = HealthStream(node.tracker, lambda: [("node-a", "kvm")], refresh=0.5,
                          on_streams=open_streams.append)
    watcher = FakePluginWatcher(node.registry)
    async with driver(node, health=health) as (plugin, _):
        await registered(watcher, plugin)
        seen: list[tuple[int, str]] = []
        stream = watcher.watch_health(DRA_DRIVER)
        async with contextlib.aclosing(stream):
            first = await anext(stream)
            (device,) = first.devices
            assert (device.device.pool_name, device.device.device_name) == ("node-a", "kvm")
            assert (device.health, device.message) == (health_pb.HealthStatus.HEALTHY, "")
            assert device.health_check_timeout_seconds == 2 and device.last_updated_time > 0
            node.tracker.set_condition("device", False, "KVM_CREATE_VM failed: EIO")
            changed = (await anext(stream)).devices[0]
            assert changed.health == health_pb.HealthStatus.UNHEALTHY
            assert changed.message == "device: KVM_CREATE_VM failed: EIO"
            refreshed = (await anext(stream)).devices[0]  # no change: sent again within refresh
            seen.append((refreshed.health, refreshed.message))
            node.tracker.set_condition("device", True)
            assert (await anext(stream)).devices[0].health == health_pb.HealthStatus.HEALTHY
        assert seen == [(health_pb.HealthStatus.UNHEALTHY, "device: KVM_CREATE_VM failed: EIO")]
        await wait_until(lambda: open_streams == [1, 0], 20, "the stream's end seen by the driver")


async def test_the_health_service_is_listed_after_the_dra_services_and_never_chosen_for_calls(
        ) -> None:
    """GetInfo lists v1alpha1.DRAResourceHealth after the DRAPlugin services (as the Go
    kubeletplugin helper does), so a kubelet that opens the health stream only for a plugin that
    lists it (newer than 1.36) watches ours; whichever DRAPlugin version a kubelet knows, that one
    is chosen for Prepare, never the health service."""
    node = Node()
    health = HealthStream(node.tracker, lambda: [("node-a", "kvm")], refresh=0.5)
    for services, chosen in ((("v1beta1.DRAPlugin",), "v1beta1.DRAPlugin"),
                             (("v1.DRAPlugin", "v1beta1.DRAPlugin"), "v1.DRAPlugin")):
        watcher = FakePluginWatcher(node.registry, services=services)
        async with driver(node, health=health) as (plugin, _):
            await registered(watcher, plugin)
            (info,) = watcher.infos
            assert list(info.supported_versions) == [
                "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
            assert HEALTH_SERVICE == "v1alpha1.DRAResourceHealth"
            assert watcher.newest(DRA_DRIVER).service == chosen
            assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
            stream = watcher.watch_health(DRA_DRIVER)
            async with contextlib.aclosing(stream):
                assert (await anext(stream)).devices[0].device.device_name == "kvm"


async def test_the_kubelet_opens_no_health_stream_on_a_plugin_that_does_not_list_it() -> None:
    """The fake kubelet's rule, as upstream's TestHealthStreamRequiresAdvertisedService: a plugin
    listing only DRAPlugin services is registered and called, and never watched."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as (plugin, _):
        await registered(watcher, plugin)
        assert list(watcher.infos[0].supported_versions) == list(DRA_SERVICES)
        assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
        with pytest.raises(NoHealthStream, match=r"does not list v1alpha1\.DRAResourceHealth"):
            await anext(watcher.watch_health(DRA_DRIVER))


async def test_the_liveness_call_is_answered_while_a_prepare_waits_and_fails_on_a_mute_server(
        ) -> None:
    """answers() (the driver's /healthz check) needs no claim lock, so a Prepare stuck on slow
    storage cannot fail liveness; a socket that accepts and never speaks gRPC fails it within
    the timeout."""
    import socket

    from hlplugin.deviceplugin.kubelet.dra.draservice import answers

    node = Node()
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_gate() -> HealthState:
        entered.set()
        await release.wait()
        return node.tracker.state

    preparer = node.preparer(gate=slow_gate)
    watcher = FakePluginWatcher(node.registry)
    async with driver(node, preparer=preparer) as (plugin, _):
        await registered(watcher, plugin)
        waiting = asyncio.create_task(watcher.prepare(DRA_DRIVER, CLAIM))
        await asyncio.wait_for(entered.wait(), 20)
        assert await answers(plugin.endpoint_path, 2.0)
        release.set()
        assert devices((await waiting), CLAIM[1])
    mute = node.plugin_dir / "mute.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(mute))
        listener.listen(8)
        assert not await answers(mute, 0.5)
    assert not await answers(node.plugin_dir / "nothing.sock", 0.5)


async def test_a_second_instance_of_one_pod_waits_for_the_first_to_go_then_takes_over() -> None:
    """One server per socket (endpoint.py): a restarted container of the same pod (same UID)
    never takes the socket of a live predecessor; it serves once that one is gone."""
    node = Node()
    watcher = FakePluginWatcher(node.registry)
    async with driver(node) as first:
        await registered(watcher, first.plugin)
        async with driver(node) as second:
            await quiet(0.5, "the second instance must not take the live one's socket meanwhile")
            assert not second.plugin.serving and first.plugin.serving
            assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])
            first.task.cancel()
            await asyncio.wait({first.task})
            await wait_until(lambda: second.plugin.serving, 30, "the second instance serving")
            await registered(watcher, second.plugin)
            assert devices(await watcher.prepare(DRA_DRIVER, CLAIM), CLAIM[1])


async def test_something_not_a_socket_at_our_socket_names_is_refused_and_left_alone() -> None:
    """A regular file at the service socket's name, a symlink at the registration socket's: the
    driver stops with the reason (the kubelet restarts it, naming it in its log), and neither
    the file, the link nor the link's target is touched."""
    for kind in ("file at the endpoint", "symlink at the registration"):
        node = Node()
        registration, service = dra_socket_names(UID)
        node.plugin_dir.mkdir(parents=True)
        target = node.plugin_dir.parent / "precious"
        target.write_text("not ours")
        if kind == "file at the endpoint":
            squatter = node.plugin_dir / service
            squatter.write_text("not ours")
        else:
            squatter = node.registry / registration
            squatter.symlink_to(target)
        async with driver(node, fails=True) as pod:
            with pytest.raises(RuntimeError, match="exists and is not a socket; refusing to replace"):
                await asyncio.wait_for(asyncio.shield(pod.task), 20)
        assert target.read_text() == "not ours"
        assert squatter.is_symlink() if kind.startswith("symlink") else squatter.read_text() == "not ours"


async def test_two_instances_sharing_the_record_never_write_over_each_other() -> None:
    """A surge's two pods answer the kubelet from one record: each change is made under the
    instances' lock on the record read anew, so no claim one recorded is lost to the other's
    write, and one unprepared by either is gone for both."""
    node = Node()
    old, new = node.preparer(), node.preparer()
    await old.load()
    await new.load()

    def claim(uid: str) -> ClaimRef:
        return ClaimRef("ns", uid, f"claim-{uid}")

    await old.prepare([claim("c1")])
    await new.prepare([claim("c2")])
    await old.prepare([claim("c3")])  # from a view without c2, had it not read anew
    assert node.recorded() == {"c1", "c2", "c3"}
    assert await old.unprepare([claim("c2")]) == {"c2": ""}
    assert node.recorded() == {"c1", "c3"}
    await new.prepare([claim("c4")])
    assert node.recorded() == {"c1", "c3", "c4"}  # c2 not brought back by the other's view


async def test_a_lock_held_past_the_budget_fails_the_call_with_the_reason() -> None:
    import fcntl

    node = Node()
    preparer = node.preparer(lock_wait=0.3)
    await preparer.load()
    node.plugin_dir.mkdir(parents=True, exist_ok=True)
    other = os.open(node.plugin_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:  # another instance, mid-change
        fcntl.flock(other, fcntl.LOCK_EX)
        answers = await preparer.prepare([ClaimRef("ns", "c1", "c")])
        assert answers["c1"].error == (
            f"cannot prepare now: another instance of the driver has held "
            f"{node.plugin_dir / LOCK_FILE} for more than 0.3 s")
        errors = await preparer.unprepare([ClaimRef("ns", "c1", "c")])
        assert errors["c1"].startswith("cannot unprepare now: another instance")
        fcntl.flock(other, fcntl.LOCK_UN)
        assert not (await preparer.prepare([ClaimRef("ns", "c1", "c")]))["c1"].error
    finally:
        os.close(other)


async def test_a_symlink_at_the_lock_is_refused_and_its_target_untouched() -> None:
    node = Node()
    node.plugin_dir.mkdir(parents=True)
    target = node.plugin_dir.parent / "precious"
    target.write_text("not ours")
    (node.plugin_dir / LOCK_FILE).symlink_to(target)
    preparer = node.preparer()
    await preparer.load()
    answers = await preparer.prepare([ClaimRef("ns", "c1", "c")])
    assert "is a symlink; refusing to use what we do not own" in answers["c1"].error
    assert target.read_text() == "not ours" and (node.plugin_dir / LOCK_FILE).is_symlink()


async def test_a_recorded_claim_is_answered_from_memory_without_the_lock_or_a_write() -> None:
    """The kubelet prepares a pod's claims again at every container restart and after its own:
    a claim already recorded is answered from memory, even while another instance holds the
    instances' lock, and the record is not rewritten; a new claim still waits for the lock."""
    import fcntl

    node = Node()
    preparer = node.preparer(lock_wait=0.3)
    await preparer.load()
    first = await preparer.prepare([ClaimRef(*CLAIM)])
    written = os.stat(node.checkpoint)
    other = os.open(node.plugin_dir / LOCK_FILE, os.O_RDWR)
    try:  # another instance, mid-change
        fcntl.flock(other, fcntl.LOCK_EX)
        again = await preparer.prepare([ClaimRef(*CLAIM)])
        assert again == first and not again[CLAIM[1]].error
        refused = await preparer.prepare([ClaimRef(*CLAIM), ClaimRef("ns", "new", "c")])
        assert refused["new"].error.startswith("cannot prepare now: another instance")
    finally:
        os.close(other)
    assert (os.stat(node.checkpoint).st_ino, os.stat(node.checkpoint).st_mtime_ns) == (
        written.st_ino, written.st_mtime_ns)


async def test_a_claim_another_instance_unprepared_is_recorded_again_not_answered_from_memory(
        ) -> None:
    """Memory answers only while it is the record: once the other instance of a surge has
    unprepared a claim (a new record), preparing it here again records it again, so the kubelet
    is never told "prepared" for a claim the record lacks; the same when the record was moved
    aside by hand."""
    node = Node()
    old, new = node.preparer(), node.preparer()
    await old.load()
    await new.load()
    claim = ClaimRef(*CLAIM)
    assert not (await old.prepare([claim]))[CLAIM[1]].error
    assert await new.unprepare([claim]) == {CLAIM[1]: ""}
    assert node.recorded() == set()
    assert not (await old.prepare([claim]))[CLAIM[1]].error
    assert node.recorded() == {CLAIM[1]}
    node.checkpoint.rename(node.plugin_dir / "checkpoint.json.aside")
    assert not (await old.prepare([claim]))[CLAIM[1]].error
    assert node.recorded() == {CLAIM[1]}
