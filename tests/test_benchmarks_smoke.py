"""CI smoke of the one benchmark command: `benchmarks/run.py --quick` completes, prints its table
and writes every figure as JSON. Figures are measured, never asserted (see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from harness import HAVE_KVM, IS_ROOT

ROOT = Path(__file__).resolve().parents[1]

# Every figure of the issue, by the start of its name in the table.
FIGURES = (
    "Allocate p50, concurrency 1",
    "Allocate p99, concurrency 1",
    "Allocate p50, concurrency 16",
    "Allocate p99, concurrency 16",
    "health transition seen by all",
    "CDI missing -> repaired",
    "CDI stale -> repaired",
    "CDI malformed -> repaired",
    "kubelet restart -> re-registered",
    "process start -> registered",
    "peak RSS (VmHWM), main daemon",
    "RSS growth from Allocate",
    "peak RSS (VmHWM), main daemon at DEVICE_COUNT",
    "longest device list at DEVICE_COUNT",
    "peak RSS (VmHWM), bootstrap daemon",
    "idle CPU, main daemon",
    "idle CPU, bootstrap daemon",
    "KVM check (open, API version, create VM)",
    "KVM check with guest",
)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not IS_ROOT, reason="the benchmarks need root (mknod of a host-device view)")
@pytest.mark.skipif(not HAVE_KVM, reason="the benchmarks need a usable /dev/kvm")
def test_quick_benchmark_run_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--quick", "--json",
                             str(out)], capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    names = [f["name"] for f in data["figures"]]
    for figure in FIGURES:
        assert any(name.startswith(figure) for name in names), (figure, names)
    for f in data["figures"]:
        assert isinstance(f["value"], int | float) and math.isfinite(f["value"]), f
        if f["goal"] != "reported":
            assert isinstance(f["met"], bool), f
    for allocate in ("Allocate p50, concurrency 1", "Allocate p50, concurrency 16"):
        figure = next(f for f in data["figures"] if f["name"] == allocate)
        assert figure["baseline"] and figure["ratio"], figure  # measured in the same run
    assert data["profile"] == "quick" and data["machine"]["nproc"]
    # The table, one line per figure.
    assert "figure" in result.stdout and "goal(s) missed" in result.stdout
    for name in names:
        assert name in result.stdout


def test_benchmarks_refuse_to_run_without_what_they_need(tmp_path: Path) -> None:
    """Without root or /dev/kvm the command says why and exits 2; with both, --help works."""
    if IS_ROOT and HAVE_KVM:
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--help"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "--quick" in result.stdout
        return
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--quick", "--json",
                             str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "needs" in result.stderr
