"""Our gRPC server instances at one socket path: prepared (serving on a private name, as a
standby's is while it waits), started (published at the path), handed over, stopped. At most one
is current. The hand-over's timing (lifecycle.py's module docstring): the old instance ends its
streams, then its socket goes; the standby takes it and registers HANDOVER_SETTLE later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hlplugin.deviceplugin.health.watch import Wakeup
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import new_server
from hlplugin.deviceplugin.kubelet.deviceplugin.interfaces import PluginServicer, ServicerFactory
from hlplugin.deviceplugin.kubelet.endpoint import Endpoint, find_holder
from hlplugin.deviceplugin.kubelet.grpcserver import to_completion

log = logging.getLogger(__name__)

# How long the old instance's streams get to end, at most, before its socket goes anyway; then
# how long the kubelet gets to read their end and disconnect the old client before the standby,
# having taken the socket, registers. The standby waits that out, not the old instance: a pod
# stopping is busy and may be throttled by its CPU limit past a short sleep, an idle standby is
# not. Its share of the kubelet's gap: tests/test_handover.py.
HANDOVER_WAIT = 0.5
HANDOVER_SETTLE = 0.02
# At most, once the streams have ended in our handlers, for gRPC to write their ends and the frame
# guard to pass them on to the kubelet. Waiting costs the node nothing (the kubelet counts our
# devices until it sees the end); past it the socket goes anyway, and a standby disconnected by
# the late end registers again at once (lifecycle.TAKEOVER_WINDOW).
HANDOVER_FORWARD = 1.0


@dataclass
class Instance:
    servicer: PluginServicer
    endpoint: Endpoint  # with the servicer's gRPC server
    live: bool = False  # serving at its endpoint, and not stopping


class Instances:
    def __init__(self, socket_path: Path, make_servicer: ServicerFactory, wakeup: Wakeup, *,
                 guard: bool = False) -> None:
        """``wakeup`` fires on every change of a servicer's streams (and of the directory);
        ``guard``: each server behind a frame guard (Endpoint)."""
        self.socket_path = socket_path
        self._guard = guard
        self._make_servicer = make_servicer
        self._wakeup = wakeup
        self.current: Instance | None = None

    def held(self) -> bool:
        """Another live process serves the path now."""
        try:
            holder = find_holder(self.socket_path)
        except OSError:
            return False  # the lifecycle's wait meets it and says so
        if holder is None:
            return False
        holder.close()
        return True

    async def prepare(self, problem: Callable[[], str]) -> Instance:
        """A server started on its private name, not yet at the path; RuntimeError(problem())
        first when the directory has one."""
        if found := problem():
            raise RuntimeError(found)  # before gRPC tries, and logs its own line every retry
        servicer = self._make_servicer()
        servicer.on_streams_changed = self._wakeup.fire
        instance = Instance(servicer, Endpoint(self.socket_path, new_server(servicer), guard=self._guard))
        self.current = instance
        try:
            await instance.endpoint.serve()
        except BaseException:
            await self.stop(instance)  # never leave a server to the GC
            raise
        return instance

    async def start(self, prepared: Instance | None, problem: Callable[[], str]) -> Instance:
        """Serve at the path: ``prepared`` (a standby's server) or a new one. Raises Held,
        OSError, RuntimeError as Endpoint does, having stopped the server."""
        instance = prepared or await self.prepare(problem)
        try:
            instance.endpoint.remove_stale()
            instance.endpoint.take()
        except BaseException:
            await self.stop(instance)  # the guard removes its private name
            raise
        instance.live = True
        return instance

    async def stop(self, instance: Instance) -> None:
        if not instance.live and self.current is not instance:
            return  # already stopped
        # From here the instance counts as gone, so liveness does not ask a server that is
        # stopping on purpose.
        instance.live = False
        instance.servicer.close_streams()
        try:
            # Within its deadline, whatever a client holds; the path removed unless another
            # instance has taken it over.
            await instance.endpoint.stop()
        finally:
            if self.current is instance:
                self.current = None

    async def hand_over(self, instance: Instance) -> None:
        """On the way out: end the kubelet's streams, then remove our socket, which a standby
        takes at once; stop() then stops the server. A cancellation meanwhile (the daemon
        re-cancels while stopping) waits for these steps."""
        instance.live = False
        streamed = instance.servicer.open_streams > 0
        streams = instance.endpoint.streams()  # the ListAndWatch streams among them
        instance.servicer.close_streams()
        if streamed:
            with contextlib.suppress(asyncio.CancelledError):
                await to_completion(self._streams_ended(instance))
                # Their ends through the frame guard to the kubelet before the standby may take
                # the socket, as gRPC wrote them to the kubelet's connection itself: gRPC writes
                # them after our handlers return, and the guard forwards them when this loop
                # next reads, which a process busy stopping does late (issue 40: on the real
                # cluster the kubelet saw them after the standby's Register, 8 of 19 times).
                await to_completion(instance.endpoint.forwarded(HANDOVER_FORWARD, streams))
        instance.endpoint.remove()

    async def _streams_ended(self, instance: Instance) -> None:
        """Wait (at most HANDOVER_WAIT) until our streams have ended. When the kubelet has read
        their end is not observable from here (its disconnect closes a connection gRPC does not
        tell us about): the standby gives it HANDOVER_SETTLE before it registers."""
        loop = asyncio.get_running_loop()
        until = loop.time() + HANDOVER_WAIT
        while (left := until - loop.time()) > 0:
            pulse = self._wakeup.pulse()  # servicer.on_streams_changed fires it
            if not instance.servicer.open_streams:
                return
            await self._wakeup.wait(pulse, left)
