"""Prometheus metric families. Bounded cardinality: labels name conditions, causes and results,
never devices or pods. Each daemon builds its own registry so tests can run several in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from hlplugin import __version__

PREFIX = "hyperlight"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build_info = Info(f"{PREFIX}_build", "Build information.", registry=r)
        self.build_info.info({"version": __version__})
        self.health_condition = Gauge(
            f"{PREFIX}_health_condition", "1 when the health condition holds, 0 when it fails.",
            ["condition"], registry=r)
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
