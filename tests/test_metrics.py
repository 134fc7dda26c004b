"""Every metric family moves when its event happens: real daemons, real events, scraped /metrics."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import (
    Node,
    Samples,
    needs_kvm,
    obstruct_with_directory,
    on_kubelet,
    scrape,
    value,
    wait_metric,
    wait_until,
)
from harness import daemon as harness_daemon

from hlplugin import __version__, cdi, probe
from hlplugin.emulator import AdmissionError
from hlplugin.metrics import Metrics

RESOURCE = "hyperlight.dev/hypervisor"

def series(samples: Samples) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """The hyperlight_ series of a scrape (process_ ones come and go with the platform)."""
    return {key for key in samples if key[0].startswith("hyperlight_")}


def test_every_family_is_prefixed_and_has_bounded_labels() -> None:
    allowed = {"condition", "to", "check", "reason", "cause", "result", "version"}
    for family in Metrics().registry.collect():
        if family.name.startswith(("process_", "python_")):  # prometheus_client's collectors
            assert family.name in PROCESS_FAMILIES, family.name
            continue
        assert family.name.startswith("hyperlight_"), family.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= allowed, (family.name, sample.labels)


# Every value each labelled counter can take (README "Metrics"): all exported at 0 from the start.
COUNTER_LABELS = {
    "hyperlight_health_transitions_total": ("to", ("healthy", "unhealthy")),
    "hyperlight_probe_failures_total": ("reason", probe.REASONS),
    "hyperlight_cdi_repairs_total": ("cause", ("missing", "malformed", "stale", "metadata")),
    "hyperlight_cdi_refusals_total": ("reason", ("not_regular", "write_failed")),
    "hyperlight_allocations_total": ("result", ("success", "invalid", "refused")),
    "hyperlight_registrations_total": ("result", ("success", "failure")),
    "hyperlight_probe_duration_seconds_count": ("check", ("device", "host_identity")),
}
PROCESS_FAMILIES = {
    "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
    "process_cpu_seconds", "process_open_fds", "process_max_fds", "python_info",
}  # fmt: skip


@pytest.mark.parametrize("daemon", ["serve", "bootstrap"])
async def test_auto_without_a_device_exports_every_series_and_says_what_it_looks_for(
        tmp_path: Path, daemon: str) -> None:
    """--hypervisor auto (what the manifests deploy), no kubelet, no device node: nothing has
    happened, yet every counter series is there at 0, the health conditions the daemon has are 0
    ("not checked yet"), the process's own resource use is exported, and no `_created` series
    is. /readyz names the search, and drops it once a node of that name appears."""
    dev = tmp_path / "empty-dev"
    dev.mkdir()
    node = Node.make(tmp_path, dev_dir=dev, host_dev_dir=dev)
    args = (node.serve_args("--hypervisor", "auto") if daemon == "serve" else
            ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(dev),
             "--hypervisor", "auto"])
    async with harness_daemon(args) as proc:
        m = await scrape(proc)
        for name, (label, values) in COUNTER_LABELS.items():
            for v in values:
                assert m.get((name, frozenset({(label, v)}))) == 0, f"{name}{{{label}={v!r}}}"
        conditions = ("cdi", "device", "host_identity") if daemon == "serve" else ("device",)
        for condition in conditions:
            assert m[("hyperlight_health_condition", frozenset({("condition", condition)}))] == 0
        assert m[("hyperlight_ready", frozenset())] == 0
        assert not [k for k in m if k[0].endswith("_created")]
        assert m[("process_resident_memory_bytes", frozenset())] > 1 << 20
        assert m[("process_open_fds", frozenset())] > 3
        assert ("process_cpu_seconds_total", frozenset()) in m

        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"]["hypervisor"] == {
            "ok": False, "reason": f"no mshv or kvm device under {dev}"}
        (dev / "kvm").write_text("not a device")  # found by name; then checked as a node
        await wait_until(lambda: "hypervisor device" in " ".join(proc.messages()))
        condition, want = (
            ("host_identity", f"device {dev / 'kvm'} is not a character device (a regular file)")
            if daemon == "serve" else ("device", f"{dev / 'kvm'} is not a character device"))

        async def explained() -> bool:  # the readiness this answers is set just after that line
            body = json.loads((await proc.get("/readyz"))[1])
            return bool(body["conditions"][condition] == {"ok": False, "reason": want})

        await wait_until(explained)
        ready = json.loads(await proc.wait_http("/readyz", 503))
        assert ready["conditions"][condition] == {"ok": False, "reason": want}
        assert "hypervisor" not in ready["conditions"]


@needs_kvm
async def test_main_daemon_families_move_with_their_events(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    spec = node.cdi_dir / cdi.SPEC_FILE
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

        # CDI repairs by cause. Each damage is atomic: an in-place write is first an empty
        # file, which is malformed, and would count as that instead.
        desired = spec.read_bytes()
        stale = json.loads(desired)
        stale["devices"][0]["containerEdits"]["env"].append("EXTRA=1")

        def replace_with(content: bytes) -> None:
            temp = tmp_path / "damage"
            temp.write_bytes(content)
            os.replace(temp, spec)

        damage: list[tuple[str, Callable[[], None]]] = [
            ("missing", spec.unlink),
            ("malformed", lambda: replace_with(b"{ not json")),
            ("stale", lambda: replace_with(json.dumps(stale).encode())),
            ("metadata", lambda: spec.chmod(0o600)),
        ]
        for cause, act in damage:
            before = value(await scrape(proc), "hyperlight_cdi_repairs_total", cause=cause)
            act()
            await wait_metric(proc, lambda m, c=cause, b=before: value(
                m, "hyperlight_cdi_repairs_total", cause=c) == b + 1)
            assert spec.read_bytes() == desired, cause

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
