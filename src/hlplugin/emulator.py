"""A kubelet device-manager emulator and a daemon-process driver, for the tests and `hlplugin demo`.

It reproduces what a device plugin can observe of the kubelet (see
../shared/notes/kubelet-device-manager.md): it deletes every socket in the plugin directory when it
starts, validates Register, dials the plugin's endpoint inside Register and calls
GetDevicePluginOptions, keeps one ListAndWatch stream per resource, counts only Healthy devices as
allocatable, marks a resource's devices unhealthy when any of its streams ends, and fails pod
admission when Allocate returns an error.

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
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.lifecycle import KUBELET_SOCKET, Context
from hlplugin.deviceplugin.watch import wait_event

log = logging.getLogger(__name__)

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_RESOURCE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class AdmissionError(Exception):
    """The pod would fail admission (the kubelet's UnexpectedAdmissionError)."""

    def __init__(self, resource: str, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"UnexpectedAdmissionError: allocate failed for {resource}: "
                         f"{code.name if code else 'no devices'}: {details}")
        self.code = code
        self.details = details


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
    def __init__(self, plugin_dir: Path, *, mode: str = "normal", dial_timeout: float = 10.0) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / KUBELET_SOCKET
        self.mode = mode
        self.dial_timeout = dial_timeout
        self.resources: dict[str, Resource] = {}
        self.register_calls = 0
        self.rejections: list[str] = []
        self._streams: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self._raw: socket.socket | None = None
        self._raw_task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    # -- process lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Like the kubelet at start: delete every socket in the directory, then serve."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(self.plugin_dir):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
        if self.mode == "reset":
            self._raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._raw.bind(str(self.socket_path))
            self._raw.listen(64)
            self._raw.setblocking(False)
            self._raw_task = asyncio.create_task(self._reset_connections())
            return
        self._server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        await self._server.start()

    async def stop(self, *, remove_socket: bool = False) -> None:
        """Stop serving; like a crash, the socket stays unless ``remove_socket``."""
        self.resources.clear()
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        if self._raw_task is not None:
            self._raw_task.cancel()
            self._raw_task = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._notify()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def end_stream(self, name: str) -> None:
        """Cancel ``name``'s ListAndWatch call and stay up: like the kubelet, the resource's devices
        turn unhealthy and its endpoint stops until the plugin registers again."""
        resource = self.resources.get(name)
        if resource is None or resource.stream is None:
            raise KeyError(f"{name} has no ListAndWatch stream")
        resource.stream.cancel()
        await asyncio.wait({resource.stream})

    async def _reset_connections(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._raw is not None
        while True:
            conn, _ = await loop.sock_accept(self._raw)
            conn.close()

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
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        try:
            stub = pb_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(
                pb.Empty(), timeout=self.dial_timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            await channel.close(None)
            problem = f"failed to dial device plugin: {exc.code().name}: {exc.details()}"
            self.rejections.append(problem)
            await context.abort(grpc.StatusCode.UNKNOWN, problem)
        # Like the kubelet, a new registration replaces the endpoint but does not close the old
        # endpoint's stream: only the plugin ends it, and when it does, see _list_and_watch.
        old = self.resources.get(request.resource_name)
        resource = Resource(request.endpoint, options, channel, registered_at=time.monotonic())
        if old is not None:
            resource.allocated = old.allocated
        self.resources[request.resource_name] = resource
        resource.stream = asyncio.create_task(self._list_and_watch(request.resource_name, resource))
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
                self._notify()
        except grpc.aio.AioRpcError as exc:
            log.debug("ListAndWatch of %s ended: %s", name, exc.code().name)
        finally:
            # Keyed on the resource name, as in the kubelet: any ending stream of this resource,
            # even an old endpoint's, marks the current devices unhealthy and stops the endpoint
            # until the plugin registers again.
            current = self.resources.get(name)
            if current is not None:
                current.devices = dict.fromkeys(current.devices, "Unhealthy")
                current.stopped = True
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

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def admit(self, name: str, containers: int = 1, per_container: int = 1,
                    timeout: float = 10.0) -> pb.AllocateResponse:
        """Admit a pod: pick healthy free devices and call Allocate once per container."""
        resource = self.resources.get(name)
        if resource is None:
            raise AdmissionError(name, None, "resource not registered")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def with_parent_death(argv: list[str]) -> list[str]:
    """Wrap ``argv`` so the child is SIGKILLed when its parent dies: a killed demo or test run
    never leaves daemons behind. setpriv (util-linux) sets it and execs, so no Python runs in the
    forked child (a preexec_fn can deadlock in a process with gRPC's threads)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else argv


class DaemonProcess:
    """One real `hlplugin` process on a free loopback port, its JSON log lines kept in memory."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 name: str = "") -> None:
        self.name = name or f"hlplugin {args[0]}"
        self.port = free_port()
        self.args = [sys.executable, "-m", "hlplugin", *args,
                     "--http-address", f"127.0.0.1:{self.port}", "--log-format", "json"]
        self.env = dict(os.environ if env is None else env)
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> DaemonProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *with_parent_death(self.args), env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            text = line.decode(errors="replace").rstrip()
            self.raw.append(text)
            with contextlib.suppress(ValueError):
                entry = json.loads(text)
                if isinstance(entry, dict):
                    self.lines.append(entry)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def exited(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def messages(self) -> list[str]:
        return [str(line.get("message", "")) for line in self.lines]

    async def signal(self, signum: int = signal.SIGTERM, timeout: float = 10.0,
                     *, kill_on_timeout: bool = True) -> int:
        """Send ``signum`` and wait for the exit code. A daemon that does not stop in time is asked
        where it hangs (SIGUSR1 logs every task, SIGABRT makes faulthandler print every thread),
        then killed, or, with ``kill_on_timeout`` false, TimeoutError is raised after that."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            self.proc.send_signal(signum)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
            if self.proc.returncode is None:
                self.proc.kill()
            code = await self.proc.wait()
            print("\n".join(self.raw[-80:]), file=sys.stderr)
            if not kill_on_timeout:
                raise
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader, 2)
        return code

    async def stop(self) -> int:
        """SIGTERM, as the kubelet sends at pod deletion."""
        return await self.signal(signal.SIGTERM)

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` on the daemon's HTTP port: (status, body), or (0, b"") when unreachable."""

        def fetch() -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                    return int(r.status), bytes(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except OSError:
                return 0, b""

        return await asyncio.to_thread(fetch)

    async def wait_http(self, path: str, status: int, timeout: float = 15.0) -> bytes:
        """The body of ``path`` once it answers ``status``; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            code, body = await self.get(path)
            if code == status:
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} answered {code} {body!r}, wanted {status}")
            await asyncio.sleep(0.05)
