"""The DRA driver reads a claim's allocation from the API server: what the scheduler gave the
claim, in its status, is what Prepare answers (docs/dra.md, "Claims").

Imported by hlplugin.dra only when the driver runs in a cluster (hlplugin.dra.driver.cluster_api), as
controlplane.py is; run by hand, the driver answers with the node's one device
(dra.claims.node_device).

- Only the results of our driver on this node's pool are answered, each with the names of the
  requests it serves: the kubelet gives a claim's CDI devices to the containers that name those
  requests, so a claim that also holds another driver's device never gives its other containers
  the hypervisor.
- A result that shares the device (consumable capacity) carries its share ID.
- A claim whose UID is not the kubelet's (deleted and made again under its name), or that holds
  nothing of ours, is refused with the reason; the kubelet retries and shows the reason in the
  pod's events.
- Read only for a claim the record does not hold: a recorded claim is answered from the record,
  so the kubelet re-preparing its running pods needs no API server.
- ``gone``: the claims the record holds whose Unprepare never came (a node down while its pods
  were deleted) are found by their claim being gone from the API server, and pruned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hlplugin.deviceplugin.kubelet.dra.draservice import ClaimRef, PreparedDevice
from hlplugin.dra.claims import ClaimPreparer, NotAllocated
from hlplugin.kubeapi import RESOURCE_CLAIMS, Backoff, Client, KubeApiError, NotFound, Object
from hlplugin.names import DRA_DRIVER

# How long one claim's read may take, its retries included: under the preparer's lock, and the
# kubelet gives a NodePrepareResources call 45 s; a claim refused for now is asked again.
READ_BUDGET = 10.0
# Fewer retries than the slice controller's: a Prepare that waits less is retried by the kubelet.
READ_BACKOFF = Backoff(attempts=3)


class AllocationReader:
    """dra.claims.Allocation from the API server; ``condition`` is /readyz's note on the last read
    (a 403 names the verb and resource, so a missing RBAC rule is seen before a pod waits on it)."""

    def __init__(self, client: Client, pool: str, hypervisor: str, cdi_name: str, *,
                 budget: float = READ_BUDGET) -> None:
        self.client, self.pool, self.hypervisor, self.cdi_name = client, pool, hypervisor, cdi_name
        self.budget = budget
        self.problem = ""
        self.read = False  # a claim was read, or found missing, at least once

    def condition(self) -> tuple[bool, str]:
        if self.problem:
            return False, self.problem
        return True, "the last claim read was answered" if self.read else "no claim read yet"

    async def __call__(self, claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        found = await self._read(claim)
        if found is None:
            raise NotAllocated(f"{DRA_DRIVER}: claim {claim.describe()} is not in the API server")
        return allocated(found, claim, self.pool, self.hypervisor, self.cdi_name)

    async def gone(self, claim: ClaimRef) -> bool:
        """The claim is no longer in the API server, or another claim has its name: the record's
        entry can never be unprepared by a kubelet that still needs it. Any other answer (no
        answer, a 403) keeps it."""
        try:
            found = await self._read(claim)
        except NotAllocated:
            return False
        return found is None or _uid(found) != claim.uid

    async def _read(self, claim: ClaimRef) -> Object | None:
        """The claim as the API server has it, None when it has none; NotAllocated when it
        cannot be read now."""
        try:
            async with asyncio.timeout(self.budget):
                found = await self.client.get(RESOURCE_CLAIMS, claim.name, claim.namespace)
        except NotFound:
            self.problem, self.read = "", True
            return None
        except TimeoutError:
            raise self._failed(claim, f"no answer within {self.budget:g} s") from None
        except KubeApiError as exc:
            raise self._failed(claim, str(exc)) from exc
        self.problem, self.read = "", True
        return found

    def _failed(self, claim: ClaimRef, why: str) -> NotAllocated:
        self.problem = f"cannot read claim {claim.describe()}: {why}"
        return NotAllocated(f"{DRA_DRIVER}: {self.problem}")


def _uid(claim: Object) -> str:
    meta = claim.get("metadata")
    return str(meta.get("uid", "")) if isinstance(meta, dict) else ""


def _results(claim: Object) -> list[Any] | None:
    """status.allocation.devices.results, or None where the claim is not allocated."""
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        return None
    results = (allocation.get("devices") or {}).get("results") or []
    return results if isinstance(results, list) else []


def allocated(found: Object, claim: ClaimRef, pool: str, hypervisor: str,
              cdi_name: str) -> tuple[PreparedDevice, ...]:
    """The devices of ours ``found`` (the claim as read) was allocated on ``pool``, one per
    device and share, with the requests each serves; NotAllocated saying why when none."""
    who = f"{DRA_DRIVER}: claim {claim.describe()}"
    if _uid(found) != claim.uid:
        raise NotAllocated(f"{who} is not the claim the API server has under that name (its UID "
                           f"is {_uid(found) or 'missing'}): deleted and made again")
    results = _results(found)
    if results is None:
        raise NotAllocated(f"{who} is not allocated")
    ours = [r for r in results if isinstance(r, dict) and r.get("driver") == DRA_DRIVER]
    if not ours:
        raise NotAllocated(f"{who} holds no device of {DRA_DRIVER}")
    elsewhere = sorted({f"{r.get('pool')}/{r.get('device')}" for r in ours
                        if r.get("pool") != pool or r.get("device") != hypervisor})
    if elsewhere:
        raise NotAllocated(f"{who} was allocated {', '.join(elsewhere)}, which this node "
                           f"({pool}/{hypervisor}) does not publish")
    requests: dict[str, list[str]] = {}  # by share ID ("" for the device whole)
    for result in ours:
        requests.setdefault(str(result.get("shareID") or ""), []).append(str(result.get("request")))
    return tuple(PreparedDevice(_sorted(names), pool, hypervisor, (cdi_name,), share)
                 for share, names in sorted(requests.items()))


def _sorted(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(set(names)))


# How often the record is searched for claims gone from the API server (and once at start): an
# entry is a few hundred bytes of an 8 MiB record, so leftovers are rare and never urgent.
PRUNE_EVERY = 900.0


async def keep_pruned(preparer: ClaimPreparer, reader: AllocationReader,
                      every: float = PRUNE_EVERY) -> None:
    """The driver's root task ``claims-prune``: the record's leftovers forgotten, at start and
    then every ``every`` seconds, until cancelled."""
    while True:
        await preparer.prune(reader.gone)
        await asyncio.sleep(every)
