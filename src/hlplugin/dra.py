"""The DRA driver hyperlight.dev (`hlplugin dra`): a third daemon, opt-in, in place of the main
daemon on a node (docs/dra.md). Its kubelet side is a plugin-watcher registration and the DRA
service in both API versions (deviceplugin.kubelet.pluginwatcher, draservice); its proofs are the
main daemon's: the CDI reconciler keeps the node's one hyperlight.json (taken over, never a
second spec declaring the device) and the device monitor checks the device before every Prepare.

Not yet here: the control-plane side (ResourceSlices, reading a claim's allocation): until it
lands a claim is answered with the node's one device (dra_claims.node_device).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable

from hlplugin import cdi_spec
from hlplugin.deviceplugin.checkpoint import Checkpoint
from hlplugin.deviceplugin.kubelet.drahealth import HealthStream
from hlplugin.deviceplugin.kubelet.draservice import SERVICES, answers, new_dra_server
from hlplugin.deviceplugin.kubelet.pluginwatcher import DRA_PLUGIN, WatcherPlugin
from hlplugin.deviceplugin.kubelet.writer import SharedWriter
from hlplugin.deviceplugin.process.daemon import Daemon, Launch, Started
from hlplugin.dra_claims import CHECKPOINT_FILE, CHECKPOINT_KIND, ClaimPreparer, node_device
from hlplugin.metrics import DraMetrics
from hlplugin.names import CDI_WRITER_FILE, DRA_DRIVER, REGISTRY_DIR_FLAG, dra_socket_names
from hlplugin.proofs import Proofs
from hlplugin.settings import DraSettings

log = logging.getLogger(__name__)


def node_name(settings: DraSettings) -> str:
    """The pool every answer names: the node's name, else (run by hand) the host's."""
    if settings.dra.node_name:
        return settings.dra.node_name
    name = socket.gethostname().lower()
    log.warning("HYPERLIGHT_NODE_NAME is empty: naming the device pool %r after the host (set it "
                "from the downward API's spec.nodeName)", name)
    return name


class DraDriver:
    """The driver's parts once the hypervisor is known: built by setup(), run by the Daemon."""

    def __init__(self, settings: DraSettings, hypervisor: str, proofs: Proofs,
                 metrics: DraMetrics) -> None:
        plugin_dir = settings.dra.plugin_dir
        registration, service = dra_socket_names(settings.dra.pod_uid)
        # One CDI spec writer per node: the instance the kubelet registered last (a surge runs
        # two, whose specs may differ), under a node-wide lock (docs/dra.md).
        self.writer = SharedWriter(plugin_dir, CDI_WRITER_FILE, plugin_dir / service)
        self.checks = checks = proofs.build(hypervisor, turn=self.writer.turn)
        tracker = proofs.tracker
        pool = node_name(settings)
        self.claims = ClaimPreparer(
            Checkpoint(plugin_dir, CHECKPOINT_FILE, CHECKPOINT_KIND), checks.gate,
            node_device(pool, hypervisor, cdi_spec.qualified_name(hypervisor)),
            cdi=checks.reconciler.ensure,
            on_change=metrics.dra_prepared_claims.set, on_result=metrics.claim_result)
        self.health = HealthStream(tracker, lambda: [(pool, hypervisor)],
                                   refresh=settings.health.interval)

        def status(registered: bool) -> None:
            metrics.registrations.labels(result="success" if registered else "failure").inc()
            if registered:  # the hand-over point: the kubelet calls us from now on
                self.writer.claim()
                checks.reconciler.producer.wakeup.fire()  # that pass now; no earlier read vouches

        self.plugin = WatcherPlugin(
            settings.dra.registry_dir, registration, plugin_dir / service, DRA_PLUGIN, DRA_DRIVER,
            SERVICES, functools.partial(new_dra_server, self.claims, self.health), on_status=status,
            dir_setting=REGISTRY_DIR_FLAG)

    async def start(self) -> None:
        """The first passes (CDI, device) and the checkpoint's read, before the kubelet can call."""
        await asyncio.gather(self.checks.first(), self.claims.load())
        await self.claims.runner.run(self.claims.checkpoint.cleanup_leftovers)
        if self.claims.condition()[0]:
            log.info("%d prepared claims in %s", len(self.claims.prepared),
                     self.claims.checkpoint.path)

    async def alive(self, timeout: float) -> bool:
        """/healthz: the DRA service answers on its socket (nothing to ask between servers)."""
        return not self.plugin.serving or await answers(self.plugin.endpoint_path, timeout)

    def conditions(self) -> dict[str, tuple[bool, str]]:
        return {"registered": (self.plugin.registered, self.plugin.status),
                "checkpoint": self.claims.condition()}


def kubelet_conditions(driver: Callable[[], DraDriver | None]) -> Callable[
        [], dict[str, tuple[bool, str]]]:
    def conditions() -> dict[str, tuple[bool, str]]:
        current = driver()
        if current is None:
            return {"registered": (False, "not registered with the kubelet (no hypervisor yet)")}
        return current.conditions()

    return conditions


async def dra(settings: DraSettings, launch: Launch | None = None) -> None:
    """`hlplugin dra`: the CDI reconciler, the device monitor and the DRA kubelet plugin."""
    metrics = DraMetrics()
    proofs = Proofs(settings.cdi, settings.health, metrics)
    built: list[DraDriver] = []

    async def setup(hv: str) -> Started:
        driver = DraDriver(settings, hv, proofs, metrics)
        await driver.start()
        built.append(driver)
        return Started(None, {**driver.checks.tasks(), "kubelet-plugin": driver.plugin.run()})

    await Daemon(proofs.spec(
        "hlplugin dra", settings.http, setup, launch,
        kubelet_conditions=kubelet_conditions(lambda: built[0] if built else None),
        self_check=lambda timeout: built[0].alive(timeout) if built else _answered())).run()


async def _answered() -> bool:
    return True  # before the driver is built: the HTTP answer itself proves the loop turns
