"""A Kubernetes API client for the DRA driver's control-plane side: the API server's wing, beside
the kubelet protocols of ``hlplugin.deviceplugin``, which never import it (tests/test_layers.py).

Small on purpose (docs/dra.md, "Client"): asyncio streams, ``ssl`` and h11 (already the probe
port's parser), plain dicts for objects, and the retries no Python client made for us. It costs
a node about a megabyte where lightkube costs twelve. One role per module:

- ``config``: the in-cluster service, CA and rotating token, or an explicit server;
- ``transport``: one bounded HTTP/1.1 exchange per call;
- ``client``: get, list, watch, create, update, delete, dry run; 401 and back-off retries;
- ``watch``: typed events, and ``reflect`` (list, then watch, re-list on 410);
- ``retry``: the back-off, and ``modify`` (read-modify-write, re-read on 409);
- ``errors``: one type per answer a caller handles differently;
- ``resources``: a resource type's paths and the ones the driver uses.
"""

from hlplugin.kubeapi.client import Client
from hlplugin.kubeapi.config import Config, TokenFile
from hlplugin.kubeapi.errors import (
    AlreadyExists,
    ApiError,
    ConfigError,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    KubeApiError,
    NotFound,
    ResponseTooLarge,
    ServerError,
    TooManyRequests,
    Unauthorized,
    Unreachable,
)
from hlplugin.kubeapi.resources import NODES, RESOURCE_CLAIMS, RESOURCE_SLICES, Object, Resource
from hlplugin.kubeapi.retry import Backoff, modify
from hlplugin.kubeapi.watch import Event, EventType, Listed, reflect

__all__ = [
    "NODES",
    "RESOURCE_CLAIMS",
    "RESOURCE_SLICES",
    "AlreadyExists",
    "ApiError",
    "Backoff",
    "Client",
    "Config",
    "ConfigError",
    "Conflict",
    "Event",
    "EventType",
    "Forbidden",
    "Gone",
    "Invalid",
    "KubeApiError",
    "Listed",
    "NotFound",
    "Object",
    "Resource",
    "ResponseTooLarge",
    "ServerError",
    "TokenFile",
    "TooManyRequests",
    "Unauthorized",
    "Unreachable",
    "modify",
    "reflect",
]
