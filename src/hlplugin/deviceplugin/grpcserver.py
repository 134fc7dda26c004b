"""The gRPC server of one plugin instance, and clean-up that a cancellation cannot cut short."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from hlplugin.deviceplugin.lifecycle import PluginServicer


async def to_completion(work: Coroutine[Any, Any, None]) -> None:
    """Finish bounded clean-up even when cancelled meanwhile, then re-raise the cancellation.

    The daemon re-cancels every 0.25 s while stopping (see run_daemon); a server.stop() cut short
    leaves a running server that the garbage collector shuts down after the loop has closed,
    printing a traceback, and leaves its socket behind.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def new_server(servicer: PluginServicer) -> grpc.aio.Server:
    """A gRPC server for ``servicer`` that refuses requests larger than it accepts, before they are
    parsed (RESOURCE_EXHAUSTED)."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", servicer.max_request_bytes)])
    pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
    return server
