"""The DRA driver hyperlight.dev (`hlplugin dra`): a third daemon, opt-in, in place of the main
daemon on a node (docs/dra.md). Its kubelet side is a plugin-watcher registration and the DRA
service in both API versions (deviceplugin.kubelet.dra: pluginwatcher, draservice); its proofs are the
main daemon's: the CDI reconciler keeps the node's one hyperlight.json (taken over, never a
second spec declaring the device) and the device monitor checks the device before every Prepare.

Its control-plane side, in a cluster only: this node's ResourceSlice (controlplane.py), one more
root task that the kubelet side never waits on, and each new claim's allocation read in Prepare
(allocation.py), the record's leftovers pruned. Run by hand, outside a cluster, a claim is
answered with the node's one device (dra.claims.node_device).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Callable, Coroutine, Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlplugin import cdi_spec
from hlplugin.deviceplugin.kubelet.dra.checkpoint import Checkpoint
from hlplugin.deviceplugin.kubelet.dra.drahealth import HealthStream
from hlplugin.deviceplugin.kubelet.dra.draservice import SERVICES, answers, new_dra_server
from hlplugin.deviceplugin.kubelet.dra.pluginwatcher import DRA_PLUGIN, WatcherPlugin
from hlplugin.deviceplugin.kubelet.dra.writer import SharedWriter
from hlplugin.deviceplugin.metrics import RegistrationResult
from hlplugin.deviceplugin.process.daemon import Conditions, Daemon, Launch, Started
from hlplugin.dra.claims import CHECKPOINT_FILE, CHECKPOINT_KIND, ClaimPreparer, node_device
from hlplugin.metrics import DraMetrics
from hlplugin.names import CDI_WRITER_FILE, DRA_DRIVER, REGISTRY_DIR_FLAG, dra_socket_names
from hlplugin.proofs import Proofs
from hlplugin.settings import DraSettings

if TYPE_CHECKING:
    from hlplugin.dra.allocation import AllocationReader
    from hlplugin.dra.controlplane import Slices
    from hlplugin.kubeapi import Config

log = logging.getLogger(__name__)


class Readiness(StrEnum):
    """The driver's kubelet side in /readyz (keys): gating readiness."""

    REGISTERED = "registered"  # with the kubelet's plugin watcher
    CHECKPOINT = "checkpoint"  # the record of prepared claims is read and trusted


class Advisory(StrEnum):
    """/readyz's ``advisory`` conditions: shown, never gating (DraDriver.advisory says why)."""

    SLICES = "slices"  # this node's ResourceSlice is published
    CLAIMS = "claims"  # the latest read of a claim's allocation from the API server


# kubeapi.config.SERVICE_ACCOUNT's token, named here so that a driver outside a cluster finds
# it missing without importing the client (tests/test_dra_slices.py holds the two equal).
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def cluster_api(environ: Mapping[str, str] = os.environ,
                token: Path = SERVICE_ACCOUNT_TOKEN) -> Config | None:
    """The API server as a pod reaches it, or None (said once, at info) where the driver runs
    outside a cluster: no ResourceSlice then, and everything else as in one. In a pod whose
    in-cluster config is unusable (no CA, a bad port) the reason is a warning: the chart broke."""
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        why = "KUBERNETES_SERVICE_HOST is not set (not running in a pod)"
    elif not token.is_file():
        why = f"no service-account token at {token} (none mounted into the pod)"
    else:
        from hlplugin import kubeapi  # the API client's wing: loaded only in a cluster

        try:
            return kubeapi.Config.in_cluster(environ, token.parent)
        except kubeapi.ConfigError as exc:
            log.warning("no ResourceSlice is published: %s; the kubelet side serves without it",
                        exc)
            return None
    log.info("no ResourceSlice is published: %s; the kubelet side serves without it", why)
    return None


def node_name(settings: DraSettings) -> str:
    """The pool every answer names: the node's name, else (run by hand) the host's."""
    if settings.dra.node_name:
        return settings.dra.node_name
    name = socket.gethostname().lower()
    log.warning("HYPERLIGHT_NODE_NAME is empty: naming the device pool %r after the host (set it "
                "from the downward API's spec.nodeName)", name)
    return name


