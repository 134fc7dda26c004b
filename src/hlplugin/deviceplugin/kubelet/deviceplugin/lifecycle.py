"""The generic device-plugin lifecycle, shared by both daemons: serve, register, watch, restart.

One ``PluginLifecycle`` drives one resource-specific servicer (interfaces.py). It keeps
the kubelet's rules (see docs/kubelet.md):

- Register is synchronous and the kubelet dials us inside it, so we serve before registering.
- The kubelet deletes every socket when it restarts and then creates kubelet.sock anew: when our
  socket disappears or kubelet.sock is replaced, the old server instance is stopped (ending its
  ListAndWatch streams, which the kubelet tracks per resource) before a fresh one registers.
- A failed registration stops that server and removes its socket; the retry starts a fresh one
  after a capped backoff that a new kubelet.sock cuts short. Waiting for a missing plugin dir or
  kubelet.sock counts as a failed attempt per backoff step, so every cause shows the same way.
- The kubelet may end its ListAndWatch stream and stay up (its endpoint stops): a registered
  instance with no stream for ``stream_grace`` seconds is stopped and a fresh one registers.
- A kubelet that exits ends the stream too, but leaves its kubelet.sock dead until a new kubelet
  replaces it: from the stream's end we wait for that new socket (up to ``kubelet_wait`` s,
  uncounted) rather than dial the dead one; only a kubelet.sock that still listens after the grace
  means the kubelet stayed up.
- One instance per socket (see endpoint.py): a socket another live process answers on is never
  taken (the kubelet keeps the latest registration, so the two would take turns for ever); we
  wait as a standby (role.py: Ready once our own checks pass, serving nothing, writing nothing
  shared) naming it, and take over as soon as it goes away. A stale file is taken at once.
- The hand-over, on SIGTERM: the kubelet keeps one client per resource name and, when a client's
  stream ends, disconnects whichever client holds the name then (handler.go runClient), so a
  standby's registration survives only if it comes after the kubelet saw the old stream end.
  The old instance therefore ends its streams first, removes its socket and only then stops
  its server; the standby takes the socket at once and gives the kubelet a moment to see the
  old stream's end before it registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hlplugin.deviceplugin.health.conditions import until_tick
from hlplugin.deviceplugin.health.watch import DirWatcher, Wakeup
from hlplugin.deviceplugin.kubelet.deviceplugin import standing
from hlplugin.deviceplugin.kubelet.deviceplugin.instances import HANDOVER_SETTLE, Instances
from hlplugin.deviceplugin.kubelet.deviceplugin.instances import Instance as _Instance
from hlplugin.deviceplugin.kubelet.deviceplugin.interfaces import ServicerFactory
from hlplugin.deviceplugin.kubelet.deviceplugin.kubeletsock import (
    DIR_SETTING,
    dir_problem,
    kubelet_problem,
    listens,
)
from hlplugin.deviceplugin.kubelet.deviceplugin.registration import (
    Outcome,
    RegistrationFailed,
    explain,
    register_with,
)
from hlplugin.deviceplugin.kubelet.endpoint import Held, Holder, Identity, wait_until_free
from hlplugin.deviceplugin.kubelet.endpoint import socket_identity as _socket_identity
from hlplugin.deviceplugin.kubelet.grpcserver import SelfCall, server_answers
from hlplugin.deviceplugin.kubelet.role import Role
from hlplugin.deviceplugin.metrics import DevicePluginMetrics, RegistrationResult
from hlplugin.deviceplugin.metrics import ReregistrationReason as Reason
from hlplugin.deviceplugin.settings import KubeletSettings

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"

# A taken-over registration whose stream the kubelet ends this soon was disconnected by the old
# instance's stream ending after our Register (the kubelet was slower than the settle): register
# anew after TAKEOVER_GRACE, not after the stream grace, so the node's gap stays short.
TAKEOVER_WINDOW = 1.0
TAKEOVER_GRACE = 0.1


class PluginLifecycle:
    def __init__(self, settings: KubeletSettings, socket_name: str, resource_name: str,
                 make_servicer: ServicerFactory, *, metrics: DevicePluginMetrics | None = None,
                 dir_setting: str = DIR_SETTING, role: Role | None = None, guard: bool = False) -> None:
        """``dir_setting``: how the operator names ``settings.plugin_dir`` (a flag), for the hints;
        ``role``: shared with what must not act while we stand by (see role.py); ``guard``: our
        servers behind a frame guard (endpoint.py)."""
        plugin_dir = settings.plugin_dir
        self.settings = settings
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / socket_name
        self.kubelet_path = plugin_dir / KUBELET_SOCKET
        self.resource_name = resource_name
        self._make_servicer = make_servicer
        self._register_timeout = settings.register_timeout
        self._min_backoff = settings.min_backoff
        self._max_backoff = settings.max_backoff
        self._recheck = recheck_interval = settings.recheck_interval
        self._live_recheck = max(settings.live_recheck_interval, recheck_interval)
        self._stream_grace = settings.stream_grace
        self._kubelet_wait = settings.kubelet_wait
        self._metrics = metrics
        self._dir_setting = dir_setting
        self._wakeup = Wakeup(DirWatcher(plugin_dir, {socket_name, KUBELET_SOCKET},
                                         poll_interval=recheck_interval))
        self._servers = Instances(self.socket_path, make_servicer, self._wakeup, guard=guard)
        self._kubelet_identity: Identity | None = None
        # The kubelet.sock of a kubelet that ended our stream, not to be dialled before a new one
        # appears or, without one, before ``_quiet_until`` (loop time): a kubelet restarting.
        self._dead_kubelet: Identity | None = None
        self._quiet_until = 0.0
        self._problem = ""  # the kind of lasting failure last logged, so a retry loop logs it once
        self._failures = 0
        self._holder = ""  # the other instance logged as serving our socket since we registered
        self.registered = False
        self.problem = ""  # why the latest attempt could not register, for /readyz
        self.role = role or Role()
        # Between standing by and registering, and while handing over on the way out: what
        # readiness says instead of "not registered", so neither step fails a probe (an
        # operator would see a warning event for a rollout that went right).
        self.transition = ""
        self._self_call = SelfCall(standing.options_call)

    @property
    def status(self) -> str:
        """One line for /readyz: "" when registered, else why not (the latest failure)."""
        if self.registered:
            return ""
        return self.problem or "not registered with the kubelet"

    @property
    def _instance(self) -> _Instance | None:
        return self._servers.current

    @property
    def open_streams(self) -> int:
        return self._instance.servicer.open_streams if self._instance else 0

    async def run(self) -> None:
        """Serve and stay registered until cancelled; then stop serving and remove our socket."""
        backoff = self._min_backoff
        async with self._wakeup.running(), contextlib.aclosing(self._self_call):
            while True:
                prepared: _Instance | None = None
                try:
                    if self._servers.held():  # a standby serves on its private name:
                        prepared = await self._servers.prepare(self._dir_problem)  # taking over is a link
                    try:
                        await self._wait_until_free()
                    except asyncio.CancelledError:
                        if prepared is not None:
                            await self._stop(prepared)
                        raise
                    instance = await self._servers.start(prepared, self._dir_problem)
                    log.debug("serving %s on %s", self.resource_name, self.socket_path)
                except Held as held:
                    self.role.stand_by(held.holder.describe())
                    continue  # another instance published first: wait for it (start() stopped ours)
                except (OSError, RuntimeError) as exc:
                    if prepared is not None:
                        await self._stop(prepared)  # unless start() did
                    problem = self._dir_problem()
                    self._fail("serve" if not problem else "plugin dir",
                               problem or f"cannot serve on {self.socket_path}: {exc}")
                    await self._sleep_or_kubelet(backoff, _socket_identity(self.kubelet_path))
                    backoff = min(backoff * 2, self._max_backoff)
                    continue
                try:
                    took_over = self.role.standby
                    if took_over:
                        self.transition = "taking over the socket from the other instance"
                        settled = asyncio.get_running_loop().time() + HANDOVER_SETTLE
                    await self.role.activate()
                    if took_over and (left := settled - asyncio.get_running_loop().time()) > 0:
                        await asyncio.sleep(left)  # the kubelet's read of the old stream's end
                    outcome = await self._register_when_possible(instance)
                    if outcome != Outcome.REGISTERED:
                        self._settled()
                    if outcome == Outcome.REGISTERED:
                        backoff = self._min_backoff
                        if await self._wait_until_lost(instance, took_over) == Outcome.LOST:
                            log.info("kubelet restarted or our socket was removed; registering anew")
                    elif outcome == Outcome.FAILED:
                        await self._stop(instance)
                        await self._sleep_or_kubelet(backoff, _socket_identity(self.kubelet_path))
                        backoff = min(backoff * 2, self._max_backoff)
                except asyncio.CancelledError:
                    await self._hand_over(instance)
                    raise
                finally:
                    await self._stop(instance)

    def conditions(self) -> dict[str, tuple[bool, str]]:  # /readyz's (see standing.py)
        return standing.conditions(self)

    async def alive(self, timeout: float = 1.0) -> bool:
        """Liveness: our server answers over the kept channel, else a second opinion knowing the
        gaps between instances and a just replaced socket (server_answers)."""
        if await self._self_call.ask(self.socket_path, timeout) is None:
            return True
        if self._instance is None or not self._instance.live:
            return True  # between instances: nothing to ask, and the event loop answered us
        return await server_answers(
            self._self_call, self.socket_path,
            lambda: self._instance is not None and self._instance.endpoint.ours(), timeout)

    # -- steps ---------------------------------------------------------------------------------

    async def _stop(self, instance: _Instance) -> None:
        if instance.live or self._servers.current is instance:
            self.registered = False
        await self._servers.stop(instance)

    def _settled(self) -> None:
        if not self.transition.startswith("stopping"):
            self.transition = ""

    async def _hand_over(self, instance: _Instance) -> None:
        """On the way out (Instances.hand_over): readiness holds meanwhile, naming the step."""
        if not instance.live:
            return
        self.transition = "stopping: handing the socket over"
        self.registered = False
        await self._servers.hand_over(instance)

    async def _wait_until_free(self) -> None:
        """While another live instance serves our socket, leave it: stand by, naming it (logged
        once per instance), until it goes away."""
        took_over = False

        def held(holder: Holder) -> None:
            nonlocal took_over
            self.problem = (f"{self.socket_path} is served by another instance, "
                            f"{holder.describe()}; waiting for it to go away")
            self.role.stand_by(holder.describe())
            if holder.describe() != self._holder:
                log.warning("%s (this one stands by until then)", self.problem)
                self._holder, took_over = holder.describe(), True

        await wait_until_free(self.socket_path, lambda: self._wait(self._wakeup.pulse()), held)
        if took_over:
            log.info("the other instance serving %s went away; taking over", self.socket_path)

    async def _register_when_possible(self, instance: _Instance) -> Outcome:
        """Wait for a kubelet, then register; "lost" when our socket vanished meanwhile. Each
        backoff step spent without kubelet.sock counts as a failed attempt, after a first wait of
        one recheck interval: a restarting kubelet deletes our socket before it serves anew."""
        wait: float | None = self._recheck
        backoff = self._min_backoff
        while True:
            if not instance.endpoint.ours():
                return Outcome.LOST
            kubelet = _socket_identity(self.kubelet_path)
            quiet = self._quiet_until - asyncio.get_running_loop().time()
            dead = kubelet == self._dead_kubelet and not listens(self.kubelet_path)
            if kubelet is not None and (not dead or quiet <= 0):
                break
            if quiet > 0:  # a restarting kubelet: its new socket is due, nothing has failed
                self.problem = "waiting for the kubelet to restart (it ended our ListAndWatch stream)"
                await self._sleep_or_kubelet(quiet, kubelet)
                continue
            if wait is None:
                self._fail("no kubelet.sock", self._kubelet_problem())
            await self._sleep_or_kubelet(backoff if wait is None else wait, kubelet)
            if wait is None:
                backoff = min(backoff * 2, self._max_backoff)
            wait = None
        register = asyncio.create_task(register_with(
            self.kubelet_path, self.socket_path.name, self.resource_name, self._register_timeout),
            name="register")
        try:
            while not register.done():
                pulse = self._wakeup.pulse()
                if not instance.endpoint.ours() or _socket_identity(self.kubelet_path) != kubelet:
                    log.info("socket changed while registering; starting a fresh server")
                    return Outcome.LOST
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
                       f"kubelet failed: {explain(error, self._register_timeout, self.kubelet_path)}")
            return Outcome.FAILED
        self._count(RegistrationResult.SUCCESS)
        self.registered = True
        self._kubelet_identity, self._dead_kubelet, self._quiet_until = kubelet, None, 0.0
        after = f" after {self._failures} failed attempts" if self._failures else ""
        self._problem, self._failures, self.problem, self._holder = "", 0, "", ""
        log.info("registered %s with the kubelet%s", self.resource_name, after)
        return Outcome.REGISTERED

    async def _wait_until_lost(self, instance: _Instance, took_over: bool = False) -> Outcome:
        try:
            return await self._watch_registered(instance, took_over)
        finally:
            self._settled()

    async def _watch_registered(self, instance: _Instance, took_over: bool) -> Outcome:
        """"lost" when our socket or kubelet.sock changed; "stream_ended" when the kubelet has had
        no ListAndWatch stream open for the grace period and still listens (it opens one right
        after Register, and ends it when its endpoint fails while it stays up), which only a new
        registration mends; "kubelet_gone" when it stopped listening and no new kubelet.sock came
        within ``kubelet_wait`` of the stream's end."""
        loop = asyncio.get_running_loop()
        registered_at = loop.time()
        idle_since: float | None = registered_at
        streamed = False
        grace = self._stream_grace
        while True:
            pulse = self._wakeup.pulse()
            if not instance.endpoint.ours():
                return Outcome.LOST
            if _socket_identity(self.kubelet_path) != self._kubelet_identity:
                return Outcome.LOST
            limit: float | None = None
            if instance.servicer.open_streams:
                self._settled()  # a take-over is done once the kubelet streams
                idle_since, streamed = None, True
                self._dead_kubelet, self._quiet_until = None, 0.0
            else:
                if idle_since is None:
                    idle_since = loop.time()
                    log.info("the kubelet ended its ListAndWatch stream of %s; waiting for a new "
                             "stream or a new kubelet.sock", self.resource_name)
                    self._dead_kubelet = self._kubelet_identity
                    self._quiet_until = idle_since + self._kubelet_wait
                    if took_over and idle_since - registered_at < TAKEOVER_WINDOW:
                        grace = min(grace, TAKEOVER_GRACE)
                        log.warning("the kubelet ended our stream of %s %.0f ms after the "
                                    "take-over: the old instance's stream ended after our "
                                    "Register (the kubelet keeps one client per resource)",
                                    self.resource_name, (idle_since - registered_at) * 1000)
                limit = idle_since + grace - loop.time()
                if limit <= 0 and streamed and not listens(self.kubelet_path):
                    limit = self._quiet_until - loop.time()  # the kubelet exited: await the next
                    if limit <= 0:
                        return Outcome.KUBELET_GONE  # the dead socket's failures now count, as any
                elif limit <= 0:
                    self._dead_kubelet, self._quiet_until = None, 0.0
                    what = ("ended its ListAndWatch stream of %s and opened none for %.1f s"
                            if streamed else
                            "opened no ListAndWatch stream of %s within %.1f s of Register")
                    log.warning(f"the kubelet {what}; registering anew", self.resource_name,
                                grace, extra={"reason": Reason.STREAM_ENDED})
                    if self._metrics is not None:
                        self._metrics.reregistrations.labels(reason=Reason.STREAM_ENDED).inc()
                    return Outcome.STREAM_ENDED
            await self._wait(pulse, limit)

    async def _sleep_or_kubelet(self, delay: float, before: Identity | None) -> None:
        """Back off, but retry at once when kubelet.sock is other than ``before``, the one the
        caller decided on (one that came since then too: read here, it kept a restarted kubelet's
        plugin waiting its whole kubelet_wait in CI, 30 s)."""
        deadline = asyncio.get_running_loop().time() + delay
        while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
            pulse = self._wakeup.pulse()
            now = _socket_identity(self.kubelet_path)
            if now is not None and now != before:
                return
            await self._wait(pulse, remaining)

    # -- helpers -------------------------------------------------------------------------------

    async def _wait(self, pulse: asyncio.Event, limit: float | None = None) -> None:
        """Wait for a plugin-dir event, or at most the recheck interval: cheap stats then cover
        any missed event (with inotify live, only a mount over the directory: every
        ``live_recheck_interval``). Take the pulse before looking at the sockets, never after."""
        recheck = self._live_recheck if self._wakeup.live() else self._recheck
        # On the interval's ticks, so the daemon's periodic work shares one wake-up.
        recheck = until_tick(recheck, asyncio.get_running_loop().time())
        await self._wakeup.wait(pulse, recheck if limit is None else min(limit, recheck))

    def _dir_problem(self) -> str:
        return dir_problem(self.plugin_dir, self._dir_setting)

    def _kubelet_problem(self) -> str:
        return kubelet_problem(self.kubelet_path, self._dir_setting)

    def _fail(self, kind: str, problem: str) -> None:
        """An attempt that could not register: counted, and shown by /readyz."""
        self._count(RegistrationResult.FAILURE)
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

    def _count(self, result: RegistrationResult) -> None:
        if self._metrics is not None:
            self._metrics.daemon.registrations.labels(result=result).inc()
