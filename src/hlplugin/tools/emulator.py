"""A kubelet device-manager emulator, for the tests, the benchmarks and `hlplugin demo`.

It reproduces what a device plugin can observe of the kubelet, by the rules in docs/kubelet.md
(tests/test_emulator.py checks its restart and reboot against them): it deletes every socket in
the plugin directory when it starts, validates Register, dials the plugin's endpoint inside
Register and calls GetDevicePluginOptions, keeps one client per resource name (a registration
replaces it without ending the old client's stream), counts only Healthy devices as allocatable,
and fails pod admission when no device of a requested resource is healthy or Allocate returns an
error. When a client's ListAndWatch ends, the kubelet (handler.go runClient) disconnects whichever
client holds that name *then*: the resource turns unhealthy, and a newer client that registered
before the old stream ended loses its stream too. ``events`` records when each stream ended and
when each list arrived, so a test can measure a hand-over's gap as the kubelet sees it.

``restart`` is a real kubelet's restart: streams end as it exits, its kubelet.sock stays dead
while it is down, and the new kubelet deletes every socket before it serves. ``reboot`` is a node
reboot: the kubelet comes up and re-admits the node's pods at once, before any plugin (whose pods
are not running yet) can register, so a pod that requests a plugin's resource fails.

``mode`` fakes a broken kubelet: "hang" accepts Register and never answers; "reset" accepts
connections and closes them at once. ``end_stream`` ends a resource's ListAndWatch while the
kubelet stays up, as the kubelet does when that stream or its endpoint fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.health.watch import wait_event
from hlplugin.deviceplugin.kubelet.context import Context
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import KUBELET_SOCKET
from hlplugin.tools.kubelet_events import Event, forward, handover_gaps

log = logging.getLogger(__name__)

# The kubelet's gRPC client takes messages up to 4 MiB (gRPC's default): a larger ListAndWatch
# answer fails its stream, and the node's capacity drops to 0.
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024
CHECKPOINT = "kubelet_internal_checkpoint"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_RESOURCE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class AdmissionError(Exception):
    """The pod would fail admission (the kubelet's UnexpectedAdmissionError): it stays Failed
    until a controller replaces it."""

    def __init__(self, resource: str, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"UnexpectedAdmissionError: allocate failed for {resource}: "
                         f"{code.name if code else 'no devices'}: {details}")
        self.code = code
        self.details = details


def no_healthy_devices(resource: str) -> str:
    """The kubelet's words when a pod requests a resource with no healthy device."""
    return (f"Allocate failed due to no healthy devices present; cannot allocate unhealthy "
            f"devices {resource}, which is unexpected")


@dataclass(frozen=True)
class Pod:
    """A pod bound to the node, as far as the device manager cares: its one container's requests."""

    name: str
    requests: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Resource:
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.aio.Channel
    devices: dict[str, str] = field(default_factory=dict)
    allocated: set[str] = field(default_factory=set)
    stream: asyncio.Task[None] | None = None
    registered_at: float = 0.0
    lists_received: int = 0
    stopped: bool = False


class KubeletEmulator(pb_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: Path, *, mode: str = "normal", dial_timeout: float = 10.0,
                 stream_end_delay: float = 0.0) -> None:
        """``stream_end_delay``: a busy kubelet, that many seconds late to act on a stream's end
        (runClient runs once the stream's goroutine gets a CPU)."""
        self.plugin_dir = plugin_dir
        self.stream_end_delay = stream_end_delay
        self.socket_path = plugin_dir / KUBELET_SOCKET
        self.mode = mode
        self.dial_timeout = dial_timeout
        self.resources: dict[str, Resource] = {}
        # The client registered under each name (handler.go's clients map): a stream's end
        # disconnects the one held here at that moment, whichever it is.
        self.clients: dict[str, Resource] = {}
        self.events: list[Event] = []
        self.register_calls = 0
        self.rejections: list[str] = []
        self._streams: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self._raw: socket.socket | None = None
        self._raw_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._private: Path | None = None
        self._changed = asyncio.Event()

    # -- process lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Like the kubelet at start: delete every socket in the directory, then serve.

        kubelet.sock is a plain listening socket of ours that passes each connection on to the
        gRPC server's private socket: gRPC deletes its socket file when it stops, a crashed
        kubelet leaves kubelet.sock behind, dead."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(self.plugin_dir):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
        if self.mode != "reset":
            self._private = Path(tempfile.mkdtemp(prefix="hlk-", dir="/tmp"))
            self._server = grpc.aio.server()
            pb_grpc.add_RegistrationServicer_to_server(self, self._server)
            self._server.add_insecure_port(f"unix://{self._private / KUBELET_SOCKET}")
            await self._server.start()
        self._raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._raw.bind(str(self.socket_path))
        self._raw.listen(64)
        self._raw.setblocking(False)
        self._raw_task = asyncio.create_task(self._accept())

    async def stop(self, *, remove_socket: bool = False) -> None:
        """Exit: every ListAndWatch stream ends, then nothing listens on kubelet.sock, which stays
        on disk (dead) unless ``remove_socket``."""
        self.resources.clear()
        self.clients.clear()
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        if self._raw_task is not None:
            # The cancelled accept removes its reader from the event loop only when it runs: close
            # the socket before that and a socket opened next under the same fd number (gRPC's
            # wake-up socket, say) inherits the stale registration and never sees an event.
            self._raw_task.cancel()
            await asyncio.wait({self._raw_task})
            self._raw_task = None
        if self._raw is not None:
            self._raw.close()  # closing a socket leaves its file
            self._raw = None
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._notify()

    async def restart(self, down: float = 0.3) -> None:
        """A kubelet restart: it exits (streams end, kubelet.sock stays, dead), is down for
        ``down`` seconds (a real one answered 0.3 s after its process started), then starts."""
        await self.stop()
        await asyncio.sleep(down)  # a span of the emulated world's time, not a wait for an event
        await self.start()

    async def reboot(self, pods: Sequence[Pod]) -> dict[str, AdmissionError | None]:
        """A node reboot once the kubelet is up again: no container survived (the caller has
        stopped them), the kubelet starts and re-admits ``pods`` at once, before any plugin can
        register. Each pod's outcome: None when admitted, else why it failed (and stays Failed)."""
        await self.stop()
        await self.start()
        outcomes: dict[str, AdmissionError | None] = {}
        for pod in pods:
            try:
                await self.admit_pod(pod)
                outcomes[pod.name] = None
            except AdmissionError as exc:
                outcomes[pod.name] = exc
        return outcomes

    async def end_stream(self, name: str) -> None:
        """Cancel ``name``'s ListAndWatch call and stay up: like the kubelet, the resource's devices
        turn unhealthy and its endpoint stops until the plugin registers again."""
        resource = self.resources.get(name)
        if resource is None or resource.stream is None:
            raise KeyError(f"{name} has no ListAndWatch stream")
        resource.stream.cancel()
        await asyncio.wait({resource.stream})

    async def _accept(self) -> None:
        """Pass each connection to kubelet.sock on to the gRPC server; "reset" mode closes it."""
        loop = asyncio.get_running_loop()
        assert self._raw is not None
        while True:
            conn, _ = await loop.sock_accept(self._raw)
            if self._private is None:
                conn.close()
                continue
            task = asyncio.create_task(forward(conn, self._private / KUBELET_SOCKET))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    # -- Registration service -------------------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest,
                       context: Context) -> pb.Empty:
        self.register_calls += 1
        if self.mode == "hang":
            await asyncio.Event().wait()
        problem = self._validate(request)
        if problem:
            self.rejections.append(problem)
            # The kubelet returns a plain error, which reaches the plugin as UNKNOWN.
            await context.abort(grpc.StatusCode.UNKNOWN, problem)
        # A connection of its own, as the kubelet's dial makes (grpc-go shares none between its
        # clients): grpc core would otherwise hand this channel the previous registration's
        # connection to the same path, still open to the old instance while it stops.
        channel = grpc.aio.insecure_channel(
            f"unix://{self.plugin_dir / request.endpoint}",
            options=[("grpc.max_receive_message_length", KUBELET_MAX_MESSAGE),
                     ("grpc.use_local_subchannel_pool", 1)])
        try:
            stub = pb_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(
                pb.Empty(), timeout=self.dial_timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            await channel.close(None)
            problem = f"failed to dial device plugin: {exc.code().name}: {exc.details()}"
            self.rejections.append(problem)
            await context.abort(grpc.StatusCode.UNKNOWN, problem)
        # Like the kubelet, a new registration replaces the client but does not close the old
        # client's stream: only the plugin ends it, and when it does, see _list_and_watch.
        old = self.resources.get(request.resource_name)
        resource = Resource(request.endpoint, options, channel, registered_at=time.monotonic())
        if old is not None:
            resource.allocated = old.allocated
        self.resources[request.resource_name] = resource
        self.clients[request.resource_name] = resource
        self._event("register", request.resource_name, resource)
        resource.stream = asyncio.create_task(self._list_and_watch(request.resource_name, resource),
                                              name=f"ListAndWatch {request.resource_name}")
        self._streams.add(resource.stream)
        resource.stream.add_done_callback(self._streams.discard)
        self._notify()
        return pb.Empty()

    def _validate(self, request: pb.RegisterRequest) -> str:
        if request.version != "v1beta1":
            return f"Unsupported version {request.version!r}"
        name = request.resource_name
        if not _RESOURCE.match(name) or name.split("/")[0].endswith("kubernetes.io"):
            return f"invalid name of device plugin socket: {name!r} is not an extended resource"
        if "/" in request.endpoint or not request.endpoint:
            return f"endpoint {request.endpoint!r} is not a file name in {self.plugin_dir}"
        return ""

    async def _list_and_watch(self, name: str, resource: Resource) -> None:
        stub = pb_grpc.DevicePluginStub(resource.channel)
        try:
            async for response in stub.ListAndWatch(pb.Empty()):
                resource.devices = {d.ID: d.health for d in response.devices}
                resource.lists_received += 1
                self._event("list", name, resource)
                self._checkpoint()
                self._notify()
        except grpc.aio.AioRpcError as exc:
            log.debug("ListAndWatch of %s ended: %s", name, exc.code().name)
        finally:
            # handler.go runClient: once a client's run ends, the client registered under the
            # name at that moment is disconnected, whichever it is: its devices turn unhealthy
            # (PluginDisconnected), its connection closes (so a newer client's stream ends too),
            # and the name has no client until the plugin registers again.
            if self.stream_end_delay:
                await asyncio.sleep(self.stream_end_delay)  # emulated: the kubelet is busy
            self._event("stream_end", name, resource)
            current = self.clients.pop(name, None)
            if current is not None:
                self._event("disconnect", name, current)
                shown = self.resources.get(name)
                if shown is not None:
                    shown.devices = dict.fromkeys(shown.devices, "Unhealthy")
                    shown.stopped = True
                if current is not resource and current.stream is not None:
                    current.stream.cancel()  # its channel closes as its own run ends
            await resource.channel.close(None)
            self._notify()

    # -- what a test or the demo observes ------------------------------------------------------

    def capacity(self, name: str) -> int:
        resource = self.resources.get(name)
        return len(resource.devices) if resource else 0

    def allocatable(self, name: str) -> int:
        resource = self.resources.get(name)
        if resource is None or resource.stopped:
            return 0
        return sum(1 for health in resource.devices.values() if health == "Healthy")

    def settled(self, name: str) -> bool:
        """No stream of ``name`` runs but its current client's: the end of an instance that went
        has been read (read late, it disconnects the newer client, as the kubelet's does)."""
        return sum(task.get_name() == f"ListAndWatch {name}" for task in self._streams) <= 1

    def registered(self, name: str) -> bool:
        resource = self.resources.get(name)
        return resource is not None and not resource.stopped

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; raise TimeoutError naming it otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout}s")
            await wait_event(self._changed, min(remaining, 0.05))

    def _event(self, kind: str, name: str, resource: Resource) -> None:
        self.events.append(Event(time.monotonic(), kind, name, resource.endpoint))

    def handover_gaps(self, name: str) -> list[float]:
        """Each outage of ``name`` as the kubelet saw it (kubelet_events.handover_gaps)."""
        return handover_gaps(self.events, name)

    def _checkpoint(self) -> None:
        """Rewrite the checkpoint as the kubelet does (a temporary file, then a rename): the
        plugin directory is busy with files that are not sockets."""
        data = {name: {"devices": sorted(r.devices), "allocated": sorted(r.allocated)}
                for name, r in self.resources.items()}
        temporary = self.plugin_dir / f".{CHECKPOINT}.tmp"
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(data))
            os.replace(temporary, self.plugin_dir / CHECKPOINT)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def admit_pod(self, pod: Pod, timeout: float = 10.0) -> dict[str, pb.AllocateResponse]:
        """The device manager's part of admitting ``pod``: one Allocate per requested resource."""
        return {name: await self.admit(name, per_container=count, timeout=timeout)
                for name, count in pod.requests.items()}

    async def admit(self, name: str, containers: int = 1, per_container: int = 1,
                    timeout: float = 10.0) -> pb.AllocateResponse:
        """Admit a pod: pick healthy free devices and call Allocate once per container. With no
        healthy device (no plugin registered, or its stream ended) the kubelet fails the pod
        itself, without calling Allocate."""
        if self.allocatable(name) == 0:
            raise AdmissionError(name, None, no_healthy_devices(name))
        resource = self.resources[name]
        free = [i for i, h in resource.devices.items() if h == "Healthy" and i not in resource.allocated]
        if len(free) < containers * per_container:
            raise AdmissionError(name, None, f"requested {containers * per_container}, "
                                 f"available {len(free)}")
        merged = pb.AllocateResponse()
        for c in range(containers):
            ids = free[c * per_container:(c + 1) * per_container]
            response = await self.allocate(name, [ids], timeout=timeout)
            resource.allocated.update(ids)
            merged.container_responses.extend(response.container_responses)
        self._checkpoint()
        return merged

    async def allocate(self, name: str, containers: list[list[str]],
                       timeout: float = 10.0) -> pb.AllocateResponse:
        """One raw Allocate call with the given device IDs per container."""
        resource = self.resources.get(name)
        if resource is None or resource.stopped:
            raise AdmissionError(name, None, "resource not registered or its endpoint stopped")
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        try:
            response: pb.AllocateResponse = await pb_grpc.DevicePluginStub(resource.channel).Allocate(
                request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(name, exc.code(), exc.details() or "") from None
        return response
