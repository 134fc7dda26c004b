"""The kubelet's plugin watcher and DRA manager as a driver meets them, over real unix sockets and
real gRPC (pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra/plugin, v1.36):

- a socket file in the registry directory (not a dot file) is a plugin to register: GetInfo,
  then the DRA handler's checks (type DRAPlugin; a non-empty list of supported services, of which
  the first the kubelet knows is chosen, in the plugin's order; an endpoint no other plugin of the
  driver has registered), then NotifyRegistrationStatus with the verdict;
- a registration socket that goes away (or is replaced) unregisters the plugin, and a new one is
  registered anew; a refused one is tried again at every pass (the kubelet's reconciler retries a
  failed registration, with a backoff this fake leaves out);
- a restarted kubelet (a new watcher) registers every socket it finds in the directory;
- calls go to the newest registered plugin of a driver, over the service chosen at its
  registration (a DRAPlugin service: the health service, listed among them, is never chosen);
- the resource-health stream (dra-health v1alpha1, gate ResourceHealthStatus, on in 1.36) is
  opened on the same endpoint only for a plugin that lists ``v1alpha1.DRAResourceHealth``, as
  newer kubelets do (upstream's TestHealthStreamRequiresAdvertisedService; the 1.36 kubelet
  opens it whatever the plugin listed, so a driver must list it to be watched by both).

``sync()`` is one pass of the watcher's reconciler (the kubelet's runs every second and on
inotify events); tests call it through the one poller, harness.wait_until.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from hlplugin.api import dra_health_v1alpha1_pb2 as health_pb
from hlplugin.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from hlplugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from hlplugin.api import pluginregistration_pb2 as reg_pb
from hlplugin.api import pluginregistration_pb2_grpc as reg_grpc

KNOWN = {"v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
         "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}
HEALTH = "v1alpha1.DRAResourceHealth"


class NoHealthStream(Exception):
    """The kubelet opens no health stream on a plugin that did not list the health service."""


@dataclass
class Registered:
    socket: Path
    identity: tuple[int, int, int]
    info: reg_pb.PluginInfo
    service: str  # the chosen "<version>.DRAPlugin"

    @property
    def health(self) -> bool:
        """The plugin listed the health service: the kubelet watches its devices' health."""
        return HEALTH in self.info.supported_versions

    @property
    def api(self) -> tuple[ModuleType, ModuleType]:
        return KNOWN[self.service]


@dataclass
class FakePluginWatcher:
    registry_dir: Path
    # The DRAPlugin services this kubelet knows (never the health service: it is no DRAPlugin).
    services: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    plugins: dict[Path, Registered] = field(default_factory=dict)
    refused: dict[Path, str] = field(default_factory=dict)  # socket -> the latest error notified
    infos: list[reg_pb.PluginInfo] = field(default_factory=list)  # every GetInfo answer

    async def sync(self) -> None:
        """Register new sockets, unregister gone or replaced ones."""
        present: dict[Path, tuple[int, int, int]] = {}
        for name in os.listdir(self.registry_dir):
            path = self.registry_dir / name
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # gone since the listing (a socket's temporary name)
                continue
            if not name.startswith(".") and stat.S_ISSOCK(st.st_mode):
                # The kubelet registers a socket when it is created at the name (fsnotify Create).
                # Its mtime is its bind, so a new socket on a reused inode number differs; not its
                # ctime, which a plugin's publish (link, then unlink of its private name) changes
                # after the socket is at the name: that is no new socket.
                present[path] = (st.st_dev, st.st_ino, st.st_mtime_ns)
        for path in list(self.plugins):
            if present.get(path) != self.plugins[path].identity:
                del self.plugins[path]
        for path, identity in present.items():
            if path not in self.plugins:
                await self._register(path, identity)

    async def _register(self, path: Path, identity: tuple[int, int, int]) -> None:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
            self.infos.append(info)
            error = self._validate(info)
            await stub.NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=not error, error=error), timeout=5)
        if error:
            self.refused[path] = error
            return
        self.refused.pop(path, None)
        service = next(s for s in info.supported_versions if s in self.services)
        self.plugins[path] = Registered(path, identity, info, service)

    def _validate(self, info: reg_pb.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"unknown plugin type {info.type!r}"
        if not info.supported_versions:
            return "empty list of supported gRPC services (aka supported versions)"
        if not any(s in self.services for s in info.supported_versions):
            return (f"none of services supported by the plugin ({list(info.supported_versions)}) "
                    f"are supported by the kubelet ({list(self.services)})")
        if any(p.info.name == info.name and p.info.endpoint == info.endpoint
               for p in self.plugins.values()):
            return f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
        return ""

    def newest(self, driver: str) -> Registered:
        matching = [p for p in self.plugins.values() if p.info.name == driver]
        assert matching, f"no plugin of {driver} registered"
        return matching[-1]

    async def call(self, driver: str, method: str, claims: list[tuple[str, str, str]],
                   plugin: Registered | None = None) -> Any:
        """NodePrepareResources or NodeUnprepareResources of (namespace, uid, name) claims, over
        the chosen service of ``plugin`` (the newest of ``driver``)."""
        plugin = plugin or self.newest(driver)
        api, api_grpc = plugin.api
        request_type = getattr(api, f"{method}Request")
        request = request_type(claims=[api.Claim(namespace=ns, uid=uid, name=name)
                                       for ns, uid, name in claims])
        async with grpc.aio.insecure_channel(f"unix://{plugin.info.endpoint}") as channel:
            return await getattr(api_grpc.DRAPluginStub(channel), method)(request, timeout=10)

    async def prepare(self, driver: str, *claims: tuple[str, str, str],
                      plugin: Registered | None = None) -> Any:
        return await self.call(driver, "NodePrepareResources", list(claims), plugin)

    async def unprepare(self, driver: str, *claims: tuple[str, str, str],
                        plugin: Registered | None = None) -> Any:
        return await self.call(driver, "NodeUnprepareResources", list(claims), plugin)

    async def watch_health(self, driver: str) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        """The health stream of the newest plugin of ``driver``, as the kubelet reads it; raises
        NoHealthStream (at the first read) when that plugin did not list the health service."""
        plugin = self.newest(driver)
        if not plugin.health:
            raise NoHealthStream(f"{plugin.info.name} at {plugin.info.endpoint} does not list "
                                 f"{HEALTH} in {list(plugin.info.supported_versions)}")
        async with grpc.aio.insecure_channel(f"unix://{plugin.info.endpoint}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_pb.NodeWatchResourcesRequest())
            async for response in stream:
                yield response
