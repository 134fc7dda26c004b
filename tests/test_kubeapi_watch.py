"""Watches against the fake API server: typed events from a version, bookmarks, 410 as Gone (the
answer, or an ERROR event after the version was compacted), and watch.reflect: list, watch,
resume from the last version, list again on Gone."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.fakeapi import FakeApiServer, Sleeps

from hlplugin.kubeapi import (
    RESOURCE_SLICES,
    Backoff,
    Client,
    Config,
    Event,
    EventType,
    Gone,
    Listed,
    ResponseTooLarge,
    reflect,
)

SLICES = RESOURCE_SLICES.path()
# A hang fails in seconds, not the suite's 90 (nothing here waits on time: sleeps are injected).
pytestmark = pytest.mark.guard(15)


def a_slice(name: str, node: str = "node-a", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeName": node, **spec}}


@contextlib.asynccontextmanager
async def served(**bounds: Any) -> AsyncIterator[tuple[FakeApiServer, Client, Sleeps]]:
    sleeps = Sleeps()
    async with FakeApiServer() as server:
        yield server, Client(Config.from_url(server.url, **bounds),
                             Backoff(attempts=2, sleep=sleeps, random=lambda: 1.0)), sleeps


def names(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.type.value, e.object["metadata"].get("name", "")) for e in events]


async def test_a_watch_from_a_version_yields_the_changes_after_it_typed() -> None:
    async with served() as (server, client, _):
        server.put(SLICES, a_slice("before"))
        since = str(server.version)
        server.put(SLICES, a_slice("s1"))
        server.put(SLICES, a_slice("s1", "node-b"))
        server.remove(SLICES, "s1")
        async with contextlib.aclosing(client.watch(RESOURCE_SLICES, resource_version=since)) as events:
            seen = [await anext(events) for _ in range(3)]
            server.end_watches()  # the server's timeoutSeconds: the stream ends, cleanly
            assert [e async for e in events] == []
        assert names(seen) == [("ADDED", "s1"), ("MODIFIED", "s1"), ("DELETED", "s1")]
        assert all(isinstance(e.type, EventType) for e in seen)
        assert seen[-1].resource_version == str(server.version)
        assert server.seen("watch")[0].query == {"watch": "true", "resourceVersion": since,
                                                 "allowWatchBookmarks": "true",
                                                 "timeoutSeconds": "300"}


async def test_a_watch_without_a_version_starts_with_every_object_and_goes_on_live() -> None:
    async with served() as (server, client, _):
        server.put(SLICES, a_slice("mine"))
        server.put(SLICES, a_slice("theirs", "node-b"))
        async with contextlib.aclosing(client.watch(
                RESOURCE_SLICES, field_selector="spec.nodeName=node-a", bookmarks=False)) as events:
            assert names([await anext(events)]) == [("ADDED", "mine")]
            server.put(SLICES, a_slice("other", "node-b"))  # not selected
            server.put(SLICES, a_slice("mine", extra=1))
            assert names([await anext(events)]) == [("MODIFIED", "mine")]
        assert "allowWatchBookmarks" not in server.seen("watch")[0].query


async def test_a_bookmark_carries_the_version_to_resume_from() -> None:
    async with served() as (server, client, _):
        async with contextlib.aclosing(client.watch(RESOURCE_SLICES, resource_version="1")) as events:
            server.put(SLICES, a_slice("elsewhere"))
            await anext(events)
            server.version += 5  # other resources changed meanwhile
            server.bookmark()
            mark = await anext(events)
        assert mark.type is EventType.BOOKMARK and mark.resource_version == str(server.version)


async def test_a_watch_from_a_compacted_version_is_gone() -> None:
    """The real server answers 200, then an ERROR event of code 410: raised as the same Gone as
    a 410 answer, so a caller has one thing to catch."""
    async with served() as (server, client, _):
        server.put(SLICES, a_slice("s1"))
        server.compact()
        with pytest.raises(Gone, match="too old resource version"):
            async with contextlib.aclosing(client.watch(RESOURCE_SLICES, resource_version="1")) as events:
                await anext(events)
        server.fail(410, "watch")
        with pytest.raises(Gone) as raised:
            async with contextlib.aclosing(client.watch(RESOURCE_SLICES, resource_version="2")) as events:
                await anext(events)
        assert raised.value.verb == "watch"


async def test_an_event_over_the_bound_is_refused() -> None:
    async with served(max_body=4096) as (server, client, _):
        server.put(SLICES, a_slice("big", devices=[{"name": f"d{i}"} for i in range(500)]))
        with pytest.raises(ResponseTooLarge):
            async with contextlib.aclosing(client.watch(RESOURCE_SLICES)) as events:
                await anext(events)


async def test_reflect_lists_then_resumes_each_watch_from_the_last_version() -> None:
    async with served() as (server, client, _):
        server.put(SLICES, a_slice("s1"))
        async with contextlib.aclosing(reflect(client, RESOURCE_SLICES,
                                               field_selector="spec.nodeName=node-a")) as changes:
            listed = await anext(changes)
            assert isinstance(listed, Listed) and [o["metadata"]["name"] for o in listed.items] == ["s1"]
            server.put(SLICES, a_slice("s2"))
            added = await anext(changes)
            assert isinstance(added, Event) and names([added]) == [("ADDED", "s2")]
            assert server.seen("watch")[0].query["resourceVersion"] == listed.resource_version
            server.version += 3
            server.bookmark()  # not yielded: it only moves where the next watch starts
            bookmarked = str(server.version)
            server.end_watches()  # the server's timeout
            server.put(SLICES, a_slice("s3"))
            assert names([await anext(changes)]) == [("ADDED", "s3")]  # type: ignore[list-item]
        resumed = server.seen("watch")[1].query
        assert resumed["resourceVersion"] == bookmarked
        assert resumed["fieldSelector"] == "spec.nodeName=node-a"
        assert len(server.seen("list")) == 1  # resumed, not listed again


async def test_reflect_lists_again_when_its_version_is_gone() -> None:
    async with served() as (server, client, _):
        server.put(SLICES, a_slice("s1"))
        async with contextlib.aclosing(reflect(client, RESOURCE_SLICES)) as changes:
            first = await anext(changes)
            server.remove(SLICES, "s1")  # missed: compacted before the watch opens
            server.put(SLICES, a_slice("s2"))
            server.compact()
            again = await anext(changes)
            assert isinstance(again, Listed) and isinstance(first, Listed)
            assert [o["metadata"]["name"] for o in again.items] == ["s2"]
            assert again.resource_version == str(server.version)
            server.fail(410, "watch")  # and the same for a 410 answer
            third = await anext(changes)
            assert isinstance(third, Listed)
        assert len(server.seen("list")) == 3


async def test_reflect_backs_off_when_the_watch_fails_and_resumes() -> None:
    async with served() as (server, client, sleeps):
        async with contextlib.aclosing(reflect(client, RESOURCE_SLICES)) as changes:
            listed = await anext(changes)
            assert isinstance(listed, Listed)
            server.fail(503, "watch", times=2)  # the client's 2 attempts, then reflect's wait
            server.put(SLICES, a_slice("s1"))
            assert names([await anext(changes)]) == [("ADDED", "s1")]  # type: ignore[list-item]
        assert sleeps.delays == [0.5, 0.5]  # the client's retry, then reflect's first step
        assert [w.query["resourceVersion"] for w in server.seen("watch")] == [listed.resource_version] * 3
        assert len(server.seen("list")) == 1
