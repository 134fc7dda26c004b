"""Hyperlight's Prometheus families, named ``hyperlight_*``: each daemon's registry composes the
groups whose families it sets, and no other (a family a daemon never sets would export zeros that
mean nothing, and fire an alert written for another daemon):

- the bootstrap: every daemon's (``daemon_metrics``: deviceplugin.metrics.DaemonMetrics with the
  build) and a device plugin's (DevicePluginMetrics);
- the main daemon (``Metrics``): those, and the node proofs' (``ProofMetrics``: device checks,
  CDI reconciler);
- the DRA driver (``DraMetrics``): every daemon's, the proofs', and its claims'
  (``ClaimMetrics``); no device plugin's: it answers no Allocate and opens no ListAndWatch.
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from hlplugin import __version__
from hlplugin.deviceplugin.metrics import DaemonMetrics, DevicePluginMetrics, precreate
from hlplugin.names import ConditionName

PREFIX = "hyperlight"

PROBE_CHECKS = (ConditionName.DEVICE, ConditionName.HOST_IDENTITY)


class RepairCause(StrEnum):
    """Why the CDI reconciler rewrote its spec (label ``cause``, and the log's)."""

    MISSING = "missing"
    MALFORMED = "malformed"  # not a spec, or unreadable
    STALE = "stale"  # a well-formed spec, not ours
    METADATA = "metadata"  # our content, wrong mode or owner


class Refusal(StrEnum):
    """Why it could not (label ``reason``)."""

    NOT_REGULAR = "not_regular"  # something we do not own at the name
    WRITE_FAILED = "write_failed"


CDI_REPAIR_CAUSES = tuple(RepairCause)
CDI_REFUSAL_REASONS = tuple(Refusal)


def daemon_metrics(registry: CollectorRegistry | None = None) -> DaemonMetrics:
    """Every hlplugin daemon's own group: the generic families, named ``hyperlight_*``, and its
    build."""
    return DaemonMetrics(PREFIX, registry, version=__version__)


class ProofMetrics:
    """The node proofs' families (proofs.py: the device monitor and the CDI reconciler), in the
    registry of a daemon that keeps them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Here, not at the top: importing this module must not load the prober (the bootstrap).
        from hlplugin.probe import REASONS as PROBE_REASONS

        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.probe_duration = Histogram(
            f"{PREFIX}_probe_duration_seconds", "Duration of a hypervisor device check.",
            ["check"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.probe_failures = Counter(
            f"{PREFIX}_probe_failures", "Failed hypervisor device checks by reason.",
            ["reason"], registry=r)
        self.cdi_repairs = Counter(
            f"{PREFIX}_cdi_repairs", "CDI spec rewrites by cause.", ["cause"], registry=r)
        self.cdi_refusals = Counter(
            f"{PREFIX}_cdi_refusals",
            "Reconciles refused because the CDI path is not a regular file, or failed to write.",
            ["reason"], registry=r)
        self.cdi_dir_exposed = Gauge(
            f"{PREFIX}_cdi_dir_exposed",
            "1 while the CDI directory or its parent is writable by group or others, or not "
            "owned by root.", ["directory"], registry=r)
        precreate({
            self.probe_duration: PROBE_CHECKS,
            self.probe_failures: PROBE_REASONS,
            self.cdi_repairs: CDI_REPAIR_CAUSES,
            self.cdi_refusals: CDI_REFUSAL_REASONS,
        })


class Metrics:
    """The main daemon's registry: every daemon's group, a device plugin's and the proofs'."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.daemon = daemon_metrics(registry)
        self.registry = self.daemon.registry
        self.plugin = DevicePluginMetrics(self.daemon)
        self.proofs = ProofMetrics(self.registry)


class PrepareResult(StrEnum):
    """How NodePrepareResources answered one claim (``dra_prepares``, label ``result``)."""

    SUCCESS = "success"
    REFUSED = "refused"  # the device or the CDI spec cannot serve a claim now
    ERROR = "error"  # the record: unreadable, refused, locked by another instance, unwritable


class UnprepareResult(StrEnum):
    """How NodeUnprepareResources answered one claim (``dra_unprepares``, label ``result``)."""

    SUCCESS = "success"
    ERROR = "error"


# A claim's outcome: its type names the call (each has its own family and its own results).
ClaimResult = PrepareResult | UnprepareResult


class ClaimMetrics:
    """The DRA driver's own families: its claims, by call and result, and its health streams."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.dra_prepares = Counter(
            f"{PREFIX}_dra_prepares", "Claims answered by NodePrepareResources, by result.",
            ["result"], registry=r)
        self.dra_unprepares = Counter(
            f"{PREFIX}_dra_unprepares", "Claims answered by NodeUnprepareResources, by result.",
            ["result"], registry=r)
        self.dra_prepared_claims = Gauge(
            f"{PREFIX}_dra_prepared_claims", "Claims prepared on this node (the checkpoint's).",
            registry=r)
        self.dra_health_streams = Gauge(
            f"{PREFIX}_dra_health_streams", "Resource-health streams the kubelet holds open "
            "(0: the kubelet does not hear the device's health from us).", registry=r)
        precreate({self.dra_prepares: PrepareResult, self.dra_unprepares: UnprepareResult})

    def claim_result(self, result: ClaimResult) -> None:
        family = self.dra_prepares if isinstance(result, PrepareResult) else self.dra_unprepares
        family.labels(result=result).inc()


class DraMetrics:
    """The DRA driver's registry: every daemon's group, the proofs' (the main daemon's device
    checks and CDI reconciler), and its claims'."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.daemon = daemon_metrics(registry)
        self.registry = self.daemon.registry
        self.proofs = ProofMetrics(self.registry)
        self.claims = ClaimMetrics(self.registry)
