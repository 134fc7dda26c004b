"""A kubelet plugin registered through the kubelet's plugin watcher (pluginregistration v1), as
DRA drivers and CSI drivers are: the plugin serves its own service on ``endpoint``, then a
Registration service on a socket in the kubelet's plugins_registry directory; the watcher finds
that socket, calls GetInfo, dials the endpoint, and tells the verdict with
NotifyRegistrationStatus. Removing the registration socket unregisters the plugin.

Unlike the device-plugin API, nothing here is deleted by a kubelet restart: the new kubelet walks
the directory and registers every socket it finds again. Both sockets are owned through
endpoint.Endpoint (bound under a private name, linked into place, removed only while still ours).
Each is named per instance (``instance``: the pod's UID) so that two pods of one driver, the old
and the new of a surging upgrade, serve side by side: the kubelet refuses a second registration
of one endpoint, and keeps using the newest plugin that is connected.

The registration socket is published last (the kubelet dials the endpoint as soon as it has
registered) and removed first (it stops using us before the endpoint goes); if someone removes
it, it is published again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from hlplugin.api import pluginregistration_pb2 as reg_pb
from hlplugin.api import pluginregistration_pb2_grpc as reg_grpc
from hlplugin.deviceplugin.health.watch import DirWatcher, Wakeup
from hlplugin.deviceplugin.kubelet.context import Context
from hlplugin.deviceplugin.kubelet.endpoint import Endpoint, Holder, wait_until_free
from hlplugin.deviceplugin.kubelet.grpcserver import bounded_server

log = logging.getLogger(__name__)

DRA_PLUGIN = "DRAPlugin"  # PluginInfo.type the kubelet's DRA handler takes


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """GetInfo answers who we are; NotifyRegistrationStatus is handed to ``on_status``."""

    def __init__(self, info: reg_pb.PluginInfo, on_status: Callable[[bool, str], None]) -> None:
        self.info = info
        self.on_status = on_status

    async def GetInfo(self, request: reg_pb.InfoRequest, context: Context) -> reg_pb.PluginInfo:
        return self.info

    async def NotifyRegistrationStatus(self, request: reg_pb.RegistrationStatus,
                                       context: Context) -> reg_pb.RegistrationStatusResponse:
        self.on_status(request.plugin_registered, request.error)
        return reg_pb.RegistrationStatusResponse()


class WatcherPlugin:
    """Serve ``server`` at ``endpoint`` and stay registered through ``registry_dir`` until
    cancelled; ``registered`` is the kubelet's latest verdict on our current registration socket."""

    def __init__(self, registry_dir: Path, registration_name: str, endpoint: Path,
                 plugin_type: str, name: str, versions: tuple[str, ...],
                 server: Callable[[], grpc.aio.Server], *, recheck: float = 10.0,
                 on_status: Callable[[bool], None] | None = None,
                 dir_setting: str = "the registry directory", guard: bool = False) -> None:
        """``dir_setting``: how the operator names ``registry_dir`` (a flag), for the hint;
        ``guard``: both servers behind a frame guard (endpoint.py)."""
        self._guard = guard
        self.registry_dir = registry_dir
        self.registration_path = registry_dir / registration_name
        self.endpoint_path = endpoint
        self.info = reg_pb.PluginInfo(type=plugin_type, name=name, endpoint=str(endpoint),
                                      supported_versions=versions)
        self._make_server = server
        self._recheck = recheck
        self._on_status = on_status
        self._wakeup = Wakeup(DirWatcher(registry_dir, {registration_name}, poll_interval=1.0))
        self.registered = False
        self.stopping = False  # cancelled: our registration withdrawn on purpose
        self.serving = False  # our endpoint is published and its server runs
        self.problem = (f"the kubelet's plugin watcher has not called on {self.registration_path} "
                        f"yet (is {dir_setting} the kubelet's plugins_registry?)")

    @property
    def status(self) -> str:
        return "" if self.registered else self.problem

    @property
    def ready(self) -> bool:
        """Registered, or stopping: the registration withdrawn on purpose (the kubelet calls the
        newer pod of a surge) is no failure. The kubelet probes a terminating pod's readiness,
        and a failed probe is a Warning event for a rollout that went right (each of 4 rollouts
        on the real cluster raised one, the old pod answering 503 while its servers stopped)."""
        return self.registered or self.stopping

    def _status(self, registered: bool, error: str) -> None:
        self.registered = registered
        if registered:
            self.problem = ""
            log.info("registered %s with the kubelet (plugin watcher, %s)", self.info.name,
                     self.registration_path)
        else:
            self.problem = f"the kubelet refused the registration: {error or '(no reason given)'}"
            log.error("%s", self.problem)
        if self._on_status is not None:
            self._on_status(registered)

    async def run(self) -> None:
        endpoint = Endpoint(self.endpoint_path, self._make_server(), guard=self._guard)
        try:
            await self._bind(endpoint)
            self.serving = True
            log.info("serving %s on %s", self.info.name, self.endpoint_path)
            async with self._wakeup.running():
                while True:
                    await self._registered_until_removed()
        finally:
            self.serving = False  # stopping on purpose: the self-check no longer asks
            with contextlib.suppress(asyncio.CancelledError):
                await endpoint.stop()

    async def _bind(self, endpoint: Endpoint) -> None:
        endpoint.path.parent.mkdir(parents=True, exist_ok=True)
        await wait_until_free(endpoint.path, lambda: asyncio.sleep(self._recheck), _log_holder)
        endpoint.remove_stale()
        await endpoint.bind()

    async def _registered_until_removed(self) -> None:
        """Publish the registration socket; return once it is no longer ours (removed,
        replaced); cancelled, remove it first."""
        # The kubelet sends two tiny messages; the bounds of grpcserver.py for everything else.
        server = bounded_server(64 * 1024)
        reg_grpc.add_RegistrationServicer_to_server(
            RegistrationServicer(self.info, self._status), server)
        registration = Endpoint(self.registration_path, server, guard=self._guard)
        try:
            await self._bind(registration)
            while registration.ours():
                pulse = self._wakeup.pulse()
                if not registration.ours():
                    break
                await self._wakeup.wait(pulse, self._recheck)
            log.warning("our registration socket %s was removed or replaced; publishing it again",
                        self.registration_path)
        except asyncio.CancelledError:
            self.stopping = True
            raise
        finally:
            self.registered = False
            self.problem = (f"stopping: {self.registration_path} withdrawn" if self.stopping else
                            f"{self.registration_path} is not published (being published again)")
            registration.remove()  # first: the kubelet unregisters us before the endpoint goes
            with contextlib.suppress(asyncio.CancelledError):
                await registration.stop()


def _log_holder(holder: Holder) -> None:
    log.warning("%s is served by %s; waiting for it to go away", holder.path, holder.describe())
