"""Each error answer the API client handles, injected by the fake API server: 409 read again
(retry.modify), 429 and 5xx retried with back-off and Retry-After, 401 re-reading the token once,
403 and the rest raised typed with the verb and the resource. The back-off's sleep is injected:
the delays are read, never waited."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.fakeapi import FakeApiServer, Sleeps

from hlplugin.kubeapi import (
    RESOURCE_SLICES,
    AlreadyExists,
    Backoff,
    Client,
    Config,
    Conflict,
    Forbidden,
    Invalid,
    ServerError,
    TooManyRequests,
    Unauthorized,
    modify,
)

SLICES = RESOURCE_SLICES.path()
# A hang fails in seconds, not the suite's 90 (nothing here waits on time: sleeps are injected).
pytestmark = pytest.mark.guard(15)


def a_slice(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"driver": "hyperlight.dev", "nodeName": "n"}}


@contextlib.asynccontextmanager
async def served(attempts: int = 5, token: Path | None = None
                 ) -> AsyncIterator[tuple[FakeApiServer, Client, Sleeps]]:
    sleeps = Sleeps()
    async with FakeApiServer() as server:
        server.put(SLICES, a_slice("s1"))
        yield server, Client(Config.from_url(server.url, token_path=token),
                             Backoff(attempts=attempts, sleep=sleeps, random=lambda: 1.0)), sleeps


async def test_a_conflict_is_typed_and_not_retried() -> None:
    async with served() as (server, client, sleeps):
        stale = await client.get(RESOURCE_SLICES, "s1")
        server.put(SLICES, a_slice("s1"))  # another writer
        with pytest.raises(Conflict) as raised:
            await client.update(RESOURCE_SLICES, stale)
        assert (raised.value.status, raised.value.verb, raised.value.name) == (409, "update", "s1")
        assert "the object has been modified" in str(raised.value)
        assert len(server.seen("update")) == 1 and not sleeps.delays


async def test_modify_reads_again_after_a_conflict_and_keeps_the_other_write() -> None:
    async with served() as (server, client, _):
        raced = []

        def label(obj: dict[str, Any]) -> dict[str, Any]:
            if not raced:  # another writer lands between our read and our write, once
                other = a_slice("s1")
                other["metadata"]["annotations"] = {"by": "other"}
                raced.append(server.put(SLICES, other))
            obj["metadata"].setdefault("labels", {})["ours"] = "yes"
            return obj

        written = await modify(client, RESOURCE_SLICES, "s1", label)
        assert written["metadata"]["labels"] == {"ours": "yes"}
        assert written["metadata"]["annotations"] == {"by": "other"}  # built on the re-read
        assert len(server.seen("get")) == 2 and len(server.seen("update")) == 2


async def test_modify_gives_up_after_its_attempts_and_writes_nothing_unchanged() -> None:
    async with served() as (server, client, _):
        def always_raced(obj: dict[str, Any]) -> dict[str, Any]:
            server.put(SLICES, a_slice("s1"))
            return obj

        with pytest.raises(Conflict):
            await modify(client, RESOURCE_SLICES, "s1", always_raced, attempts=3)
        assert len(server.seen("update")) == 3
        before = len(server.requests)
        same = await modify(client, RESOURCE_SLICES, "s1", lambda obj: None)
        assert same["metadata"]["name"] == "s1"
        assert [r.verb for r in server.requests[before:]] == ["get"]


async def test_a_create_of_a_taken_name_is_already_exists_not_a_conflict() -> None:
    async with served() as (_, client, _):
        with pytest.raises(AlreadyExists) as raised:
            await client.create(RESOURCE_SLICES, a_slice("s1"))
        assert not isinstance(raised.value, Conflict)


async def test_429_waits_what_retry_after_says() -> None:
    async with served() as (server, client, sleeps):
        server.fail(429, "get", times=2, headers=[("Retry-After", "3")])
        assert (await client.get(RESOURCE_SLICES, "s1"))["metadata"]["name"] == "s1"
        assert sleeps.delays == [3.0, 3.0] and len(server.seen("get")) == 3


async def test_retry_after_is_capped_and_a_date_falls_back_to_the_backoff() -> None:
    async with served() as (server, client, sleeps):
        server.fail(429, "get", headers=[("Retry-After", "3600")])
        server.fail(503, "get", headers=[("Retry-After", "Wed, 21 Oct 2026 07:28:00 GMT")])
        await client.get(RESOURCE_SLICES, "s1")
        assert sleeps.delays == [30.0, 1.0]  # the cap; then the second attempt's step


async def test_5xx_backs_off_exponentially_then_raises_after_the_attempts() -> None:
    async with served(attempts=4) as (server, client, sleeps):
        server.fail(500, "list", times=1)
        server.fail(503, "list", times=1)
        assert (await client.list(RESOURCE_SLICES))["items"]
        assert sleeps.delays == [0.5, 1.0]
        server.fail(503, "list", times=10)
        with pytest.raises(ServerError) as raised:
            await client.list(RESOURCE_SLICES)
        assert raised.value.status == 503
        assert sleeps.delays[2:] == [0.5, 1.0, 2.0]  # 4 attempts, 3 waits


def test_the_backoff_is_jittered_and_capped() -> None:
    low = Backoff(base=1.0, cap=8.0, random=lambda: 0.0)
    assert [low.delay(n, None) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    high = Backoff(base=1.0, cap=8.0, random=lambda: 1.0)
    assert [high.delay(n, None) for n in (1, 4, 9)] == [1.0, 8.0, 8.0]
    assert high.delay(1, 2.5) == 2.5


async def test_403_is_raised_with_the_verb_and_resource_and_not_retried() -> None:
    async with served() as (server, client, sleeps):
        server.fail(403, "list")
        with pytest.raises(Forbidden) as raised:
            await client.list(RESOURCE_SLICES)
        assert (raised.value.verb, raised.value.resource) == ("list", "resourceslices.resource.k8s.io")
        assert str(raised.value).startswith("list resourceslices.resource.k8s.io: 403 Forbidden")
        assert len(server.seen("list")) == 1 and not sleeps.delays


async def test_422_is_invalid_and_not_retried() -> None:
    async with served() as (server, client, _):
        server.fail(422, "create")
        with pytest.raises(Invalid):
            await client.create(RESOURCE_SLICES, a_slice("s2"))
        assert len(server.seen("create")) == 1


async def test_401_reads_the_token_again_once(tmp_path: Path) -> None:
    """The token changed without its stat changing (same inode, size and mtime): only the 401
    makes the client read it again, and it retries at once."""
    token = tmp_path / "token"
    token.write_text("token-a")
    async with served(token=token) as (server, client, sleeps):
        await client.get(RESOURCE_SLICES, "s1")
        stamp = token.stat()
        token.write_text("token-b")
        os.utime(token, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        server.tokens = {"token-b"}
        await client.get(RESOURCE_SLICES, "s1")
        assert [r.headers["authorization"] for r in server.requests] == [
            "Bearer token-a", "Bearer token-a", "Bearer token-b"]
        assert not sleeps.delays


async def test_401_twice_is_raised(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-a")
    async with served(token=token) as (server, client, _):
        server.fail(401, "get", times=2)
        with pytest.raises(Unauthorized):
            await client.get(RESOURCE_SLICES, "s1")
        assert len(server.seen("get")) == 2
        server.fail(401, "get", times=1)  # once, then the server takes the same token again
        await client.get(RESOURCE_SLICES, "s1")


async def test_429_on_a_write_is_retried_with_its_body() -> None:
    async with served() as (server, client, sleeps):
        server.fail(429, "create", headers=[("Retry-After", "1")])
        await client.create(RESOURCE_SLICES, a_slice("s2"))
        first, second = server.seen("create")
        assert first.body == second.body == a_slice("s2") and sleeps.delays == [1.0]
        with pytest.raises(TooManyRequests):
            server.fail(429, "get", times=5)
            await client.get(RESOURCE_SLICES, "s2")
