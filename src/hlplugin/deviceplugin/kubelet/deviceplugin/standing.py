"""How a device plugin's lifecycle stands, as its daemon's probes ask: /readyz's kubelet
conditions, and the call /healthz makes to our own server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.kubelet.role import Role


class Readiness(StrEnum):
    """A device plugin's kubelet conditions (/readyz keys)."""

    REGISTERED = "registered"
    LISTANDWATCH = "listandwatch"


# /readyz's kubelet conditions before a lifecycle is built (the daemon waits for its device).
UNREGISTERED: dict[str, tuple[bool, str]] = {
    Readiness.REGISTERED: (False, "not registered with the kubelet"),
    Readiness.LISTANDWATCH: (False, "the kubelet has no ListAndWatch open")}
_EMPTY = pb.Empty()


def options_call(channel: grpc.aio.Channel) -> Callable[[float], Awaitable[object]]:
    """The self-check's call (grpcserver.SelfCall): GetDevicePluginOptions, answered at once."""
    call = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions
    return lambda timeout: call(_EMPTY, timeout=timeout)


class Lifecycle(Protocol):
    """What the conditions read of a PluginLifecycle (lifecycle.py)."""

    role: Role
    socket_path: Path
    transition: str
    registered: bool

    @property
    def status(self) -> str: ...

    @property
    def open_streams(self) -> int: ...


def conditions(lifecycle: Lifecycle) -> dict[str, tuple[bool, str]]:
    """Registered, and a ListAndWatch stream open; a standby (role.py) counts as both while
    another instance serves our socket, so a surge rollout's new pod is Ready once its own checks
    pass; so does one taking the socket over or handing it over (``transition``), so a rollout
    that goes right fails no probe."""
    if lifecycle.role.standby:
        note = (f"standby: {lifecycle.role.holder} serves {lifecycle.socket_path}; this "
                f"instance takes over when it goes")
        return {Readiness.REGISTERED: (True, note), Readiness.LISTANDWATCH: (True, "standby")}
    if lifecycle.transition:
        return {Readiness.REGISTERED: (True, lifecycle.transition),
                Readiness.LISTANDWATCH: (True, lifecycle.transition)}
    streams = lifecycle.open_streams
    return {Readiness.REGISTERED: (lifecycle.registered, lifecycle.status),
            Readiness.LISTANDWATCH: (streams > 0,
                                     "" if streams else UNREGISTERED[Readiness.LISTANDWATCH][1])}
