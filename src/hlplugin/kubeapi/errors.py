"""What a failed call raises: one type per answer a caller handles differently.

Every error carries the verb and the resource (``list resourceslices.resource.k8s.io``), so a
caller can say what it was refused without knowing the call (a 403 shown in ``/readyz`` names
the permission the chart lacks).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any


class KubeApiError(Exception):
    """Any failure of a call to the API server."""


class ConfigError(KubeApiError):
    """No API server to talk to: not in a cluster, or its service account files are missing."""


class Unreachable(KubeApiError):
    """No answer: the connection failed, timed out, or broke before the response ended. Retried
    as a 503 is: the API server restarting or a load balancer moving are what it usually is."""

    retry_after: float | None = None


class ResponseTooLarge(KubeApiError):
    """The answer passed the client's bound (transport.MAX_BODY): refused rather than parsed."""


class ApiError(KubeApiError):
    """The API server answered with an error status (a ``Status`` object, usually)."""

    def __init__(self, status: int, reason: str, message: str, *, verb: str, resource: str,
                 name: str = "", retry_after: float | None = None) -> None:
        self.status, self.reason, self.message = status, reason, message
        self.verb, self.resource, self.name = verb, resource, name
        self.retry_after = retry_after
        what = f"{resource}/{name}" if name else resource
        super().__init__(f"{verb} {what}: {status} {reason}: {message}")


class Unauthorized(ApiError):
    """401: the token was refused (expired, or rotated under us): read it again, once."""


class Forbidden(ApiError):
    """403: RBAC (or an admission policy) refuses this verb on this resource."""


class NotFound(ApiError):
    """404: no such object (or no such resource type on this server)."""


class Conflict(ApiError):
    """409 Conflict: the object changed since it was read (a stale resourceVersion or a failed
    delete precondition). Read it again, change that, write again (retry.modify does)."""


class AlreadyExists(ApiError):
    """409 AlreadyExists: a create found the name taken (also a create retried after a 5xx whose
    first attempt had in fact succeeded). Not a Conflict: re-reading does not mend a create."""


class Gone(ApiError):
    """410: the resourceVersion asked for is older than the server keeps (compacted): list
    again and watch from the list's resourceVersion (watch.reflect does)."""


class Invalid(ApiError):
    """422: the server's validation refused the object."""


class TooManyRequests(ApiError):
    """429: the server's flow control shed this call; retried after its Retry-After."""


class ServerError(ApiError):
    """5xx: retried with back-off (retry.Backoff); raised once the attempts are spent."""


_BY_STATUS: dict[int, type[ApiError]] = {401: Unauthorized, 403: Forbidden, 404: NotFound,
                                         409: Conflict, 410: Gone, 422: Invalid,
                                         429: TooManyRequests}


def status_error(status: int, body: bytes, retry_after: str | None, *, verb: str, resource: str,
                 name: str = "") -> ApiError:
    """The typed error for an error answer: its ``Status`` body's reason and message, if any."""
    parsed: Any = None
    with contextlib.suppress(ValueError):
        parsed = json.loads(body)
    details = parsed if isinstance(parsed, dict) else {}
    reason = str(details.get("reason") or "")
    message = str(details.get("message") or body[:200].decode("utf-8", "replace"))
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    if kind is Conflict and reason == "AlreadyExists":
        kind = AlreadyExists
    return kind(status, reason or "Unknown", message, verb=verb, resource=resource, name=name,
                retry_after=seconds(retry_after))


def seconds(retry_after: str | None) -> float | None:
    """Retry-After as delta-seconds (what the API server sends); an HTTP date or garbage is
    ignored, and the back-off's own delay applies."""
    if retry_after is None:
        return None
    try:
        value = float(retry_after.strip())
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None