class DraDriver:
    """The driver's parts once the hypervisor is known: built by setup(), run by the Daemon, to
    which it is the kubelet side (daemon.KubeletSide: conditions(), alive())."""

    def __init__(self, settings: DraSettings, hypervisor: str, proofs: Proofs,
                 metrics: DraMetrics, api: Config | None = None) -> None:
        plugin_dir = settings.dra.plugin_dir
        registration, service = dra_socket_names(settings.dra.pod_uid)
        # One CDI spec writer per node: the instance the kubelet registered last (a surge runs
        # two, whose specs may differ), under a node-wide lock (docs/dra.md).
        self.writer = SharedWriter(plugin_dir, CDI_WRITER_FILE, plugin_dir / service)
        self.checks = checks = proofs.build(hypervisor, turn=self.writer.turn)
        tracker = proofs.tracker
        pool = node_name(settings)
        cdi_name = cdi_spec.qualified_name(hypervisor)
        self.reader: AllocationReader | None = None  # claims read from the API: in a cluster
        if api is not None:
            from hlplugin.dra.allocation import AllocationReader
            from hlplugin.kubeapi import Client

            self.reader = AllocationReader(Client(api), pool, hypervisor, cdi_name)
        self.claims = ClaimPreparer(
            Checkpoint(plugin_dir, CHECKPOINT_FILE, CHECKPOINT_KIND), checks.gate,
            self.reader or node_device(pool, hypervisor, cdi_name),
            cdi=checks.reconciler.ensure,
            on_change=metrics.claims.dra_prepared_claims.set,
            on_result=metrics.claims.claim_result)
        self.health = HealthStream(tracker, lambda: [(pool, hypervisor)],
                                   refresh=settings.health.interval,
                                   on_streams=metrics.claims.dra_health_streams.set)

        def status(registered: bool) -> None:
            metrics.daemon.registrations.labels(result=RegistrationResult.SUCCESS if registered
                                                else RegistrationResult.FAILURE).inc()
            if registered:  # the hand-over point: the kubelet calls us from now on
                self.writer.claim()
                checks.reconciler.producer.wakeup.fire()  # that pass now; no earlier read vouches

        self.slices: Slices | None = None  # this node's ResourceSlice: in a cluster only
        if api is not None:
            from hlplugin.dra.controlplane import Slices

            self.slices = Slices(api, pool, hypervisor, settings.health.dev_dir,
                                 slots=settings.dra.slots, tracker=tracker)
        self.plugin = WatcherPlugin(
            settings.dra.registry_dir, registration, plugin_dir / service, DRA_PLUGIN, DRA_DRIVER,
            SERVICES, functools.partial(new_dra_server, self.claims, self.health), on_status=status,
            dir_setting=REGISTRY_DIR_FLAG, guard=settings.frame_guard)

    async def start(self) -> None:
        """The first passes (CDI, device) and the checkpoint's read, before the kubelet can call."""
        await asyncio.gather(self.checks.first(), self.claims.load())
        await self.claims.cleanup_leftovers()
        if self.claims.condition()[0]:
            log.info("%d prepared claims in %s", len(self.claims.prepared),
                     self.claims.checkpoint.path)

    async def alive(self, timeout: float) -> bool:
        """/healthz: the DRA service answers on its socket (nothing to ask between servers)."""
        return not self.plugin.serving or await answers(self.plugin.endpoint_path, timeout)

    def tasks(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The root tasks: the proofs', the kubelet plugin, and in a cluster the slice's."""
        tasks = {**self.checks.tasks(), "kubelet-plugin": self.plugin.run()}
        if self.slices is not None:
            tasks["slices"] = self.slices.run()
        if self.reader is not None:
            from hlplugin.dra.allocation import keep_pruned

            tasks["claims-prune"] = keep_pruned(self.claims, self.reader)
        return tasks

    def conditions(self) -> dict[str, tuple[bool, str]]:
        return {Readiness.REGISTERED: (self.plugin.ready, self.plugin.status),
                Readiness.CHECKPOINT: self.claims.condition()}

    def advisory(self) -> dict[str, tuple[bool, str]]:
        """/readyz's ``slices`` and ``claims`` (the last read of a claim), shown but not gating
        readiness: the kubelet calls the driver for claims already recorded whether or not the
        API server answers us (an outage of the control plane, a 403 before RBAC is fixed), so
        an unready driver pod would fail nothing the kubelet does and only alarm; their state is
        said here instead."""
        notes: Conditions = {}
        if self.slices is not None:
            notes[Advisory.SLICES] = self.slices.condition()
        if self.reader is not None:
            notes[Advisory.CLAIMS] = self.reader.condition()
        return notes


async def dra(settings: DraSettings, launch: Launch | None = None,
              api: Callable[[], Config | None] = cluster_api) -> None:
    """`hlplugin dra`: the CDI reconciler, the device monitor and the DRA kubelet plugin, and
    the ResourceSlice where ``api`` finds an API server (in a pod; a test names its own)."""
    metrics = DraMetrics()
    proofs = Proofs(settings.cdi, settings.health, metrics.daemon, metrics.proofs)
    server = api()

    async def setup(hv: str) -> Started:
        driver = DraDriver(settings, hv, proofs, metrics, server)
        await driver.start()
        return Started(driver, driver.tasks(), advisory=driver.advisory)

    await Daemon(proofs.spec("hlplugin dra", settings.http, setup, launch, unstarted=UNSTARTED,
                             advisory=WAITING if server else None)).run()


# /readyz before the hypervisor is found: no driver yet, so nothing registered or published.
UNSTARTED: Conditions = {
    Readiness.REGISTERED: (False, "not registered with the kubelet (no hypervisor yet)")}
WAITING: Conditions = {Advisory.SLICES: (False, "not published yet: no hypervisor yet")}
