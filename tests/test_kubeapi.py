"""The API client's verbs and configuration against the fake API server (tests/support/fakeapi.py:
real TCP on loopback), plain HTTP but for the in-cluster case, which runs TLS with the service
account's CA and token as a pod has them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.fakeapi import FakeApiServer, Sleeps, self_signed

from hlplugin.kubeapi import (
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Backoff,
    Client,
    Config,
    ConfigError,
    Conflict,
    NotFound,
    Resource,
    ResponseTooLarge,
    Unreachable,
)

SLICES = RESOURCE_SLICES.path()
# A hang fails in seconds, not the suite's 90 (nothing here waits on time: sleeps are injected).
pytestmark = pytest.mark.guard(15)


def a_slice(name: str, node: str = "node-a", **labels: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name, "labels": labels},
            "spec": {"driver": "hyperlight.dev", "nodeName": node, "pool": {"name": node}}}


@contextlib.asynccontextmanager
async def served(**bounds: Any) -> AsyncIterator[tuple[FakeApiServer, Client]]:
    async with FakeApiServer() as server:
        yield server, Client(Config.from_url(server.url, **bounds),
                             Backoff(attempts=2, sleep=Sleeps(), random=lambda: 1.0))


async def test_get_answers_the_stored_object_and_not_found_is_typed() -> None:
    async with served() as (server, client):
        stored = server.put(SLICES, a_slice("s1"))
        got = await client.get(RESOURCE_SLICES, "s1")
        assert got == stored and got["metadata"]["uid"] and got["metadata"]["resourceVersion"]
        with pytest.raises(NotFound) as missing:
            await client.get(RESOURCE_SLICES, "nope")
        assert (missing.value.verb, missing.value.resource, missing.value.name) == (
            "get", "resourceslices.resource.k8s.io", "nope")
        (first, _) = server.requests
        assert first.path == "/apis/resource.k8s.io/v1/resourceslices/s1"
        assert first.headers["user-agent"] == "hlplugin-kubeapi"
        assert "authorization" not in first.headers  # no token configured: none sent


async def test_list_sends_its_selectors_and_version_and_answers_the_collection() -> None:
    async with served() as (server, client):
        server.put(SLICES, a_slice("a", "node-a", tier="x"))
        server.put(SLICES, a_slice("b", "node-b", tier="x"))
        server.put(SLICES, a_slice("c", "node-a", tier="y"))
        everything = await client.list(RESOURCE_SLICES)
        assert [o["metadata"]["name"] for o in everything["items"]] == ["a", "b", "c"]
        assert everything["metadata"]["resourceVersion"] == str(server.version)
        mine = await client.list(RESOURCE_SLICES, label_selector="tier=x",
                                 field_selector="spec.nodeName=node-a", resource_version="0",
                                 limit=10)
        assert [o["metadata"]["name"] for o in mine["items"]] == ["a"]
        assert server.requests[-1].query == {"labelSelector": "tier=x",
                                             "fieldSelector": "spec.nodeName=node-a",
                                             "resourceVersion": "0", "limit": "10"}


async def test_namespaced_resources_take_their_namespace() -> None:
    async with served() as (server, client):
        claim = {"metadata": {"name": "c", "namespace": "team"}, "spec": {}}
        made = await client.create(RESOURCE_CLAIMS, claim)
        assert server.requests[-1].path == "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims"
        assert (await client.get(RESOURCE_CLAIMS, "c", "team"))["metadata"]["uid"] == made["metadata"]["uid"]
        assert not (await client.list(RESOURCE_CLAIMS, "other"))["items"]
        with pytest.raises(ValueError, match="namespaced"):
            RESOURCE_CLAIMS.path()
    assert Resource("", "v1", "nodes", namespaced=False).path(name="n") == "/api/v1/nodes/n"


async def test_create_stores_and_a_dry_run_stores_nothing() -> None:
    async with served() as (server, client):
        dry = await client.create(RESOURCE_SLICES, a_slice("s1"), dry_run=True)
        assert dry["metadata"]["name"] == "s1"
        assert server.requests[-1].query == {"dryRun": "All"}
        with pytest.raises(NotFound):
            await client.get(RESOURCE_SLICES, "s1")
        made = await client.create(RESOURCE_SLICES, a_slice("s1"))
        assert server.requests[-1].body == a_slice("s1") and not server.requests[-1].query
        assert made == await client.get(RESOURCE_SLICES, "s1")


async def test_update_needs_the_version_read_and_a_dry_run_changes_nothing() -> None:
    async with served() as (server, client):
        stored = server.put(SLICES, a_slice("s1"))
        unversioned = a_slice("s1")
        with pytest.raises(ValueError, match="resourceVersion"):
            await client.update(RESOURCE_SLICES, unversioned)
        assert not server.seen("update")  # refused before anything was sent
        stored["spec"]["nodeName"] = "node-b"
        await client.update(RESOURCE_SLICES, stored, dry_run=True)
        assert server.requests[-1].query == {"dryRun": "All"}
        assert (await client.get(RESOURCE_SLICES, "s1"))["spec"]["nodeName"] == "node-a"
        written = await client.update(RESOURCE_SLICES, stored)
        assert written["spec"]["nodeName"] == "node-b"
        assert int(written["metadata"]["resourceVersion"]) > int(stored["metadata"]["resourceVersion"])
        with pytest.raises(Conflict):  # the version it was read at is gone
            await client.update(RESOURCE_SLICES, stored)


async def test_delete_sends_its_preconditions_and_a_dry_run_keeps_the_object() -> None:
    async with served() as (server, client):
        stored = server.put(SLICES, a_slice("s1"))
        uid, version = stored["metadata"]["uid"], stored["metadata"]["resourceVersion"]
        with pytest.raises(Conflict):
            await client.delete(RESOURCE_SLICES, "s1", uid="another-uid")
        with pytest.raises(Conflict):
            await client.delete(RESOURCE_SLICES, "s1", resource_version=str(int(version) - 1))
        await client.delete(RESOURCE_SLICES, "s1", uid=uid, dry_run=True)
        assert server.requests[-1].body == {"kind": "DeleteOptions", "apiVersion": "v1",
                                            "preconditions": {"uid": uid}, "dryRun": ["All"]}
        await client.get(RESOURCE_SLICES, "s1")  # still there
        gone = await client.delete(RESOURCE_SLICES, "s1", uid=uid, resource_version=version)
        assert gone["metadata"]["name"] == "s1"
        assert server.requests[-1].body["preconditions"] == {"uid": uid, "resourceVersion": version}
        with pytest.raises(NotFound):
            await client.get(RESOURCE_SLICES, "s1")


def service_account(directory: Path, ca: Path, token: str) -> Path:
    account = directory / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(ca.read_bytes())
    (account / "token").write_text(token + "\n")
    return account


async def test_in_cluster_config_speaks_tls_to_the_service_with_the_account_token(tmp_path: Path) -> None:
    context, ca = self_signed(tmp_path)
    async with FakeApiServer(tls=context) as server:
        server.tokens = {"token-a"}
        account = service_account(tmp_path, ca, "token-a")
        port = server.url.rsplit(":", 1)[1]
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
        client = Client(Config.in_cluster(env, account))
        server.put(SLICES, a_slice("s1"))
        assert (await client.get(RESOURCE_SLICES, "s1"))["metadata"]["name"] == "s1"
        assert server.requests[-1].headers["authorization"] == "Bearer token-a"
        # Another CA: the server is not trusted, and nothing is sent.
        (tmp_path / "other").mkdir()
        _, other_ca = self_signed(tmp_path / "other")
        (account / "ca.crt").write_bytes(other_ca.read_bytes())
        stranger = Client(Config.in_cluster(env, account), Backoff(attempts=1))
        with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await stranger.get(RESOURCE_SLICES, "s1")
        assert len(server.requests) == 1


def test_in_cluster_config_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        Config.in_cluster({}, tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match=r"ca\.crt is missing"):
        Config.in_cluster(env, tmp_path)
    _, ca = self_signed(tmp_path)
    account = service_account(tmp_path, ca, "t")
    (account / "token").unlink()
    with pytest.raises(ConfigError, match="token is missing"):
        Config.in_cluster(env, account)


async def test_a_rotated_token_is_read_before_the_next_request(tmp_path: Path) -> None:
    """The kubelet rewrites the projected token: the file's change is seen by its stat, so the
    first request after it already carries the new token (no 401 on the way)."""
    token = tmp_path / "token"
    token.write_text("first")
    async with FakeApiServer() as server:
        server.tokens = {"first"}
        server.put(SLICES, a_slice("s1"))
        client = Client(Config.from_url(server.url, token_path=token), Backoff(attempts=1))
        await client.get(RESOURCE_SLICES, "s1")
        replacement = tmp_path / "token.new"
        replacement.write_text("second-token")
        os.replace(replacement, token)  # as the kubelet swaps its ..data link: a new inode
        server.tokens = {"second-token"}
        await client.get(RESOURCE_SLICES, "s1")
        assert [r.headers["authorization"] for r in server.requests] == [
            "Bearer first", "Bearer second-token"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_answer_over_the_bound_is_refused(chunked: bool) -> None:
    async with served(max_body=4096) as (server, client):
        server.chunked = chunked
        big = a_slice("big")
        big["spec"]["devices"] = [{"name": f"d{i}"} for i in range(500)]
        server.put(SLICES, big)
        with pytest.raises(ResponseTooLarge, match="4096"):
            await client.get(RESOURCE_SLICES, "big")
        server.put(SLICES, a_slice("small"))
        await client.get(RESOURCE_SLICES, "small")


async def test_a_server_that_never_answers_times_out_and_is_retried() -> None:
    async with served(read_timeout=0.2) as (server, client):
        server.fail(0, "get", times=2)  # accepts, reads the request, answers nothing
        with pytest.raises(Unreachable, match=r"sent nothing for 0\.2 s"):
            await client.get(RESOURCE_SLICES, "s1")
        assert len(server.seen("get")) == 2  # Backoff(attempts=2): retried once


async def test_no_server_is_unreachable_after_the_attempts() -> None:
    async with FakeApiServer() as server:
        url = server.url
    sleeps = Sleeps()
    client = Client(Config.from_url(url), Backoff(attempts=3, sleep=sleeps, random=lambda: 1.0))
    with pytest.raises(Unreachable, match="cannot connect"):
        await client.get(RESOURCE_SLICES, "s1")
    assert sleeps.delays == [0.5, 1.0]
