"""A watch's events, and ``reflect``: list, then watch from the list's version, resuming where
the last event (or bookmark) left off, and listing again when the server no longer has that
version (410 Gone), as client-go's reflector does.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hlplugin.kubeapi.errors import (
    Gone,
    KubeApiError,
    ServerError,
    TooManyRequests,
    Unreachable,
    status_error,
)
from hlplugin.kubeapi.resources import Object, Resource, metadata

if TYPE_CHECKING:
    from hlplugin.kubeapi.client import Client


class EventType(enum.StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"
    # Only a newer resourceVersion in ``object.metadata``: where to resume, with nothing changed.
    BOOKMARK = "BOOKMARK"
    # ``object`` is a Status; the stream ends after it.
    ERROR = "ERROR"


@dataclass(frozen=True)
class Event:
    type: EventType
    object: Object

    @property
    def resource_version(self) -> str:
        return str(metadata(self.object).get("resourceVersion", ""))


def decode_event(line: bytes, verb: str, resource: str) -> Event:
    """One line of a watch. An ERROR of code 410 raises Gone, as the same answer before the
    stream would: either way the version is compacted away and only a new list mends it."""
    try:
        found: Any = json.loads(line)
        kind, obj = EventType(found["type"]), found["object"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KubeApiError(f"{verb} {resource}: not a watch event: {line[:200]!r}") from exc
    if not isinstance(obj, dict):
        raise KubeApiError(f"{verb} {resource}: a watch event without an object")
    if kind is EventType.ERROR and obj.get("code") == 410:
        raise status_error(410, json.dumps(obj).encode(), None, verb=verb, resource=resource)
    return Event(kind, obj)


@dataclass(frozen=True)
class Listed:
    """The whole collection, listed: the caller replaces what it held with ``items``."""

    items: list[Object]
    resource_version: str


@dataclass
class _Position:
    version: str
    failures: int = 0


async def reflect(client: Client, resource: Resource, namespace: str | None = None, *,
                  label_selector: str = "", field_selector: str = "",
                  timeout_seconds: int = 300) -> AsyncGenerator[Listed | Event, None]:
    """Listed, then the events after it, forever: a stream the server ends is watched again from
    the last version seen (an event's or a bookmark's, which is not yielded); Gone lists again
    (a new Listed); a watch that fails (no answer, 429 or 5xx after the client's retries, an
    ERROR event, which is yielded) backs off (the client's Backoff, growing until an event
    comes) and resumes. Other errors (403, a list's 5xx after its retries) end it: the caller
    decides. Close it with ``contextlib.aclosing``."""
    position: _Position | None = None
    while True:
        if position is None:
            listing = await client.list(resource, namespace, label_selector=label_selector,
                                        field_selector=field_selector)
            items = listing.get("items") or []
            position = _Position(str(metadata(listing).get("resourceVersion", "")))
            yield Listed(list(items), position.version)
        try:
            async with contextlib.aclosing(client.watch(
                    resource, namespace, resource_version=position.version,
                    label_selector=label_selector, field_selector=field_selector,
                    timeout_seconds=timeout_seconds)) as events:
                failed = False
                async for event in events:
                    failed = event.type is EventType.ERROR
                    if failed:
                        yield event
                        continue
                    position.failures = 0
                    position.version = event.resource_version or position.version
                    if event.type is not EventType.BOOKMARK:
                        yield event
        except Gone:
            position = None
            continue
        except (Unreachable, ServerError, TooManyRequests):  # after the client's own retries
            failed = True
        if failed:
            position.failures += 1
            await client.backoff.wait(min(position.failures, 16), None)

