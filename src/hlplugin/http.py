"""/healthz, /readyz and /metrics over HTTP for both daemons.

prometheus_client's threading WSGI server and exposition, from the standard library's wsgiref:
no extra dependency, HTTP parsing done by the standard library, and one thread per connection, so
a slow or silent client holds only its own thread (each read times out) and never the event loop
or another endpoint.
"""

from __future__ import annotations

import io
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


class _LogStream(io.StringIO):
    """wsgiref prints an application's traceback to stderr; this makes it one log record."""

    def flush(self) -> None:
        text = self.getvalue().strip()
        if text:
            log.error("http: error in a request handler: %s", text)
        self.seek(0)
        self.truncate()


class _QuietHandler(WSGIRequestHandler):
    timeout = 5.0  # a half-open client gives up its thread after this
    # An unparseable request line still gets a status line (the stdlib default, HTTP/0.9,
    # answers a bare HTML body) and a short plain-text reason.
    default_request_version = "HTTP/1.0"
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)

    def get_stderr(self) -> io.StringIO:
        return _LogStream()


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or breaks the connection is the client's problem: debug, one
        line, never the stdlib's multi-line dump on stderr (which would break JSON logs)."""
        log.debug("http: connection from %s failed", client_address, exc_info=True)


def make_app(readiness: Readiness, liveness: Liveness,
             registry: CollectorRegistry) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics_app = make_wsgi_app(registry)

    def reply(start: StartResponse, ok: bool, body: dict[str, Any]) -> list[bytes]:
        data = json.dumps(body, sort_keys=True).encode() + b"\n"
        start("200 OK" if ok else "503 Service Unavailable",
              [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    def app(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD")
        if method not in ("GET", "HEAD"):
            start("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
            return [b"method not allowed\n"]
        body = route(environ, start)
        return [] if method == "HEAD" else body  # wsgiref would send a HEAD answer's body

    def route(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
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
                                   _Server, handler_class=_QuietHandler)
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="http",
                                        kwargs={"poll_interval": 0.5}, daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving /healthz, /readyz and /metrics on port %d", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
