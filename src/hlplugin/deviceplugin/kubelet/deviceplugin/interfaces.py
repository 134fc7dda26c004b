"""The seams between the generic lifecycle and a resource-specific server, one small interface each
(the kubelet's own plugin/v1beta1/api.go has the same shape).

A daemon hands ``PluginLifecycle`` a ``ServicerFactory``; every server instance the lifecycle starts
gets a fresh ``PluginServicer`` from it, whose handlers take a ``Context`` (kubelet/context.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc


class PluginServicer(pb_grpc.DevicePluginServicer):
    """What a resource-specific server adds to the generated servicer: a way to end its streams,
    a stream count with a hook called when it changes, and the largest request it accepts."""

    open_streams: int
    max_request_bytes: int = 4 * 1024 * 1024
    on_streams_changed: Callable[[], None] | None = None

    def close_streams(self) -> None:
        raise NotImplementedError


class ServicerFactory(Protocol):
    """A fresh servicer for each server instance (its streams end with that instance)."""

    def __call__(self) -> PluginServicer: ...
