"""The fault matrix (tests/test_faults.py says how it runs), its kubelet rows: a registration that
fails is bounded and recovers; a restart of the daemon or the kubelet registers again and keeps
the spec.

Run: ``python -m pytest -m faults tests/test_faults*.py``"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from statistics import median

import harness
import pytest
from faultreport import scenario
from harness import (
    Rig,
    needs_kvm,
    spec_is_exact,
    wait_metric,
)
from support.faults import COUNT, DESIRED, GUARD, RESOURCE, SERVE, SOCKET, fresh_node, matrix_row, workers

from hlplugin.tools.emulator import KubeletEmulator

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180), pytest.mark.usefixtures("fault_report")]


@pytest.mark.parametrize("kind, mode", [("no kubelet.sock", ""), ("never answers", "hang"),
                                        ("resets connections", "reset")],
                         ids=lambda v: v or None)
async def test_registration_failure_is_bounded_then_recovers(tmp_path: Path, kind: str,
                                                              mode: str) -> None:
    timeout = 1.5  # the kubelet dials us back inside Register: 0.5 s was met by a busy pytest process
    node = fresh_node(tmp_path)
    kubelet = KubeletEmulator(node.plugin_dir, mode=mode or "normal")
    with scenario(f"Registration failure: {kind}") as row:
        try:
            if mode:
                await kubelet.start()
            began = time.monotonic()
            async with harness.daemon(node.serve_args(*SERVE, "--register-timeout", str(timeout))) as proc:
                # Several bounded attempts: each ends within the timeout (plus backoff); waiting
                # for a missing kubelet.sock counts as a failed attempt per backoff step.
                failures = harness.value(await wait_metric(proc, lambda s: harness.value(
                    s, "hyperlight_registrations_total", result="failure") >= 3, GUARD),
                    "hyperlight_registrations_total", result="failure")
                row.facts["attempts"] = f"{failures:.0f} failed in {time.monotonic() - began:.1f}s"
                # Why each attempt failed, logged once: test_lifecycle's registration failures.
                r = Rig(node, kubelet, proc, COUNT, DESIRED, guard=GUARD)
                assert not (await r.conditions(503))["registered"]["ok"]
                await r.live()
                await kubelet.stop(remove_socket=True)
                kubelet.mode = "normal"  # the kubelet comes back working
                began = time.monotonic()
                await kubelet.start()
                await r.healthy()
                row.recovery_s = time.monotonic() - began
                await r.conditions(200)
                await r.admit()
                row.facts.update(readyz=503, healthz=200, register_timeout=f"{timeout}s")
        finally:
            await kubelet.stop()


@needs_kvm
@pytest.mark.parametrize("restart", ["SIGTERM", "SIGKILL", "kubelet"])
async def test_restart_re_registers_and_keeps_the_spec(tmp_path: Path, restart: str) -> None:
    """The plugin (by this signal) or the kubelet restarts again and again: the plugin registers
    anew each time, a fresh allocation works, and a reader never sees the spec other than exact."""
    kubelet = restart == "kubelet"
    async with matrix_row("Kubelet restart" if kubelet else f"Plugin restart: {restart}",
                          fresh_node(tmp_path)) as (row, r):
        times = []
        with workers(tmp_path, r.spec, {"desired": DESIRED}, readers=1, pause=0.001) as watch:
            for _ in range(5 if kubelet else 3):
                calls = r.kubelet.register_calls
                if kubelet:
                    began = time.monotonic()
                    await r.kubelet.restart()  # deletes every socket, serves kubelet.sock anew
                else:
                    await r.proc.signal(signal.Signals[restart])
                    await r.wait(lambda: r.kubelet.allocatable(RESOURCE) == 0)
                    assert spec_is_exact(r.spec, DESIRED)
                    if restart == "SIGKILL":
                        assert (r.node.plugin_dir / SOCKET).exists()  # stale, left behind
                    began = time.monotonic()
                    await r.proc.start()
                await r.wait(lambda c=calls: r.kubelet.register_calls > c  # type: ignore[misc]
                             and r.kubelet.allocatable(RESOURCE) == COUNT)
                times.append(time.monotonic() - began)
                await r.admit()
        reads = sum(watch["counts"].values())
        assert set(watch["counts"]) == {"desired"} and (kubelet or reads > 100), watch
        if kubelet:
            row.recovery_s = median(times)
            row.facts.update(restarts=5, re_registered_max_ms=round(max(times) * 1000, 1),
                             upstream_go="5.01 s")
        else:
            row.recovery_s = max(times)
            row.facts.update(restarts=3, start_to_registered_median_s=round(median(times), 3),
                             spec_reads_during=reads, spec_read_errors=0)
