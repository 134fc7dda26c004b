"""The DRA driver's control-plane side: this node's ResourceSlice, published and kept as the
reference controller (k8s.io/dynamic-resource-allocation/resourceslice) keeps it.

One slice per node (docs/dra.md, "ResourceSlice shape"; issue 41 item 2, tried by hand on the
1.36 cluster): driver ``hyperlight.dev``, ``nodeName`` and pool = the node's name, one device
named after the hypervisor, shared (``allowMultipleAllocations``) through a consumable capacity
``slots``, with attributes a DeviceClass or a claim selects on, owned by the Node.

What it promises, and why:

- **Put back.** It watches its own slices (``spec.driver`` and ``spec.nodeName``) and writes the
  slice again when it is deleted or edited: the scheduler allocates only what a slice says.
- **Generation.** Every write takes the pool's generation above the highest seen on any of our
  slices (a restart starts from what it finds), so a stray older slice of the pool is obsolete
  to the scheduler. A slice already as wanted is not written: two instances of a surge want the
  same slice, and neither rewrites the other's.
- **Never deleted on stop.** Stopping (SIGTERM, a crash, an upgrade) leaves the slice: pods keep
  being scheduled against it while a new pod starts, and the kubelet removes a driver's slices
  itself when the driver stays disconnected past its grace period.
- **Outages.** The API server unreachable (or refusing) is retried with back-off, forever, and
  said in ``condition()`` (for ``/readyz``): a 403 names the verb and the resource the service
  account lacks. The kubelet side never waits on any of it.
- **Dropped fields.** What the server stored is compared with what was sent; a field it dropped
  (its feature gate off) is logged by name, and the stored form is then taken as the slice wanted
  (else each watch event would rewrite it, for ever).
- **Health.** See ``SliceController.set_healthy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
from typing import Any

from hlplugin.kubeapi import (
    NODES,
    RESOURCE_SLICES,
    AlreadyExists,
    ApiError,
    Client,
    Event,
    EventType,
    KubeApiError,
    Listed,
    NotFound,
    Object,
    modify,
    reflect,
)
from hlplugin.names import DRA_DRIVER
from hlplugin.nodefacts import NodeDevice
from hlplugin.settings import DraPluginSettings

log = logging.getLogger(__name__)

# Allocations one device takes at once (a claim consumes one slot by default): --slots's default.
SLOTS = DraPluginSettings().slots
# What a request that names no capacity consumes: one slot. Without a policy it would consume the
# whole device (KEP-5075), so a claim asking only for the DeviceClass, and every claim the
# scheduler makes for a pod asking the extended resource (KEP-5004), would hold the node alone.
# Quantities as the API server writes them back, so the stored slice matches the one sent.
REQUEST_POLICY = {"default": "1", "validRange": {"min": "1"}}
UNHEALTHY_TAINT = {"key": f"{DRA_DRIVER}/unhealthy", "effect": "NoSchedule"}
MAX_NAME = 253  # a DNS subdomain
MAX_BACKOFF_STEP = 16  # past this the back-off is at its cap anyway


def slice_name(node: str, driver: str = DRA_DRIVER) -> str:
    """``<node>-<driver>``: deterministic, so a restarted driver (or the other pod of a surge)
    finds the slice it would write, and a valid DNS subdomain whenever the node's name is one
    (the API's rule for both). A name past 253 characters keeps its start and a hash of the whole."""
    name = f"{node}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:MAX_NAME - len(digest) - 1].rstrip('-.')}-{digest}"


def dropped_fields(sent: Any, stored: Any, path: str = "") -> list[str]:
    """The paths of ``sent`` that ``stored`` lacks: what the server dropped (a field of a feature
    gate that is off is dropped silently, not refused). Lists compare by position."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        return [found for key, value in sent.items()
                for found in ([f"{path}.{key}"] if key not in stored
                              else dropped_fields(value, stored[key], f"{path}.{key}"))]
    if isinstance(sent, list) and isinstance(stored, list):
        return [found for i, item in enumerate(sent)
                for found in ([f"{path}[{i}]"] if i >= len(stored)
                              else dropped_fields(item, stored[i], f"{path}[{i}]"))]
    return []


def _generation(obj: Object) -> int:
    value = (obj.get("spec") or {}).get("pool", {}).get("generation", 0)
    return value if isinstance(value, int) else 0


def _content(obj: Object) -> Object:
    """What we keep as we want it: the spec but the pool's generation, and the owners."""
    spec = copy.deepcopy(obj.get("spec") or {})
    if isinstance(spec.get("pool"), dict):
        spec["pool"].pop("generation", None)
    return {"spec": spec, "ownerReferences": (obj.get("metadata") or {}).get("ownerReferences")}


def describe(exc: KubeApiError) -> str:
    """The reason ``condition()`` gives: a 403 says which permission to grant."""
    if isinstance(exc, ApiError) and exc.status == 403:
        return (f"forbidden: {exc.verb} {exc.resource} (grant the driver's service account "
                f"'{exc.verb}' on {exc.resource}): {exc.message}")
    return str(exc)


class SliceController:
    """Publishes and keeps this node's slice until cancelled (``run``); never deletes it."""

    def __init__(self, client: Client, node: str, device: NodeDevice, *, slots: int = SLOTS,
                 healthy: bool = True, driver: str = DRA_DRIVER) -> None:
        self.client, self.node, self.device, self.slots, self.driver = client, node, device, slots, driver
        self.name = slice_name(node, driver)
        self.healthy = healthy
        self.generation = 0  # the highest seen on any of our slices, or written
        self.dropped: tuple[str, ...] = ()  # what the server dropped from our last write
        self.taints_dropped = False  # the server has no device taints: withdraw instead
        self.published: Object | None = None  # the slice as the server stored our last write
        self._slices: dict[str, Object] = {}  # ours, as last seen
        self._listed = False
        self._owner: Object | None = None
        self._written: tuple[Object, Object] | None = None  # (content sent, content stored)
        self._problems: dict[str, str] = {}
        self._sent: Object | None = None  # what modify's last change asked to write
        self._wake = asyncio.Event()

    @property
    def selector(self) -> str:
        return f"spec.driver={self.driver},spec.nodeName={self.node}"

    def condition(self) -> tuple[bool, str]:
        """``slices`` for /readyz: published, else why not (each failing side's reason)."""
        if self._problems:
            return False, "; ".join(f"{side}: {why}" for side, why in sorted(self._problems.items()))
        if self.published is None:
            return False, f"slice {self.name} not published yet"
        return True, f"slice {self.name} published (pool generation {self.generation})"

    def set_healthy(self, healthy: bool) -> None:
        """An unhealthy device takes no new allocation, while pods that hold it keep running: the
        device stays published with a taint ``hyperlight.dev/unhealthy`` of effect NoSchedule,
        rather than being withdrawn. Claims already allocated keep naming a device that exists,
        the scheduler's reason for a Pending pod names the taint, and health coming back is the
        taint removed. Where the server drops ``taints`` (gate DRADeviceTaints off) the device
        is withdrawn instead (the pool published empty): running pods keep their prepared claims
        (the kubelet does not unprepare them), but no new claim is allocated it."""
        if healthy != self.healthy:
            self.healthy = healthy
            self._wake.set()

    def desired(self) -> Object:
        """The slice wanted now, without metadata.resourceVersion or the pool's generation."""
        device: Object = {"name": self.device.hypervisor, "attributes": self.device.attributes(),
                          "allowMultipleAllocations": True,
                          "capacity": {"slots": {"value": str(self.slots),
                                                 "requestPolicy": dict(REQUEST_POLICY)}}}
        devices = [device]
        if not self.healthy:
            if self.taints_dropped:
                devices = []
            else:
                device["taints"] = [dict(UNHEALTHY_TAINT)]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": self.name,
                             "ownerReferences": [self._owner] if self._owner else []},
                "spec": {"driver": self.driver, "nodeName": self.node,
                         "pool": {"name": self.node, "resourceSliceCount": 1},
                         "devices": devices}}

    def matches(self, stored: Object) -> bool:
        """The stored slice is as wanted: as sent, or as the server stored what we sent (its
        defaults added, a field of a gate that is off dropped)."""
        wanted, found = _content(self.desired()), _content(stored)
        return found == wanted or self._written == (wanted, found)

    async def run(self) -> None:
        """Watch our slices and publish ours, until cancelled. Nothing is deleted on the way out."""
        self._wake.set()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch())
            tasks.create_task(self._publish())

    async def _retry(self, side: str, exc: KubeApiError, failures: int) -> None:
        why = describe(exc)
        if self._problems.get(side) != why:
            log.warning("ResourceSlice %s: %s; retrying with back-off", side, why)
        self._problems[side] = why
        await self.client.backoff.wait(min(failures, MAX_BACKOFF_STEP),
                                       getattr(exc, "retry_after", None))

    async def _watch(self) -> None:
        failures = 0
        while True:
            try:
                async with contextlib.aclosing(reflect(self.client, RESOURCE_SLICES,
                                                       field_selector=self.selector)) as changes:
                    async for change in changes:
                        failures = 0
                        self._problems.pop("watch", None)
                        self._seen(change)
            except KubeApiError as exc:
                failures += 1
                await self._retry("watch", exc, failures)

    def _seen(self, change: Listed | Event) -> None:
        if isinstance(change, Listed):
            self._slices = {o["metadata"]["name"]: o for o in change.items}
            self._listed = True
        elif change.type is EventType.DELETED:
            self._slices.pop(change.object["metadata"]["name"], None)
        elif change.type in (EventType.ADDED, EventType.MODIFIED):
            self._slices[change.object["metadata"]["name"]] = change.object
        else:
            return
        self.generation = max([self.generation, *map(_generation, self._slices.values())])
        self._wake.set()

    async def _publish(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._listed:
                continue  # the first listing says what is there, and its generation
            try:
                await self._sync()
            except KubeApiError as exc:
                failures += 1
                self._wake.set()  # try again after the back-off
                await self._retry("publish", exc, failures)
            else:
                failures = 0
                self._problems.pop("publish", None)

    async def _sync(self) -> None:
        if self._owner is None:
            node = await self.client.get(NODES, self.node)
            # controller: true, as the reference controller sets it: no other controller may
            # claim the slice, and the garbage collector deletes it with the Node either way.
            # No blockOwnerDeletion: it would need delete permission on nodes.
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                           "uid": node["metadata"]["uid"], "controller": True}
        current = self._slices.get(self.name)
        if current is not None and self.matches(current):
            self.published = current
            return
        if current is None:
            wanted = self._next(None)
            try:
                self._stored(wanted, await self.client.create(RESOURCE_SLICES, wanted))
                return
            except AlreadyExists:
                pass  # made since our watch last said: read it and update it
        self._sent = None
        try:
            stored = await modify(self.client, RESOURCE_SLICES, self.name, self._change)
        except NotFound:
            self._slices.pop(self.name, None)  # deleted since: the next pass creates it
            self._wake.set()
            return
        if self._sent is not None:
            self._stored(self._sent, stored)

    def _change(self, current: Object) -> Object | None:
        """modify's change: None when the slice read is as wanted, else ours at its version."""
        self._sent = None
        self._slices[self.name] = current
        if self.matches(current):
            self.published = current
            return None
        wanted = self._next(current)
        wanted["metadata"] = {**current.get("metadata", {}), **wanted["metadata"]}
        self._sent = wanted
        return wanted

    def _next(self, current: Object | None) -> Object:
        wanted = self.desired()
        self.generation = max(self.generation, _generation(current or {})) + 1
        wanted["spec"]["pool"]["generation"] = self.generation
        return wanted

    def _stored(self, sent: Object, stored: Object) -> None:
        """After a write: what the server kept, compared with what was sent."""
        self._slices[self.name] = self.published = stored
        self._written = (_content(sent), _content(stored))
        dropped = tuple(f"spec{p}" for p in dropped_fields(sent.get("spec"), stored.get("spec")))
        if dropped and dropped != self.dropped:
            log.warning("the API server dropped %s from ResourceSlice %s (its feature gate is "
                        "probably off): the slice is published without it", ", ".join(dropped),
                        self.name)
        self.dropped = dropped
        if not self.taints_dropped and any(".taints" in p for p in dropped):
            self.taints_dropped = True
            log.warning("the API server keeps no device taints (gate DRADeviceTaints off): the "
                        "unhealthy device is withdrawn from ResourceSlice %s instead", self.name)
            self._wake.set()
