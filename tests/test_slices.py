"""The slice controller (hlplugin.dra.slices) against the fake API server on loopback: the slice's
shape, put back when deleted or edited, its pool generation, left in place on stop, kept through
an outage and a 403 (said in its condition), a field the server drops named, and health as a
device taint (or the device withdrawn where the server keeps no taints)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import wait_until
from support.fakeapi import FakeApiServer, Sleeps
from support.fakeslices import NODE, GateOffApiServer, PortApiServer, add_node
from support.waits import quiet

from hlplugin.dra.slices import SliceController, slice_name
from hlplugin.kubeapi import RESOURCE_SLICES, Backoff, Client, Config
from hlplugin.nodefacts import NodeDevice

SLICES = RESOURCE_SLICES.path()
NAME = f"{NODE}-hyperlight.dev"
DEVICE = NodeDevice("kvm", kvm_api_version=12, node_is_virtual=True, cpu_vendor="GenuineIntel")
# A hang fails in seconds: nothing here waits on time (the back-off's sleeps are injected).
pytestmark = pytest.mark.guard(20)
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def stored(server: FakeApiServer, name: str = NAME) -> dict[str, Any] | None:
    return server.objects.get(SLICES, {}).get(("", name))


def writes(server: FakeApiServer) -> int:
    return len(server.seen("create")) + len(server.seen("update"))


@contextlib.asynccontextmanager
async def running(server: FakeApiServer | None = None, *, url: str = "", sleeps: Sleeps | None = None,
                  **options: Any) -> AsyncIterator[SliceController]:
    """A controller of node-a's slice, run until the block ends (then cancelled, as a SIGTERM
    ends the daemon's tasks)."""
    backoff = Backoff(attempts=2, sleep=sleeps or Sleeps(), random=lambda: 1.0)
    client = Client(Config.from_url(url or (server.url if server else "")), backoff)
    controller = SliceController(client, NODE, DEVICE, **options)
    task = asyncio.create_task(controller.run())
    try:
        yield controller
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def published(server: FakeApiServer, controller: SliceController, what: str = "published",
                    check: Any = None) -> dict[str, Any]:
    def done() -> bool:
        found = stored(server)
        return (found is not None and controller.condition()[0]
                and controller.published == found and (check is None or check(found)))

    await wait_until(done, 10, what)
    found = stored(server)
    assert found is not None
    return found


async def test_the_slice_has_the_shape_tried_on_the_cluster() -> None:
    async with FakeApiServer() as server:
        uid = add_node(server)
        async with running(server, slots=2000) as controller:
            found = await published(server, controller)
        assert found["metadata"]["name"] == NAME and DNS_SUBDOMAIN.fullmatch(NAME)
        assert found["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]
        assert found["spec"] == {
            "driver": "hyperlight.dev", "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "kvm", "allowMultipleAllocations": True,
                         "capacity": {"slots": {"value": "2000", "requestPolicy": {
                             "default": "1", "validRange": {"min": "1"}}}},
                         "attributes": {"hypervisor": {"string": "kvm"},
                                        "kvmApiVersion": {"int": 12},
                                        "nodeIsVirtual": {"bool": True},
                                        "cpuVendor": {"string": "GenuineIntel"}}}]}
        assert server.seen("watch")[0].query["fieldSelector"] == (
            f"spec.driver=hyperlight.dev,spec.nodeName={NODE}")
        assert controller.condition() == (True, f"slice {NAME} published (pool generation 1)")


def test_a_name_too_long_for_the_api_is_shortened_and_stays_distinct() -> None:
    long = "n" * 250
    assert len(slice_name(long)) == 253 and DNS_SUBDOMAIN.fullmatch(slice_name(long))
    assert slice_name(long) != slice_name(long + "x")


async def test_a_deleted_slice_is_put_back_with_a_higher_generation() -> None:
    async with FakeApiServer() as server:
        add_node(server)
        async with running(server) as controller:
            first = await published(server, controller)
            server.remove(SLICES, NAME)
            again = await published(server, controller, "put back",
                                    lambda s: s["metadata"]["uid"] != first["metadata"]["uid"])
        assert again["spec"]["pool"]["generation"] == 2
        assert again["spec"]["devices"] == first["spec"]["devices"]


async def test_an_edited_slice_is_put_back_by_an_update_at_its_version() -> None:
    async with FakeApiServer() as server:
        add_node(server)
        async with running(server) as controller:
            first = await published(server, controller)
            edited = {**first, "spec": {**first["spec"], "devices": [
                {"name": "kvm", "capacity": {"slots": {"value": "1"}}}]}}
            version = server.put(SLICES, edited)["metadata"]["resourceVersion"]
            again = await published(server, controller, "put back",
                                    lambda s: s["spec"]["devices"] == first["spec"]["devices"])
        update = server.seen("update")[-1]
        assert update.body is not None and update.body["metadata"]["resourceVersion"] == version
        assert again["metadata"]["uid"] == first["metadata"]["uid"]
        assert again["spec"]["pool"]["generation"] == 2


