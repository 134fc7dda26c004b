"""The servicer base: streams a HealthTracker as a device list, and bounds what a client may ask.

It holds everything a device plugin's server shares (ListAndWatch, stream bookkeeping, the empty
options and answers, and Allocate's skeleton: check the request, gate, refuse, one answer per
container, count); a concrete plugin adds only its device IDs, its gate and its grant per container,
as the kubelet's own stub takes an allocFunc.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Hashable
from enum import StrEnum
from typing import Any, NoReturn

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.deviceplugin.health import repeats
from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.deviceplugin.kubelet.context import Context
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import HEALTHY, UNHEALTHY, DeviceList
from hlplugin.deviceplugin.kubelet.deviceplugin.interfaces import PluginServicer
from hlplugin.deviceplugin.metrics import AllocationResult, DevicePluginMetrics
from hlplugin.deviceplugin.quoting import quote

log = logging.getLogger(__name__)

# Bounds on what a DevicePlugin client may ask (docs/security.md, "Bounds on the device-plugin
# socket"). The kubelet opens one ListAndWatch stream per registration and sends one container
# per Allocate call, with IDs we advertised; past these bounds a call is refused at once.
MAX_STREAMS = 8
MAX_CONTAINERS = 128
MAX_ID_BYTES = 128
# The server's receive limit: room for every advertised ID in one request, plus this much.
REQUEST_SLACK_BYTES = 64 * 1024


class RefusalKind(StrEnum):
    """What kind of refusal an Allocate got: the log aggregates refusals by kind (field ``kind``).

    A malformed or unknown-ID refusal quotes what the request said, which a client can vary at
    will: each kind takes one cause of the log's aggregation (its latest example, and a count),
    whatever the IDs, the container count or any other field, so a flood of them never crowds out
    a new real fault. An unusable refusal says what our own checks found, which no request
    changes: each different problem is a line of its own at once.
    """

    MALFORMED = "malformed"  # past a bound, no containers, a container without IDs, an empty ID
    UNKNOWN_IDS = "unknown_ids"  # IDs this plugin does not advertise
    UNUSABLE = "unusable"  # the gate: the device cannot be handed out now


class TrackedDevicePlugin(PluginServicer):
    """Advertises ``device_ids``, all Healthy or all Unhealthy as the tracker says.

    Every ListAndWatch stream sends the latest list after its previous write completed, never a
    backlog: a reader that stops reading holds one message, whatever the number of transitions.
    The streams share one waiter on the tracker, which exists only while a stream is open.
    """

    # What a refusal of an unknown ID adds after the IDs it names (e.g. which IDs we advertise).
    advertised_hint = ""

    def __init__(self, device_ids: Collection[str] | DeviceList, tracker: HealthTracker,
                 metrics: DevicePluginMetrics | None = None, *,
                 first: asyncio.Future[Any] | None = None) -> None:
        """``first``: what the first list waits for, when the plugin serves before its first
        checks are done (they set the tracker's conditions: the kubelet's first list is true)."""
        # A DeviceList passed in is shared, serialized lists and all (one per process at the
        # ceiling, whatever the number of registrations); IDs alone get one of their own.
        self.devices = device_ids if isinstance(device_ids, DeviceList) else DeviceList(device_ids)
        self.device_ids = self.devices.ids
        self.tracker = tracker
        self.metrics = metrics
        self.open_streams = 0
        self.max_streams = MAX_STREAMS
        self.max_request_bytes = REQUEST_SLACK_BYTES + sum(len(i) + 8 for i in self.device_ids)
        self.on_streams_changed: Callable[[], None] | None = None
        self._closed = False
        self._refusing = False
        # A kubelet retrying a pod on an unhealthy node, or a client in a loop: one line per
        # kind of refusal (see RefusalKind) and interval; the allocations counter counts each.
        self.refusals = repeats.RepeatedLines(log)
        self._wake = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None
        self._first = first

    async def gate(self) -> str | None:
        """Whether Allocate may grant now: None, or why not (the refusal's message). Called after
        the request passed its checks; the default grants always."""
        return None

    def grant(self, container: pb.ContainerAllocateRequest,
              answer: pb.ContainerAllocateResponse) -> None:
        """Fill ``answer``, the response to ``container`` (a request that passed the checks and
        the gate)."""
        raise NotImplementedError

    async def Allocate(self, request: pb.AllocateRequest,
                       context: Context) -> pb.AllocateResponse:
        await self.check_request(request, context, self.advertised_hint)
        problem = await self.gate()
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, problem,
                               AllocationResult.REFUSED, RefusalKind.UNUSABLE)
        response = pb.AllocateResponse()
        for container in request.container_requests:
            self.grant(container, response.container_responses.add())
        if self.metrics is not None:
            self.metrics.allocations.labels(result=AllocationResult.SUCCESS).inc()
        return response

    def close_streams(self) -> None:
        self._closed = True
        self._stop_following()
        self._notify()

    async def GetDevicePluginOptions(self, request: pb.Empty,
                                     context: Context) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False,
                                      get_preferred_allocation_available=False)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Context
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse()

    async def PreStartContainer(self, request: pb.PreStartContainerRequest,
                                context: Context) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    async def ListAndWatch(self, request: pb.Empty,
                           context: Context) -> AsyncIterator[bytes]:  # see devicelist
        if self.open_streams >= self.max_streams:
            # Logged once while at the bound, so a client retrying in a loop cannot flood the log.
            log.log(logging.DEBUG if self._refusing else logging.WARNING,
                    "refused a ListAndWatch stream: %d are open already (at most %d)",
                    self.open_streams, self.max_streams)
            self._refusing = True
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.open_streams} ListAndWatch streams are open already, the most this plugin "
                f"serves at once (the kubelet opens one per registration)")
        self._stream_opened(+1)
        try:
            if self._first is not None:
                await asyncio.shield(self._first)
            sent: bool | None = None
            while not self._closed:
                wake = self._wake  # taken before looking at the state, so no change is missed
                state = self.tracker.state
                if state.healthy == sent:
                    await wake.wait()
                    continue
                first = sent is None
                sent = state.healthy
                self._publish(state)
                # Resumes once gRPC took the message; the loop then sends the state as it is now.
                yield self.devices.wire(state.healthy)
                if first:  # now the kubelet has the list: what it counts as the node's capacity
                    log.info("advertising %d devices to the kubelet, all %s", len(self.device_ids),
                             HEALTHY if state.healthy else UNHEALTHY)
        finally:
            self._stream_opened(-1)

    async def check_request(self, request: pb.AllocateRequest, context: Context,
                            advertised: str = "") -> None:
        """Refuse (INVALID_ARGUMENT) a request past the bounds, of a shape the kubelet never
        sends (no containers, a container naming no ID, an empty ID), or naming an ID we do not
        advertise; the message quotes at most a short escaped prefix of what it got."""
        containers = request.container_requests

        async def malformed(message: str) -> NoReturn:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, message,
                               AllocationResult.INVALID, RefusalKind.MALFORMED)

        if not containers:
            await malformed("no container requests in the Allocate (the kubelet sends one)")
        if len(containers) > MAX_CONTAINERS:
            await malformed(f"{len(containers)} container requests in one Allocate; at most "
                            f"{MAX_CONTAINERS} are served (the kubelet sends one)")
        most = len(self.device_ids)
        for n, container in enumerate(containers):
            if not container.devices_ids:
                await malformed(f"container request {n} names no device IDs")
            if len(container.devices_ids) > most:
                await malformed(f"container request {n} names {len(container.devices_ids)} "
                                f"device IDs; this plugin advertises {most}")
            for i in container.devices_ids:
                if not i:
                    await malformed(f"container request {n} names an empty device ID")
                if len(i.encode(errors="replace")) > MAX_ID_BYTES:
                    await malformed(f"device ID {quote(i)} is longer than {MAX_ID_BYTES} bytes")
        unknown = sorted({i for c in containers for i in c.devices_ids
                          if i not in self.device_ids})
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"unknown device IDs {', '.join(quote(i) for i in unknown[:5])}"
                               f"{more}{advertised}", AllocationResult.INVALID,
                               RefusalKind.UNKNOWN_IDS)

    def _stream_opened(self, delta: int) -> None:
        self.open_streams += delta
        if self.open_streams < self.max_streams:
            self._refusing = False
        if self.metrics is not None:
            self.metrics.streams.inc(delta)
        if self.open_streams and self._follower is None and not self._closed:
            self._follower = asyncio.create_task(self._follow(), name="follow health")
        elif not self.open_streams:
            self._stop_following()
        if self.on_streams_changed is not None:
            self.on_streams_changed()

    async def _follow(self) -> None:
        """The one waiter on the tracker while streams are open: wakes them on every change."""
        state = self.tracker.state
        while True:
            state = await self.tracker.wait_for_change(state.generation)
            self._notify()

    def _stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def _publish(self, state: HealthState) -> None:
        if self.metrics is not None:
            self.metrics.devices_advertised.set(len(self.device_ids))
            self.metrics.devices_healthy.set(len(self.device_ids) if state.healthy else 0)

    async def _refuse(self, context: Context, code: grpc.StatusCode, message: str,
                      result: AllocationResult, kind: RefusalKind) -> NoReturn:
        if self.metrics is not None:
            self.metrics.allocations.labels(result=result).inc()
        # The log's cause: the kind alone where the request shapes the message (see RefusalKind).
        cause: Hashable = (kind, message) if kind is RefusalKind.UNUSABLE else kind
        self.refusals.log(cause, logging.WARNING, "refused Allocate: %s", message,
                          extra={"result": result, "kind": str(kind)})
        await context.abort(code, message)
