"""The retries none of the Python clients makes for us: 429 and 5xx with back-off, 409 by
reading again.

A DaemonSet's driver runs on every node, so when the API server sheds load (429) or restarts
(5xx, no answer) every node retries at once: the delay grows exponentially and is jittered
(between half and all of its step), and a Retry-After the server sends is what we wait, up to the
cap. Attempts are bounded, so a caller learns of an outage instead of hanging in it; a long-running
loop (the slice controller) retries again on its own schedule.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hlplugin.kubeapi.errors import Conflict
from hlplugin.kubeapi.resources import Object, Resource

if TYPE_CHECKING:
    from hlplugin.kubeapi.client import Client


@dataclass(frozen=True)
class Backoff:
    """How often and how long to wait; ``sleep`` and ``random`` are injectable, so tests read the
    delays instead of waiting them."""

    attempts: int = 5
    base: float = 0.5
    cap: float = 30.0
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)
    random: Callable[[], float] = field(default=random.random)

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """The wait after failed attempt ``attempt`` (1-based): Retry-After if the server said,
        else base * 2^(attempt-1), jittered; never over ``cap``."""
        if retry_after is not None:
            return min(retry_after, self.cap)
        step = min(self.cap, self.base * 2.0 ** (attempt - 1))
        return step * (0.5 + self.random() / 2)

    async def wait(self, attempt: int, retry_after: float | None) -> None:
        await self.sleep(self.delay(attempt, retry_after))


Change = Callable[[Object], Object | None]


async def modify(client: Client, resource: Resource, name: str, change: Change, *,
                 namespace: str | None = None, attempts: int = 5, dry_run: bool = False) -> Object:
    """Read, change, write back with the resourceVersion read; on 409 Conflict read again and
    apply ``change`` to what is there now, at most ``attempts`` times (then the Conflict is
    raised). ``change`` gets a copy and returns the object to write, or None when nothing needs
    writing (then the object read is returned). No wait between attempts: the re-read already
    holds the write we lost to, so the next attempt has nothing to wait for."""
    for attempt in range(1, attempts + 1):
        current = await client.get(resource, name, namespace)
        wanted = change(copy.deepcopy(current))
        if wanted is None:
            return current
        try:
            return await client.update(resource, wanted, dry_run=dry_run)
        except Conflict:
            if attempt == attempts:
                raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")
