"""The generic Prometheus families, in groups a daemon composes: every daemon's (process, health,
readiness, registration: DaemonMetrics) and a device plugin's (Allocate, ListAndWatch:
DevicePluginMetrics). Bounded cardinality: labels name conditions and results, never devices or
pods. Each daemon builds its own registry so tests can run several in one process.

Every label value a counter can take is created at 0 when the registry is built: a series that
appears only at its first increment hides that increment from ``increase()`` and ``rate()``, so
the first registration failure after a restart would never alert. The process's own resource use
(``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ``process_open_fds``, ...) is
exported beside ours; the ``*_created`` series are not (one more series per counter child, and no
alert or dashboard reads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

# The submodules, not the package: its exposition code waits for the first scrape (lazyprom).
from prometheus_client.metrics import Counter, Gauge, Histogram, Info, disable_created_metrics
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

# Process-wide switch in prometheus_client, read at every collection.
disable_created_metrics()  # type: ignore[no-untyped-call]


# The values each labelled family can take, one enum beside each family: the code that moves a
# family names a member, never a string (a typo is an error, not a new series; tests/test_metrics.py
# checks that no new series ever appears). Adding a member is how a new result or reason is
# declared. StrEnums, so label values, log fields and JSON keep the plain words.


class HealthDirection(StrEnum):
    """Where overall health turned (``health_transitions``, label ``to``)."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class AllocationResult(StrEnum):
    """How an Allocate call ended (``allocations``, label ``result``)."""

    SUCCESS = "success"
    INVALID = "invalid"  # malformed, or naming IDs we do not advertise
    REFUSED = "refused"  # the gate: the device cannot be handed out now


class RegistrationResult(StrEnum):
    """How one attempt to register with the kubelet ended (``registrations``, label ``result``)."""

    SUCCESS = "success"
    FAILURE = "failure"


class ReregistrationReason(StrEnum):
    """Why the plugin registered anew on its own (``reregistrations``, label ``reason``)."""

    STREAM_ENDED = "stream_ended"  # the kubelet kept no ListAndWatch stream open, and still listens


class DaemonMetrics:
    """Every daemon's families, named ``<prefix>_...``, in the registry its /metrics serves: its
    process, health and readiness, the settings it ignored, its build (with ``version``) and its
    registrations with the kubelet (a device plugin and a DRA driver both register, each by its
    own protocol).

    A daemon composes beside it, in the same registry, the groups whose families it sets
    (DevicePluginMetrics; its own), never a family it does not: a zero that means nothing
    misleads an operator, and an alert on it fires (a DRA driver exporting a ListAndWatch count
    would show 0 on every pod).
    """

    def __init__(self, prefix: str, registry: CollectorRegistry | None = None, *,
                 version: str | None = None) -> None:
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        r.register(PythonInfo())
        # Not pre-created: 0 means "failing", so each daemon sets the conditions it has (all of
        # them start as "not checked yet", see daemon.track_health_metrics).
        self.health_condition = Gauge(
            f"{prefix}_health_condition", "1 when the health condition holds, 0 when it fails.",
            ["condition"], registry=r)
        self.ready = Gauge(
            f"{prefix}_ready", "1 when /readyz answers 200, 0 when it answers 503.", registry=r)
        self.health_transitions = Counter(
            f"{prefix}_health_transitions", "Changes of overall health (healthy <-> unhealthy).",
            ["to"], registry=r)
        self.registrations = Counter(
            f"{prefix}_registrations", "Registrations with the kubelet by result.", ["result"],
            registry=r)
        # Not pre-created: a series exists only for a setting that was ignored (bounded: one
        # per setting, by its settings name).
        self.settings_ignored = Gauge(
            f"{prefix}_settings_ignored",
            "1 for each setting whose environment value was invalid and ignored: its default runs.",
            ["setting"], registry=r)
        self.build_info: Info | None = None
        if version is not None:
            self.build_info = Info(f"{prefix}_build", "Build information.", registry=r)
            self.build_info.info({"version": version})
        precreate({self.health_transitions: HealthDirection,
                   self.registrations: RegistrationResult})


class DevicePluginMetrics:
    """A device plugin's own families: Allocate, its ListAndWatch streams, the devices they
    advertise and the registrations it starts anew, in its daemon's registry (``daemon``, where
    the lifecycle also counts its registrations)."""

    def __init__(self, daemon: DaemonMetrics) -> None:
        self.daemon = daemon
        self.registry = r = daemon.registry
        prefix = daemon.prefix
        self.allocations = Counter(
            f"{prefix}_allocations", "Allocate calls by result.", ["result"], registry=r)
        self.reregistrations = Counter(
            f"{prefix}_reregistrations",
            "Registrations started anew by the plugin itself, by reason.", ["reason"], registry=r)
        self.streams = Gauge(
            f"{prefix}_listandwatch_streams", "Open ListAndWatch streams.", registry=r)
        self.devices_advertised = Gauge(
            f"{prefix}_devices_advertised", "Devices in the latest ListAndWatch list.", registry=r)
        self.devices_healthy = Gauge(
            f"{prefix}_devices_healthy", "Devices advertised as Healthy.", registry=r)
        precreate({self.allocations: AllocationResult,
                   self.reregistrations: ReregistrationReason})


class PythonInfo(Collector):
    """prometheus_client's PlatformCollector (``python_info``), made at the first collection: the
    platform module it reads takes milliseconds to import, and only a scrape needs it."""

    def __init__(self) -> None:
        self._metrics: list[Metric] | None = None

    def describe(self) -> list[Metric]:  # its name, for the registry's duplicate check
        return [GaugeMetricFamily("python_info", "Python platform information")]

    def collect(self) -> list[Metric]:
        if self._metrics is None:
            from prometheus_client.platform_collector import PlatformCollector

            self._metrics = list(PlatformCollector(registry=None).collect())
        return self._metrics


def precreate(families: Mapping[Counter | Histogram, Iterable[str]]) -> None:
    """Create every child of each one-label family, so its series exists (at 0) from the start."""
    for family, values in families.items():
        for value in values:
            family.labels(value)
