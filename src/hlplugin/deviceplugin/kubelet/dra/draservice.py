"""The DRA plugin service a driver serves the kubelet, in both API versions (dra.v1 and
dra.v1beta1: the same messages under two packages), turned into calls of one ``Preparer``.

The wire rules are the kubelet's (pkg/kubelet/cm/dra): every claim of a request gets an entry in
the answer, keyed by its UID; a claim that cannot be prepared gets an entry with an error, which
the kubelet reports in the pod's events and retries; a gRPC error fails every claim of the call.
So a Preparer's refusal is an entry's error, and only a bug of ours is a gRPC error, or a call
refused whole before any work, being past a bound no kubelet call reaches (``check_request``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, Protocol

import grpc

from hlplugin.api import (
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
)
from hlplugin.deviceplugin.health import repeats
from hlplugin.deviceplugin.kubelet.context import Context
from hlplugin.deviceplugin.kubelet.grpcserver import SelfCall, bounded_server

log = logging.getLogger(__name__)

# The DRAPlugin services a plugin lists in its registration's supported versions, the preferred
# first: the kubelet takes the first it knows (1.34 and later know both; 1.32 and 1.33 only v1beta1).
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# The resource-health stream (dra-health v1alpha1), listed too, after them, as the Go kubeletplugin
# helper lists it: the 1.36 kubelet opens the stream on every plugin, newer kubelets only on one
# that lists it (upstream's TestHealthStreamRequiresAdvertisedService). Not a DRAPlugin service, so
# it is never the one chosen for Prepare.
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
# What a driver serving both (new_dra_server with ``health``) lists.
SERVICES = (*DRA_SERVICES, HEALTH_SERVICE)
# Bounds on what a DRAPlugin client may ask (docs/security.md, "Bounds on the DRA socket"). Ours,
# not the API's: one NodePrepareResources of 100,000 claims (1.6 MB) took the driver from 43 to
# 391 MiB peak memory, and answered after 3.5 s.
# Claims per NodePrepareResources or NodeUnprepareResources: the kubelet sends one pod's claims for
# our driver in a call, and the API sets no limit on a pod's spec.resourceClaims; 256 matches a
# ResourceClaim's status.reservedFor (at most 256 consumers) and is far above any real pod. Past
# it a call is refused whole at once (INVALID_ARGUMENT, as the device plugin's Allocate refuses a
# request past its bounds), before its claims are read, a lock taken or the checkpoint touched.
MAX_CLAIMS_PER_CALL = 256
# The request size, refused by gRPC before it is parsed (RESOURCE_EXHAUSTED): the count above is
# seen only after parsing, which costs the memory: a 4 MiB message (gRPC's default bound) of
# 2,000,000 empty claims took the driver +142 MiB before our handler refused it. The largest call
# the kubelet can send, 256 claims at the API's longest names (namespace 63, name 253, UID 36),
# is 92,672 bytes; this leaves room over it (a UID of up to 180 bytes).
MAX_REQUEST_BYTES = 128 * 1024


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim: the requests it serves (empty: all), where it is published
    (pool, device), the IDs the container runtime resolves for it, and for a device shared with
    consumable capacity the claim's share (its allocation result's share ID; v1 carries it,
    v1beta1 has no such field)."""

    requests: tuple[str, ...]
    pool: str
    device: str
    ids: tuple[str, ...]
    share: str = ""


@dataclass(frozen=True)
class Prepared:
    """A claim's answer: its devices, or why it could not be prepared."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Preparer(Protocol):
    """What a driver does with the kubelet's calls; every claim it is given must be answered."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """By claim UID: "" when done (a claim it never prepared included), else the error."""
        ...


class RefusalKind(StrEnum):
    """Why a call was refused whole: the log's cause (field ``kind``), one per kind whatever the
    request said, so a client varying its claims takes one line a minute (repeats.RepeatedLines)."""

    MALFORMED = "malformed"  # past a bound


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


def _missing(claims: Sequence[ClaimRef], answered: dict[str, Any]) -> list[str]:
    return [c.uid for c in claims if c.uid not in answered]


