"""The generic device-plugin lifecycle, shared by both daemons: serve, register, watch, restart.

One ``PluginLifecycle`` drives one resource-specific servicer (see ``PluginServicer``). It keeps
the kubelet's rules (see ../shared/notes/kubelet-device-manager.md):

- Register is synchronous and the kubelet dials us inside it, so we serve before registering.
- The kubelet deletes every socket when it restarts and then creates kubelet.sock anew: when our
  socket disappears or kubelet.sock is replaced, the old server instance is stopped (ending its
  ListAndWatch streams, which the kubelet tracks per resource) before a fresh one registers.
- A failed registration stops that server and removes its socket; the retry starts a fresh one
  after a capped backoff that a new kubelet.sock cuts short. Waiting for a missing plugin dir or
  kubelet.sock counts as a failed attempt per backoff step, so every cause shows the same way.
- The kubelet may end its ListAndWatch stream and stay up (its endpoint stops): a registered
  instance with no stream for ``stream_grace`` seconds is stopped and a fresh one registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc
from hlplugin.deviceplugin.devicelist import add_servicer
from hlplugin.deviceplugin.metrics import DevicePluginMetrics
from hlplugin.deviceplugin.producer import Wakeup
from hlplugin.deviceplugin.watch import DirWatcher

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"


Context = grpc.aio.ServicerContext[Any, Any]


class RegistrationFailed(Exception):
    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class PluginServicer(pb_grpc.DevicePluginServicer):
    """What a resource-specific server adds to the generated servicer: a way to end its streams,
    a stream count with a hook called when it changes, and the largest request it accepts."""

    open_streams: int
    max_request_bytes: int = 4 * 1024 * 1024
    on_streams_changed: Callable[[], None] | None = None

    def close_streams(self) -> None:
        raise NotImplementedError


class ServicerFactory(Protocol):
    def __call__(self) -> PluginServicer: ...


Identity = tuple[int, int, int]


def _socket_identity(path: Path) -> Identity | None:
    """(device, inode, ctime) of a unix socket at ``path``; None when missing or not a socket.
    The ctime tells a new socket from an old one whose inode number the filesystem reused."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


async def _to_completion(work: Coroutine[Any, Any, None]) -> None:
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
    add_servicer(servicer, server)
    return server


@dataclass
class _Instance:
    server: grpc.aio.Server
    servicer: PluginServicer
    identity: Identity | None


