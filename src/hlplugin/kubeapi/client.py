"""The verbs: get, list, watch, create, update, delete, on plain dicts, with the retries every
caller needs (a 401 re-reads the token once; 429, 5xx and no answer back off, retry.Backoff) and
a typed error for every other answer (errors.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from hlplugin.kubeapi.config import Config
from hlplugin.kubeapi.errors import (
    KubeApiError,
    ServerError,
    TooManyRequests,
    Unauthorized,
    Unreachable,
    status_error,
)
from hlplugin.kubeapi.resources import Object, Resource, metadata
from hlplugin.kubeapi.retry import Backoff
from hlplugin.kubeapi.transport import Request, Stream, exchange
from hlplugin.kubeapi.watch import Event, decode_event

USER_AGENT = "hlplugin-kubeapi"
# What the server may retry for us: shed load, a server error, no answer at all. A create
# retried after a 5xx that had in fact succeeded gets AlreadyExists; an update or a delete with
# preconditions gets Conflict: both are the caller's to read again, never a second write.
RETRIED = (TooManyRequests, ServerError, Unreachable)


@dataclass(frozen=True)
class Call:
    """One call as errors name it: the verb, the resource and the object's name."""

    verb: str
    resource: Resource
    method: str
    path: str
    query: dict[str, str]
    body: Object | None = None
    name: str = ""


class Client:
    """A client of one API server. Cheap to build (no connection until a call); safe to share
    between tasks (each call has its own connection)."""

    def __init__(self, config: Config, backoff: Backoff | None = None) -> None:
        self.config = config
        self.backoff = backoff or Backoff()

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> Object:
        return await self._call(Call("get", resource, "GET", resource.path(namespace, name), {},
                                     name=name))

    async def list(self, resource: Resource, namespace: str | None = None, *,
                   label_selector: str = "", field_selector: str = "", resource_version: str = "",
                   limit: int = 0, continue_token: str = "") -> Object:
        """The collection as one ``...List`` object: ``items`` and ``metadata.resourceVersion``,
        from which a watch goes on. ``resource_version="0"`` lets the server answer from its
        cache; ``limit`` pages, and ``metadata.continue`` names the next page."""
        query = _query(labelSelector=label_selector, fieldSelector=field_selector,
                       resourceVersion=resource_version, limit=str(limit) if limit else "",
                       **{"continue": continue_token})
        return await self._call(Call("list", resource, "GET", resource.path(namespace), query))

    async def watch(self, resource: Resource, namespace: str | None = None, *,
                    resource_version: str = "", label_selector: str = "", field_selector: str = "",
                    bookmarks: bool = True, timeout_seconds: int = 300) -> AsyncGenerator[Event, None]:
        """The collection's changes after ``resource_version`` (all of its objects as ADDED
        first, if it is empty), until the server ends the stream (``timeout_seconds``). A 410,
        as the answer or as an ERROR event, raises Gone: list again (watch.reflect does). Close
        it when done (``contextlib.aclosing``), which closes its connection."""
        query = _query(watch="true", resourceVersion=resource_version,
                       labelSelector=label_selector, fieldSelector=field_selector,
                       allowWatchBookmarks="true" if bookmarks else "",
                       timeoutSeconds=str(timeout_seconds))
        call = Call("watch", resource, "GET", resource.path(namespace), query)
        # The server ends the stream at timeout_seconds: a read waiting past that (and the
        # client's read timeout) is a connection lost without a word.
        async with self._open(call, timeout_seconds + self.config.read_timeout) as stream:
            async for line in stream.lines():
                yield decode_event(line, call.verb, resource.name)

    async def create(self, resource: Resource, obj: Object, *, dry_run: bool = False) -> Object:
        namespace = metadata(obj).get("namespace")
        return await self._call(Call("create", resource, "POST", resource.path(namespace),
                                     _query(dryRun="All" if dry_run else ""), obj,
                                     name=str(metadata(obj).get("name", ""))))

    async def update(self, resource: Resource, obj: Object, *, dry_run: bool = False) -> Object:
        """Replace the object, only if it is still at its ``metadata.resourceVersion`` (else 409
        Conflict). One without it is refused here: an unconditional write would undo a change
        made since our read, which is what optimistic concurrency is for."""
        meta = metadata(obj)
        name, version = meta.get("name"), meta.get("resourceVersion")
        if not name or not version:
            raise ValueError("update needs metadata.name and metadata.resourceVersion (the version "
                             "read: the write is refused if the object changed since)")
        path = resource.path(meta.get("namespace"), name)
        return await self._call(Call("update", resource, "PUT", path,
                                     _query(dryRun="All" if dry_run else ""), obj, name=name))

    async def delete(self, resource: Resource, name: str, namespace: str | None = None, *,
                     uid: str = "", resource_version: str = "", dry_run: bool = False) -> Object:
        """Delete, only if the object still has this ``uid`` and ``resource_version`` when given
        (else 409 Conflict): a slice deleted and made again under the same name is not ours to
        delete. Answers what the server answers: the object, or a Status."""
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body: Object = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if preconditions:
            body["preconditions"] = preconditions
        if dry_run:
            body["dryRun"] = ["All"]
        return await self._call(Call("delete", resource, "DELETE", resource.path(namespace, name),
                                     {}, body, name=name))

    async def _call(self, call: Call) -> Object:
        async with self._open(call, self.config.read_timeout) as stream:
            body = await stream.body()
        try:
            found: Any = json.loads(body)
        except ValueError as exc:
            raise KubeApiError(f"{call.verb} {call.resource.name}: the answer is not JSON") from exc
        if not isinstance(found, dict):
            raise KubeApiError(f"{call.verb} {call.resource.name}: the answer is not an object")
        return found

    @contextlib.asynccontextmanager
    async def _open(self, call: Call, read_timeout: float) -> AsyncIterator[Stream]:
        """A stream whose status is a success, after the retries: a 401 reads the token again
        and retries at once (once per call); 429, 5xx and no answer wait and retry, up to the
        back-off's attempts; any other error status raises its type."""
        attempt, reread = 0, False
        while True:
            stack = contextlib.AsyncExitStack()
            try:
                stream = await stack.enter_async_context(
                    exchange(self.config, self._request(call, reread), read_timeout))
                if stream.status >= 300:
                    raise status_error(stream.status, await stream.body(),
                                       stream.headers.get("retry-after"), verb=call.verb,
                                       resource=call.resource.name, name=call.name)
            except Unauthorized:
                await stack.aclose()
                if reread or self.config.token is None:
                    raise
                reread = True
            except RETRIED as exc:
                await stack.aclose()
                attempt += 1
                if attempt >= self.backoff.attempts:
                    raise
                await self.backoff.wait(attempt, exc.retry_after)
            except BaseException:
                await stack.aclose()
                raise
            else:
                break
        async with stack:
            yield stream

    def _request(self, call: Call, reread: bool) -> Request:
        headers = [("User-Agent", USER_AGENT), ("Accept", "application/json")]
        token = self.config.token
        if token is not None:
            headers.append(("Authorization", f"Bearer {token.reread() if reread else token.current()}"))
        body = b""
        if call.body is not None:
            body = json.dumps(call.body, separators=(",", ":")).encode()
            headers.append(("Content-Type", "application/json"))
        target = call.path + (f"?{urlencode(call.query)}" if call.query else "")
        return Request(call.method, target, headers, body)


def _query(**params: str) -> dict[str, str]:
    """The query's parameters that are set (an empty one is left out, as the server's default)."""
    return {key: value for key, value in params.items() if value}