async def test_the_generation_starts_above_the_highest_found() -> None:
    """A restart finds its old slice (older content, generation 7) and a stray one of the pool
    (generation 9): its write goes above both, so the stray one is obsolete to the scheduler."""
    async with FakeApiServer() as server:
        add_node(server)
        spec = {"driver": "hyperlight.dev", "nodeName": NODE, "devices": []}
        server.put(SLICES, {"metadata": {"name": NAME},
                            "spec": {**spec, "pool": {"name": NODE, "generation": 7}}})
        server.put(SLICES, {"metadata": {"name": "stray"},
                            "spec": {**spec, "pool": {"name": NODE, "generation": 9}}})
        async with running(server) as controller:
            found = await published(server, controller, "updated",
                                    lambda s: s["spec"]["devices"] != [])
        assert found["spec"]["pool"]["generation"] == 10


async def test_a_slice_already_as_wanted_is_not_written_again() -> None:
    """The other pod of a surge (or a restart) wants the same slice: it leaves it as it is, so
    two instances never rewrite each other's generation."""
    async with FakeApiServer() as server:
        add_node(server)
        async with running(server) as first:
            await published(server, first)
        async with running(server) as second:
            await published(server, second)
            await quiet(0.1, "a write that must not come")
        assert writes(server) == 1


async def test_stopping_leaves_the_slice() -> None:
    async with FakeApiServer() as server:
        add_node(server)
        async with running(server) as controller:
            found = await published(server, controller)
        assert stored(server) == found
        assert server.seen("delete") == []


async def test_an_unreachable_api_server_is_said_and_the_slice_published_once_it_is_back() -> None:
    async with FakeApiServer() as gone:
        url, port = gone.url, int(gone.url.rsplit(":", 1)[1])
    sleeps = Sleeps()
    async with running(url=url, sleeps=sleeps) as controller:
        await wait_until(lambda: "cannot connect" in controller.condition()[1], 10, "the reason")
        assert controller.condition()[1].startswith("watch: cannot connect to the API server at")
        assert not controller.condition()[0]
        async with PortApiServer(port) as server:
            add_node(server)
            await published(server, controller)
    assert sleeps.delays and max(sleeps.delays) <= Backoff().cap


async def test_a_403_names_the_verb_and_resource_and_publishing_resumes_once_granted() -> None:
    async with FakeApiServer() as server:
        add_node(server)
        server.fail(403, "create", times=10**9)
        async with running(server) as controller:
            await wait_until(lambda: "forbidden" in controller.condition()[1], 10, "the reason")
            ok, why = controller.condition()
            assert not ok and why.startswith("publish: forbidden: create "
                                             "resourceslices.resource.k8s.io (grant")
            server.faults.clear()  # the role fixed
            await published(server, controller)


async def test_a_field_the_server_drops_is_named_and_not_rewritten(
        caplog: pytest.LogCaptureFixture) -> None:
    async with GateOffApiServer("allowMultipleAllocations") as server:
        add_node(server)
        with caplog.at_level(logging.WARNING, "hlplugin.dra.slices"):
            async with running(server) as controller:
                await published(server, controller)
                await quiet(0.1, "a rewrite that must not come")
        assert controller.dropped == ("spec.devices[0].allowMultipleAllocations",)
        assert "dropped spec.devices[0].allowMultipleAllocations" in caplog.text
        assert writes(server) == 1


async def test_an_unhealthy_device_is_tainted_and_untainted_when_healthy() -> None:
    async with FakeApiServer() as server:
        add_node(server)
        async with running(server) as controller:
            healthy = await published(server, controller)
            assert "taints" not in healthy["spec"]["devices"][0]
            controller.set_healthy(False)
            tainted = await published(server, controller, "tainted",
                                      lambda s: "taints" in s["spec"]["devices"][0])
            assert tainted["spec"]["devices"][0]["taints"] == [
                {"key": "hyperlight.dev/unhealthy", "effect": "NoSchedule"}]
            controller.set_healthy(True)
            await published(server, controller, "untainted",
                            lambda s: "taints" not in s["spec"]["devices"][0])


async def test_without_device_taints_an_unhealthy_device_is_withdrawn(
        caplog: pytest.LogCaptureFixture) -> None:
    async with GateOffApiServer("taints") as server:
        add_node(server)
        async with running(server, healthy=False) as controller:
            await published(server, controller, "withdrawn", lambda s: s["spec"]["devices"] == [])
            assert controller.taints_dropped
            controller.set_healthy(True)
            back = await published(server, controller, "back", lambda s: s["spec"]["devices"] != [])
        assert back["spec"]["devices"][0]["name"] == "kvm"
        assert "keeps no device taints" in caplog.text