class PluginLifecycle:
    def __init__(
        self,
        plugin_dir: Path,
        socket_name: str,
        resource_name: str,
        make_servicer: ServicerFactory,
        *,
        register_timeout: float = 5.0,
        min_backoff: float = 0.1,
        max_backoff: float = 5.0,
        recheck_interval: float = 1.0,
        live_recheck_interval: float = 10.0,
        stream_grace: float = 3.0,
        metrics: DevicePluginMetrics | None = None,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / socket_name
        self.kubelet_path = plugin_dir / KUBELET_SOCKET
        self.resource_name = resource_name
        self._make_servicer = make_servicer
        self._register_timeout = register_timeout
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._recheck = recheck_interval
        self._live_recheck = max(live_recheck_interval, recheck_interval)
        self._stream_grace = stream_grace
        self._metrics = metrics
        self._wakeup = Wakeup(DirWatcher(plugin_dir, {socket_name, KUBELET_SOCKET},
                                         poll_interval=recheck_interval))
        self._instance: _Instance | None = None
        self._kubelet_identity: Identity | None = None
        self._problem = ""  # the kind of lasting failure last logged, so a retry loop logs it once
        self._failures = 0
        self.registered = False
        self.problem = ""  # why the latest attempt could not register, for /readyz

    @property
    def status(self) -> str:
        """One line for /readyz: "" when registered, else why not (the latest failure)."""
        if self.registered:
            return ""
        return self.problem or "not registered with the kubelet"

    @property
    def open_streams(self) -> int:
        return self._instance.servicer.open_streams if self._instance else 0

    async def run(self) -> None:
        """Serve and stay registered until cancelled; then stop serving and remove our socket."""
        backoff = self._min_backoff
        async with self._wakeup.running():
            while True:
                try:
                    instance = await self._start()
                except (OSError, RuntimeError) as exc:
                    problem = self._dir_problem()
                    self._fail("serve" if not problem else "plugin dir",
                               problem or f"cannot serve on {self.socket_path}: {exc}")
                    await self._sleep_or_kubelet(backoff)
                    backoff = min(backoff * 2, self._max_backoff)
                    continue
                try:
                    outcome = await self._register_when_possible(instance)
                    if outcome == "registered":
                        backoff = self._min_backoff
                        if await self._wait_until_lost(instance) == "lost":
                            log.info("kubelet restarted or our socket was removed; registering anew")
                    elif outcome == "failed":
                        await self._stop(instance)
                        await self._sleep_or_kubelet(backoff)
                        backoff = min(backoff * 2, self._max_backoff)
                finally:
                    await self._stop(instance)

    async def alive(self, timeout: float = 1.0) -> bool:
        """Liveness: the current server instance answers a call over its own socket."""
        if self._instance is None or self._instance.identity is None:
            return True  # between instances: nothing to ask, and the event loop answered us
        async with grpc.aio.insecure_channel(f"unix://{self.socket_path}") as channel:
            try:
                await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                    pb.Empty(), timeout=timeout)
            except grpc.aio.AioRpcError:
                # Our socket may have just been replaced; only a server that exists must answer.
                return self._instance is None or not self._socket_is_ours(self._instance)
        return True

    # -- steps ---------------------------------------------------------------------------------

    async def _start(self) -> _Instance:
        problem = self._dir_problem()
        if problem:
            raise RuntimeError(problem)  # before gRPC tries, and logs its own line every retry
        self._remove_stale_socket()
        servicer = self._make_servicer()
        servicer.on_streams_changed = self._wakeup.fire
        server = new_server(servicer)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
        except BaseException:
            await _to_completion(server.stop(None))  # never leave a server to the GC
            raise
        # start() binds the socket in a task of gRPC's own that a cancellation does not stop, so
        # it runs to completion; then, cancelled or not, we know the socket and may remove it.
        failure: BaseException | None = None
        try:
            await _to_completion(server.start())
        except BaseException as exc:
            failure = exc
        instance = _Instance(server, servicer, _socket_identity(self.socket_path))
        self._instance = instance
        if failure is not None:
            await self._stop(instance)
            raise failure
        log.debug("serving %s on %s", self.resource_name, self.socket_path)
        return instance

    async def _stop(self, instance: _Instance) -> None:
        if instance.identity is None and self._instance is not instance:
            return  # already stopped
        self.registered = False
        ours = self._socket_is_ours(instance)
        # From here the instance counts as gone, so liveness does not ask a server that is
        # stopping on purpose.
        instance.identity = None
        instance.servicer.close_streams()
        try:
            await _to_completion(instance.server.stop(grace=0.2))
        finally:
            if ours:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
            if self._instance is instance:
                self._instance = None

    async def _register_when_possible(self, instance: _Instance) -> str:
        """Wait for a kubelet, then register; "lost" when our socket vanished meanwhile. Each
        backoff step spent without kubelet.sock counts as a failed attempt, after a first wait of
        one recheck interval: a restarting kubelet deletes our socket before it serves anew."""
        wait: float | None = self._recheck
        backoff = self._min_backoff
        while True:
            if not self._socket_is_ours(instance):
                return "lost"
            kubelet = _socket_identity(self.kubelet_path)
            if kubelet is not None:
                break
            if wait is None:
                self._fail("no kubelet.sock", self._kubelet_problem())
            await self._sleep_or_kubelet(backoff if wait is None else wait)
            if wait is None:
                backoff = min(backoff * 2, self._max_backoff)
            wait = None
        register = asyncio.create_task(self._register(), name="register")
        try:
            while not register.done():
                pulse = self._wakeup.pulse()
                if not self._socket_is_ours(instance) or _socket_identity(self.kubelet_path) != kubelet:
                    log.info("socket changed while registering; starting a fresh server")
                    return "lost"
                waiter = asyncio.create_task(self._wait(pulse))
                await asyncio.wait({register, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            if not register.done():
                register.cancel()
                # Not "await register" under suppress(CancelledError): that would also swallow
                # a cancellation of this task arriving now, and the daemon could not stop.
                await asyncio.wait({register})
        error = register.exception()
        if error is not None:
            kind = error.code if isinstance(error, RegistrationFailed) else type(error).__name__
            self._fail(f"register {kind}", f"registration of {self.resource_name} with the "
                       f"kubelet failed: {self._explain(error)}")
            return "failed"
        self._count("success")
        self.registered = True
        self._kubelet_identity = kubelet
        after = f" after {self._failures} failed attempts" if self._failures else ""
        self._problem, self._failures, self.problem = "", 0, ""
        log.info("registered %s with the kubelet%s", self.resource_name, after)
        return "registered"

    async def _register(self) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource_name,
            options=pb.DevicePluginOptions(),
        )
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_path}") as channel:
            try:
                await pb_grpc.RegistrationStub(channel).Register(
                    request, timeout=self._register_timeout, wait_for_ready=False)
            except grpc.aio.AioRpcError as exc:
                raise RegistrationFailed(exc.code().name, exc.details() or "") from None

    async def _wait_until_lost(self, instance: _Instance) -> str:
        """"lost" when our socket or kubelet.sock changed; "stream_ended" when the kubelet has had
        no ListAndWatch stream open for the grace period (it opens one right after Register, and
        ends it when its endpoint fails while it stays up), which only a new registration mends."""
        loop = asyncio.get_running_loop()
        idle_since: float | None = loop.time()
        streamed = False
        while True:
            pulse = self._wakeup.pulse()
            if not self._socket_is_ours(instance):
                return "lost"
            if _socket_identity(self.kubelet_path) != self._kubelet_identity:
                return "lost"
            limit: float | None = None
            if instance.servicer.open_streams:
                idle_since, streamed = None, True
            else:
                if idle_since is None:
                    idle_since = loop.time()
                limit = idle_since + self._stream_grace - loop.time()
                if limit <= 0:
                    what = ("ended its ListAndWatch stream of %s and opened none for %.1f s"
                            if streamed else
                            "opened no ListAndWatch stream of %s within %.1f s of Register")
                    log.warning(f"the kubelet {what}; registering anew", self.resource_name,
                                self._stream_grace, extra={"reason": "stream_ended"})
                    if self._metrics is not None:
                        self._metrics.reregistrations.labels(reason="stream_ended").inc()
                    return "stream_ended"
            await self._wait(pulse, limit)

    async def _sleep_or_kubelet(self, delay: float) -> None:
        """Back off, but retry at once when a new kubelet.sock appears."""
        before = _socket_identity(self.kubelet_path)
        deadline = asyncio.get_running_loop().time() + delay
        while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
            pulse = self._wakeup.pulse()
            now = _socket_identity(self.kubelet_path)
            if now is not None and now != before:
                return
            await self._wait(pulse, remaining)

    # -- helpers -------------------------------------------------------------------------------

    def _socket_is_ours(self, instance: _Instance) -> bool:
        return instance.identity is not None and _socket_identity(self.socket_path) == instance.identity

    def _remove_stale_socket(self) -> None:
        """A socket left at our name by a previous run is ours to remove; anything else is not."""
        if _socket_identity(self.socket_path) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        elif os.path.lexists(self.socket_path):
            raise RuntimeError(f"{self.socket_path} exists and is not a socket; refusing to replace it")

    async def _wait(self, pulse: asyncio.Event, limit: float | None = None) -> None:
        """Wait for a plugin-dir event, or at most the recheck interval: cheap stats then cover
        any missed event (with inotify live, only a mount over the directory: every
        ``live_recheck_interval``). Take the pulse before looking at the sockets, never after."""
        recheck = self._live_recheck if self._wakeup.live() else self._recheck
        await self._wakeup.wait(pulse, recheck if limit is None else min(limit, recheck))

    def _dir_problem(self) -> str:
        try:
            st = os.stat(self.plugin_dir)
        except FileNotFoundError:
            return (f"{self.plugin_dir} does not exist (is --plugin-dir the kubelet's "
                    f"device-plugins directory?)")
        except OSError as exc:
            return f"cannot use {self.plugin_dir}: {exc.strerror} (errno {exc.errno})"
        return "" if stat.S_ISDIR(st.st_mode) else f"{self.plugin_dir} is not a directory"

    def _kubelet_problem(self) -> str:
        if os.path.lexists(self.kubelet_path):
            return f"{self.kubelet_path} is not a socket"
        return (self._dir_problem() or f"no kubelet.sock at {self.kubelet_path} (is the kubelet "
                f"running, and is --plugin-dir its device-plugins directory?)")

    def _explain(self, error: BaseException) -> str:
        if not isinstance(error, RegistrationFailed):
            return f"{type(error).__name__}: {error}"
        if error.code == "DEADLINE_EXCEEDED":
            return (f"Register timed out after {self._register_timeout:g} s ({error.code}: the "
                    f"kubelet at {self.kubelet_path} did not answer)")
        if error.code == "UNAVAILABLE":
            return f"the kubelet at {self.kubelet_path} is unreachable ({error})"
        return f"the kubelet refused with {error}"

    def _fail(self, kind: str, problem: str) -> None:
        """An attempt that could not register: counted, and shown by /readyz."""
        self._count("failure")
        self.problem = problem
        self._report(kind, problem)

    def _report(self, kind: str, problem: str) -> None:
        """A failure that repeats while retrying is logged when it starts or changes kind, not
        on every attempt (details such as errno texts vary); the registration that ends it says
        how many attempts failed."""
        self._failures += 1
        if kind != self._problem:
            log.warning("%s (retrying with backoff)", problem)
            self._problem = kind
        else:
            log.debug("%s (attempt %d)", problem, self._failures)

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.registrations.labels(result=result).inc()
