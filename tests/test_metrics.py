"""Every metric family moves when its event happens: real daemons, real events, scraped /metrics.
CDI repairs by cause are counted in test_faults (on the daemon) and test_cdi (the metadata cause).
A daemon exports only the families it sets: the DRA driver none of a device plugin's."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import (
    Node,
    Samples,
    daemon,
    needs_kvm,
    obstruct_with_directory,
    on_kubelet,
    scrape,
    short_dir,
    value,
    wait_metric,
    wait_until,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from support.pluginwatcher import FakePluginWatcher

from hlplugin import __version__, cdi_spec
from hlplugin.metrics import Metrics
from hlplugin.names import DRA_DRIVER
from hlplugin.tools.emulator import AdmissionError

RESOURCE = "hyperlight.dev/hypervisor"
# A device plugin's own families (deviceplugin.metrics.DevicePluginMetrics): Allocate and
# ListAndWatch, which a DRA driver never serves.
DEVICE_PLUGIN_ONLY = {"hyperlight_allocations", "hyperlight_reregistrations",
                      "hyperlight_listandwatch_streams", "hyperlight_devices_advertised",
                      "hyperlight_devices_healthy"}


def series(samples: Samples) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """The hyperlight_ series of a scrape (process_ ones come and go with the platform)."""
    return {key for key in samples if key[0].startswith("hyperlight_")}


def test_every_family_is_prefixed_and_has_bounded_labels() -> None:
    allowed = {"condition", "to", "check", "reason", "cause", "result", "version", "setting"}
    for family in Metrics().registry.collect():
        if family.name.startswith(("process_", "python_")):  # prometheus_client's collectors
            assert family.name in PROCESS_FAMILIES, family.name
            continue
        assert family.name.startswith("hyperlight_"), family.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= allowed, (family.name, sample.labels)


PROCESS_FAMILIES = {
    "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
    "process_cpu_seconds", "process_open_fds", "process_max_fds", "python_info",
}  # fmt: skip


def test_python_info_is_prometheus_clients_own_made_at_the_first_collection() -> None:
    from prometheus_client.platform_collector import PlatformCollector

    ours = [family for family in Metrics().registry.collect() if family.name == "python_info"]
    assert ours == list(PlatformCollector(registry=None).collect())


@needs_kvm
async def test_main_daemon_families_move_with_their_events(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    spec = node.cdi_dir / cdi_spec.SPEC_FILE
    args = node.serve_args("--device-count", "4", "--health-interval", "1")
    async with on_kubelet(node, args) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_listandwatch_streams") == 1)
        first = series(m)
        assert value(m, "hyperlight_build_info", version=__version__) == 1
        assert value(m, "hyperlight_registrations_total", result="success") == 1
        assert value(m, "hyperlight_devices_advertised") == 4
        assert value(m, "hyperlight_devices_healthy") == 4
        for condition in ("cdi", "device", "host_identity"):
            assert value(m, "hyperlight_health_condition", condition=condition) == 1
        assert value(m, "hyperlight_ready") == 1 and (await proc.http("/readyz"))[0] == 200
        assert value(m, "hyperlight_health_transitions_total", to="healthy") == 1
        assert value(m, "hyperlight_health_transitions_total", to="unhealthy") == 0
        assert value(m, "hyperlight_cdi_repairs_total", cause="missing") == 1  # the first write
        probes = value(m, "hyperlight_probe_duration_seconds_count", check="device")
        assert probes >= 1
        assert value(m, "hyperlight_probe_duration_seconds_count", check="host_identity") >= 1
        await wait_metric(proc, lambda m: value(
            m, "hyperlight_probe_duration_seconds_count", check="device") > probes)

        # Allocations by result.
        await kubelet.admit(RESOURCE)
        with pytest.raises(AdmissionError):
            await kubelet.allocate(RESOURCE, [["kvm-99"]])
        m = await scrape(proc)
        assert value(m, "hyperlight_allocations_total", result="success") == 1
        assert value(m, "hyperlight_allocations_total", result="invalid") == 1

        # Refusal: the CDI path obstructed by a directory.
        obstruct_with_directory(spec)
        m = await wait_metric(proc, lambda m: value(
            m, "hyperlight_health_condition", condition="cdi") == 0
            and value(m, "hyperlight_devices_healthy") == 0)
        assert value(m, "hyperlight_cdi_refusals_total", reason="not_regular") >= 1
        assert value(m, "hyperlight_ready") == 0 and (await proc.http("/readyz"))[0] == 503
        assert value(m, "hyperlight_health_transitions_total", to="unhealthy") == 1
        with pytest.raises(AdmissionError):
            await kubelet.allocate(RESOURCE, [["kvm-1"]])
        m = await scrape(proc)
        assert value(m, "hyperlight_allocations_total", result="refused") == 1
        spec.rmdir()
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_devices_healthy") == 4)
        assert value(m, "hyperlight_health_condition", condition="cdi") == 1
        assert value(m, "hyperlight_health_transitions_total", to="healthy") == 2

        # Registrations: a kubelet restart; the stream gauge does not leak the old stream.
        await kubelet.restart()
        await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 4)
        m = await wait_metric(proc, lambda m: value(
            m, "hyperlight_registrations_total", result="success") == 2)
        m = await wait_metric(proc, lambda m: value(m, "hyperlight_listandwatch_streams") == 1)
        assert series(m) == first, "every event moved a series that existed from the start"


def test_the_device_plugin_only_families_are_the_device_plugin_group() -> None:
    group = Metrics().plugin
    declared = {next(iter(m.describe())).name for m in vars(group).values()
                if isinstance(m, MetricWrapperBase)}
    assert declared == DEVICE_PLUGIN_ONLY


async def test_the_dra_driver_exports_no_device_plugin_family() -> None:
    """The driver answers no Allocate and opens no ListAndWatch: those families would be zeros
    that mean nothing to an operator, and an alert on no ListAndWatch stream would fire on every
    driver pod. It exports its own (claims), every daemon's (registration, readiness, health,
    build) and the proofs' (device checks, CDI reconciler). No kvm needed: the device check may
    fail, the families are the same."""
    root = short_dir()
    registry, cdi_dir, dev_dir = root / "plugins_registry", root / "cdi", root / "dev"
    for directory in (registry, cdi_dir, dev_dir):
        directory.mkdir()
    watcher = FakePluginWatcher(registry)
    args = ["dra", "--registry-dir", str(registry), "--dra-dir", str(root / "plugins" / DRA_DRIVER),
            "--node-name", "node-a", "--cdi-dir", str(cdi_dir), "--dev-dir", str(dev_dir),
            "--host-dev-dir", "", "--hypervisor", "kvm"]
    async with daemon(args, graceful=True) as proc:
        async def registered() -> bool:
            await watcher.sync()
            return bool(watcher.plugins)

        await wait_until(registered, 30, "the plugin watcher registered the driver")
        m = await wait_metric(proc, lambda m: value(
            m, "hyperlight_registrations_total", result="success") == 1)
        code, body = await proc.http("/metrics")
    assert code == 200
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert not families & DEVICE_PLUGIN_ONLY, sorted(families & DEVICE_PLUGIN_ONLY)
    assert {"hyperlight_dra_prepares", "hyperlight_dra_unprepares", "hyperlight_dra_prepared_claims",
            "hyperlight_dra_health_streams", "hyperlight_registrations", "hyperlight_ready",
            "hyperlight_health_condition", "hyperlight_health_transitions", "hyperlight_build_info",
            "hyperlight_probe_failures", "hyperlight_cdi_repairs"} <= families, sorted(families)
    assert value(m, "hyperlight_dra_prepares_total", result="success") == 0  # pre-created
