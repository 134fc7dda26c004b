"""Prometheus metric families. Bounded cardinality: labels name conditions, causes and results,
never devices or pods. Each daemon builds its own registry so tests can run several in one process.

Every label value a counter can take is created at 0 when the registry is built: a series that
appears only at its first increment hides that increment from ``increase()`` and ``rate()``, so
the first refused allocation after a restart would never alert. The process's own resource use
(``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ``process_open_fds``, ...) is
exported beside ours; the ``*_created`` series are not (one more series per counter child, and no
alert or dashboard here reads them).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from hlplugin import __version__
from hlplugin.probe import REASONS as PROBE_REASONS

PREFIX = "hyperlight"

# Process-wide switch in prometheus_client, read at every collection.
disable_created_metrics()  # type: ignore[no-untyped-call]

# The values each labelled family can take; the code that increments them uses only these
# (tests/test_metrics.py checks that no new series ever appears). Adding a value here is how a
# new result, cause or reason is declared.
HEALTH_DIRECTIONS = ("healthy", "unhealthy")
PROBE_CHECKS = ("device", "host_identity")
CDI_REPAIR_CAUSES = ("missing", "malformed", "stale", "metadata")
CDI_REFUSAL_REASONS = ("not_regular", "write_failed")
ALLOCATION_RESULTS = ("success", "invalid", "refused")
REGISTRATION_RESULTS = ("success", "failure")
REREGISTRATION_REASONS = ("stream_ended",)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Info(f"{PREFIX}_build", "Build information.", registry=r)
        self.build_info.info({"version": __version__})
        # Not pre-created: 0 means "failing", so each daemon sets the conditions it has (all of
        # them start as "not checked yet", see daemon.track_health_metrics).
        self.health_condition = Gauge(
            f"{PREFIX}_health_condition", "1 when the health condition holds, 0 when it fails.",
            ["condition"], registry=r)
        self.ready = Gauge(
            f"{PREFIX}_ready", "1 when /readyz answers 200, 0 when it answers 503.", registry=r)
        self.health_transitions = Counter(
            f"{PREFIX}_health_transitions", "Changes of overall health (healthy <-> unhealthy).",
            ["to"], registry=r)
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
        self.allocations = Counter(
            f"{PREFIX}_allocations", "Allocate calls by result.", ["result"], registry=r)
        self.registrations = Counter(
            f"{PREFIX}_registrations", "Registrations with the kubelet by result.", ["result"],
            registry=r)
        self.reregistrations = Counter(
            f"{PREFIX}_reregistrations",
            "Registrations started anew by the plugin itself, by reason.", ["reason"], registry=r)
        self.streams = Gauge(
            f"{PREFIX}_listandwatch_streams", "Open ListAndWatch streams.", registry=r)
        self.devices_advertised = Gauge(
            f"{PREFIX}_devices_advertised", "Devices in the latest ListAndWatch list.", registry=r)
        self.devices_healthy = Gauge(
            f"{PREFIX}_devices_healthy", "Devices advertised as Healthy.", registry=r)
        precreate({
            self.health_transitions: HEALTH_DIRECTIONS,
            self.probe_duration: PROBE_CHECKS,
            self.probe_failures: PROBE_REASONS,
            self.cdi_repairs: CDI_REPAIR_CAUSES,
            self.cdi_refusals: CDI_REFUSAL_REASONS,
            self.allocations: ALLOCATION_RESULTS,
            self.registrations: REGISTRATION_RESULTS,
            self.reregistrations: REREGISTRATION_REASONS,
        })


def precreate(families: Mapping[Counter | Histogram, tuple[str, ...]]) -> None:
    """Create every child of each one-label family, so its series exists (at 0) from the start."""
    for family, values in families.items():
        for value in values:
            family.labels(value)