class DraServicer:
    """One API version's DRAPlugin servicer over a shared Preparer (``api``: its messages)."""

    def __init__(self, api: ModuleType, preparer: Preparer,
                 refusals: repeats.RepeatedLines | None = None) -> None:
        """``refusals``: the log of refused calls, shared by the servers' API versions."""
        self.api = api
        self.preparer = preparer
        self.refusals = refusals or repeats.RepeatedLines(log)
        self._shares = "share_id" in api.Device.DESCRIPTOR.fields_by_name

    async def check_request(self, method: str, request: Any, context: Context) -> None:
        """Refuse (INVALID_ARGUMENT) a call past the bounds, before any work: its claims are
        counted, not turned into objects of ours."""
        count = len(request.claims)
        if count > MAX_CLAIMS_PER_CALL:
            await self._refuse(context, method, f"{count} claims in one {method}; at most "
                               f"{MAX_CLAIMS_PER_CALL} are served (the kubelet sends one pod's "
                               f"claims for this driver)")

    async def _refuse(self, context: Context, method: str, message: str) -> NoReturn:
        self.refusals.log(RefusalKind.MALFORMED, logging.WARNING, "refused %s: %s", method, message,
                          extra={"kind": str(RefusalKind.MALFORMED)})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def NodePrepareResources(self, request: Any, context: Context) -> Any:
        await self.check_request("NodePrepareResources", request, context)
        claims = _claims(request)
        answers = await self.preparer.prepare(claims) if claims else {}
        response = self.api.NodePrepareResourcesResponse()
        for uid in _missing(claims, answers):  # never leave a claim out: the kubelet would wait
            answers[uid] = Prepared(error="the driver gave no answer for this claim")
        for uid, prepared in answers.items():
            entry = response.claims[uid]
            if prepared.error:
                entry.error = prepared.error
                continue
            for device in prepared.devices:
                added = entry.devices.add(request_names=device.requests, pool_name=device.pool,
                                          device_name=device.device, cdi_device_ids=device.ids)
                if device.share and self._shares:
                    added.share_id = device.share
        return response

    async def NodeUnprepareResources(self, request: Any, context: Context) -> Any:
        await self.check_request("NodeUnprepareResources", request, context)
        claims = _claims(request)
        # No claims, nothing to wait for: the self-check's call, never queued behind a Prepare.
        errors = await self.preparer.unprepare(claims) if claims else {}
        response = self.api.NodeUnprepareResourcesResponse()
        for uid in _missing(claims, errors):
            errors[uid] = "the driver gave no answer for this claim"
        for uid, error in errors.items():
            response.claims[uid].error = error
        return response


_VERSIONS = ((dra_v1_pb2, dra_v1_pb2_grpc), (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc))


def _unprepare_nothing(channel: grpc.aio.Channel) -> Callable[[float], Awaitable[object]]:
    call = dra_v1_pb2_grpc.DRAPluginStub(channel).NodeUnprepareResources
    return lambda timeout: call(dra_v1_pb2.NodeUnprepareResourcesRequest(), timeout=timeout)


_SELF_CALL = SelfCall(_unprepare_nothing)


async def answers(endpoint: Path, timeout: float) -> bool:
    """The DRA service at ``endpoint`` answers a call (an Unprepare of no claims, which runs our
    handler on the event loop and waits for no other call), over a channel dialled for it: the
    driver's liveness check."""
    return await _SELF_CALL.ask(endpoint, timeout, fresh=True) is None


def new_dra_server(preparer: Preparer,
                   health: dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer | None = None
                   ) -> grpc.aio.Server:
    """A gRPC server serving DRAPlugin v1 and v1beta1 over ``preparer``, and with ``health`` (a
    drahealth.HealthStream) the resource-health stream, within the bounds of grpcserver.py (a
    request over MAX_REQUEST_BYTES is refused before it is parsed)."""
    server = bounded_server(MAX_REQUEST_BYTES)
    refusals = repeats.RepeatedLines(log)
    for api, api_grpc in _VERSIONS:
        api_grpc.add_DRAPluginServicer_to_server(DraServicer(api, preparer, refusals), server)
    if health is not None:
        dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(health, server)
    return server
