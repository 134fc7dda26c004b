"""/healthz, /readyz and /metrics over HTTP for both daemons.

prometheus_client's threading WSGI server and exposition, from the standard library's wsgiref:
no extra dependency, HTTP parsing done by the standard library, and one thread per connection, so
a slow or silent client holds only its own thread (each read times out) and never the event loop
or another endpoint.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

# (ok, reason) per readiness condition; a callable so every request sees the current state.
Readiness = Callable[[], Mapping[str, tuple[bool, str]]]
Liveness = Callable[[], tuple[bool, str]]
StartResponse = Callable[..., Any]


class _QuietHandler(WSGIRequestHandler):
    timeout = 5.0  # a half-open client gives up its thread after this

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


def make_app(readiness: Readiness, liveness: Liveness,
             registry: CollectorRegistry) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics_app = make_wsgi_app(registry)

    def reply(start: StartResponse, ok: bool, body: dict[str, Any]) -> list[bytes]:
        data = json.dumps(body, sort_keys=True).encode() + b"\n"
        start("200 OK" if ok else "503 Service Unavailable",
              [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    def app(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"method not allowed\n"]
        if path == "/metrics":
            result: Iterable[bytes] = metrics_app(environ, start)
            return result
        if path == "/healthz":
            ok, reason = liveness()
            return reply(start, ok, {"status": "ok" if ok else "failing", "reason": reason})
        if path == "/readyz":
            conditions = readiness()
            ready = all(ok for ok, _ in conditions.values())
            return reply(start, ready, {
                "status": "ready" if ready else "not ready",
                "conditions": {name: {"ok": ok, "reason": reason}
                               for name, (ok, reason) in conditions.items()},
            })
        start("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /healthz, /readyz or /metrics\n"]

    return app


class HttpServer:
    """Runs the WSGI app in a daemon thread; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, address: tuple[str, int], readiness: Readiness, liveness: Liveness,
                 registry: CollectorRegistry) -> None:
        self._server = make_server(address[0], address[1], make_app(readiness, liveness, registry),
                                   ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="http",
                                        kwargs={"poll_interval": 0.5}, daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving /healthz, /readyz and /metrics on port %d", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
