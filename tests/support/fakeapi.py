"""A fake Kubernetes API server for the client's tests (hlplugin.kubeapi): real TCP on loopback,
plain HTTP (or TLS with a self-signed certificate), h11 as the parser.

It stores objects by resource path with the server's resourceVersion rules (one counter for
everything; an update or delete at a stale version is 409 Conflict; a watch from a version
older than the last compaction ends with an ERROR event of code 410, as the real one does), and
serves get, list (label and field selectors of equality), watch (replay from a version, live
events, bookmarks on request), create, update and delete (preconditions), dry run. Each error a
client must handle is injected with ``fail``; every request is kept in ``requests`` so a test
can read what went over the wire. What it does not do: validation, generation of names, a
watch's DELETED for an object that stops matching its selector, server-side timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import ssl
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import h11

Object = dict[str, Any]
REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Expired",
           422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass
class Seen:
    """One request as it arrived."""

    verb: str
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Object | None


@dataclass
class Fault:
    """An answer given in place of the real one, to the next ``times`` requests of ``verb``
    (any verb if None). Status 0 never answers (a server that hangs)."""

    status: int
    verb: str | None = None
    times: int = 1
    headers: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""


@dataclass
class Change:
    version: int
    type: str
    collection: str
    obj: Object


@dataclass
class Watcher:
    collection: str
    namespace: str
    selectors: tuple[str, str]
    bookmarks: bool
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


def split(path: str) -> tuple[str, str, str]:
    """(collection, namespace, name) of a path: the collection is the path of the resource type
    across namespaces (``/apis/g/v/plural``), so a list of all namespaces finds every object."""
    parts = path.strip("/").split("/")
    root = 2 if parts[0] == "api" else 3
    prefix, rest = parts[:root], parts[root:]
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    return "/" + "/".join([*prefix, rest[0]]), namespace, rest[1] if len(rest) > 1 else ""


def _lookup(obj: Object, dotted: str) -> str:
    value: Any = obj
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def matches(obj: Object, labels: str, fields: str) -> bool:
    """Equality selectors: ``k=v``, ``k==v``, ``k!=v``, ``k`` and ``!k`` for labels; ``a.b=v``
    and ``a.b!=v`` for fields."""
    have = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, labels.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = have.get(key) != value
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = have.get(key) == value
        else:
            ok = (term[1:] not in have) if term.startswith("!") else term in have
        if not ok:
            return False
    for term in filter(None, fields.split(",")):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        if (_lookup(obj, key) == value) == negate:
            return False
    return True


class FakeApiServer:
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.version = 1
        self.oldest = 1  # a watch from before this version is 410
        self.objects: dict[str, dict[tuple[str, str], Object]] = {}
        self.history: list[Change] = []
        self.requests: list[Seen] = []
        self.faults: list[Fault] = []
        self.tokens: set[str] = set()  # when not empty, only these bearers are let in
        self.chunked = False  # answers without Content-Length, as the real server's large lists
        self.watchers: list[Watcher] = []
        self._server: asyncio.Server | None = None
        self._hung = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FakeApiServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.end_watches()
        self._hung.set()
        assert self._server is not None
        self._server.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    # What a test does to the server directly.

    def fail(self, status: int, verb: str | None = None, *, times: int = 1, reason: str = "",
             headers: list[tuple[str, str]] | None = None) -> None:
        self.faults.append(Fault(status, verb, times, headers or [], reason))

    def put(self, collection_path: str, obj: Object) -> Object:
        """Store ``obj`` (made or replaced) under a collection path as ``Resource.path`` gives it,
        as if another client wrote it: a new version, an event for the watchers."""
        collection, namespace, _ = split(collection_path + "/x")
        return self._store(collection, namespace, copy.deepcopy(obj))

    def remove(self, collection_path: str, name: str) -> None:
        collection, namespace, _ = split(collection_path + "/x")
        gone = self.objects[collection].pop((namespace, name))
        self._record("DELETED", collection, gone, bump=True)

    def compact(self) -> None:
        """Forget every version before now: a watch from an older one gets 410."""
        self.oldest = self.version
        self.history.clear()

    def bookmark(self) -> None:
        line = _line("BOOKMARK", {"metadata": {"resourceVersion": str(self.version)}})
        for watcher in self.watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(line)

    def end_watches(self) -> None:
        """End every open watch, as the server's timeoutSeconds does."""
        for watcher in self.watchers:
            watcher.queue.put_nowait(None)

    def seen(self, verb: str) -> list[Seen]:
        return [r for r in self.requests if r.verb == verb]

    # The store.

    def _record(self, kind: str, collection: str, obj: Object, *, bump: bool) -> None:
        if bump:
            self.version += 1
            obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.history.append(Change(self.version, kind, collection, copy.deepcopy(obj)))
        for watcher in self.watchers:
            if self._watched(watcher, collection, obj):
                watcher.queue.put_nowait(_line(kind, obj))

    @staticmethod
    def _watched(watcher: Watcher, collection: str, obj: Object) -> bool:
        return (watcher.collection == collection
                and watcher.namespace in ("", obj["metadata"].get("namespace", ""))
                and matches(obj, *watcher.selectors))

    def _store(self, collection: str, namespace: str, obj: Object) -> Object:
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        key = (namespace, meta["name"])
        old = self.objects.setdefault(collection, {}).get(key)
        meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        if old and old.get("spec") != obj.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        self.objects[collection][key] = obj
        self._record("MODIFIED" if old else "ADDED", collection, obj, bump=True)
        return copy.deepcopy(obj)

    def _answer(self, seen: Seen) -> tuple[int, Object]:
        """The status and body of every verb but watch."""
        collection, namespace, name = split(seen.path)
        stored = self.objects.setdefault(collection, {})
        dry = seen.query.get("dryRun") == "All" or (seen.body or {}).get("dryRun") == ["All"]
        if seen.verb == "list":
            items = [copy.deepcopy(o) for (ns, _), o in sorted(stored.items())
                     if namespace in ("", ns) and matches(o, seen.query.get("labelSelector", ""),
                                                          seen.query.get("fieldSelector", ""))]
            return 200, {"kind": "List", "apiVersion": "v1", "items": items,
                         "metadata": {"resourceVersion": str(self.version)}}
        if seen.verb == "create":
            obj = copy.deepcopy(seen.body or {})
            name = obj.get("metadata", {}).get("name", "")
            if (namespace, name) in stored:
                return _status(409, f'"{name}" already exists', "AlreadyExists")
            if dry:
                return 201, obj
            return 201, self._store(collection, namespace, obj)
        current = stored.get((namespace, name))
        if current is None:
            return _status(404, f'"{name}" not found')
        if seen.verb == "get":
            return 200, copy.deepcopy(current)
        meta = current["metadata"]
        if seen.verb == "update":
            obj = copy.deepcopy(seen.body or {})
            asked = obj.get("metadata", {}).get("resourceVersion")
            if asked and asked != meta["resourceVersion"]:
                return _status(409, f'Operation cannot be fulfilled on "{name}": the object has '
                                    "been modified; please apply your changes to the latest version "
                                    "and try again")
            obj["metadata"]["uid"] = meta["uid"]
            return 200, obj if dry else self._store(collection, namespace, obj)
        # delete
        wanted = (seen.body or {}).get("preconditions") or {}
        for key in ("uid", "resourceVersion"):
            if key in wanted and wanted[key] != meta[key]:
                return _status(409, f"Precondition failed: {key} in precondition: {wanted[key]}, "
                                    f"{key} in object meta: {meta[key]}")
        if not dry:
            del stored[(namespace, name)]
            self._record("DELETED", collection, current, bump=True)
        return 200, copy.deepcopy(current)

    # HTTP.

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, h11.ProtocolError):
            pass  # the client went away
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = h11.Connection(h11.SERVER)
        request, body = None, bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                return
        assert request is not None
        seen = self._seen(request, bytes(body))
        self.requests.append(seen)

        def send(event: h11.Event) -> None:
            writer.write(connection.send(event) or b"")

        async def respond(status: int, obj: Object, headers: list[tuple[str, str]]) -> None:
            data = json.dumps(obj).encode()
            length = [] if self.chunked else [("Content-Length", str(len(data)))]
            send(h11.Response(status_code=status, headers=[
                ("Content-Type", "application/json"), *length, *headers]))
            for start in range(0, len(data), 1000):
                send(h11.Data(data=data[start:start + 1000]))
            send(h11.EndOfMessage())
            await writer.drain()

        fault = next((f for f in self.faults if f.verb in (None, seen.verb) and f.times), None)
        if fault is not None:
            fault.times -= 1
            if fault.status == 0:
                await self._hung.wait()
                return
            await respond(*_status(fault.status, f"injected {fault.status}", fault.reason),
                          fault.headers)
        elif self.tokens and seen.headers.get("authorization", "").removeprefix("Bearer ") not in self.tokens:
            await respond(*_status(401, "Unauthorized"), [])
        elif seen.verb == "watch":
            send(h11.Response(status_code=200, headers=[("Content-Type", "application/json")]))
            await self._watch(seen, send, writer)
            send(h11.EndOfMessage())
            await writer.drain()
        else:
            await respond(*self._answer(seen), [])

    async def _watch(self, seen: Seen, send: Any, writer: asyncio.StreamWriter) -> None:
        collection, namespace, _ = split(seen.path)
        selectors = (seen.query.get("labelSelector", ""), seen.query.get("fieldSelector", ""))
        since = seen.query.get("resourceVersion", "")
        if since not in ("", "0") and int(since) < self.oldest:
            status = _status(410, f"too old resource version: {since} ({self.oldest})", "Expired")[1]
            send(h11.Data(data=_line("ERROR", status)))
            return
        watcher = Watcher(collection, namespace, selectors,
                          seen.query.get("allowWatchBookmarks") == "true")
        if since in ("", "0"):
            backlog = [_line("ADDED", o) for (ns, _), o in sorted(self.objects.get(collection, {}).items())
                       if self._watched(watcher, collection, o)]
        else:
            backlog = [_line(c.type, c.obj) for c in self.history
                       if c.version > int(since) and self._watched(watcher, c.collection, c.obj)]
        for line in backlog:
            watcher.queue.put_nowait(line)
        self.watchers.append(watcher)
        try:
            while (line := await watcher.queue.get()) is not None:
                send(h11.Data(data=line))
                await writer.drain()
        finally:
            self.watchers.remove(watcher)

    @staticmethod
    def _seen(request: h11.Request, body: bytes) -> Seen:
        target = urlsplit(request.target.decode())
        query = dict(parse_qsl(target.query))
        method = request.method.decode()
        _, _, name = split(target.path)
        verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}.get(method, "get")
        if verb == "get" and not name:
            verb = "watch" if query.get("watch") in ("true", "1") else "list"
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        return Seen(verb, method, target.path, query, headers, json.loads(body) if body else None)


def _status(code: int, message: str, reason: str = "") -> tuple[int, Object]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                  "reason": reason or REASONS.get(code, "Unknown"), "code": code}


def _line(kind: str, obj: Object) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def self_signed(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A server TLS context for 127.0.0.1 and the certificate a client trusts (openssl)."""
    cert, key = directory / "ca.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=fake-api",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context, cert


class Sleeps:
    """An injected sleep (kubeapi.Backoff's): records each delay and returns at once, so tests
    read the back-off instead of waiting it."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)
