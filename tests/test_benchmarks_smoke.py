"""CI smoke of the one benchmark command: `benchmarks/run.py --quick` completes, prints its table
and writes every figure as JSON. Figures are measured, never asserted (see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from harness import IS_ROOT, needs_kvm, needs_root

RUN = [sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks/run.py")]

# Every figure of the issue, by the start of its name in the table.
FIGURES = (
    *(f"Allocate {stat}, concurrency {n}" for n in (1, 16) for stat in ("p50", "p99", "throughput")),
    *(f"CDI {kind} -> repaired" for kind in ("missing", "stale", "malformed", "in-place", "mode")),
    *(f"{what}, {who} daemon" for what in ("peak RSS (VmHWM)", "idle CPU") for who in ("main", "bootstrap")),
    "peak RSS (VmHWM), main daemon at DEVICE_COUNT", "longest device list at DEVICE_COUNT",
    "health transition seen by all", "kubelet restart -> re-registered", "process start -> registered",
    "upgrade hand-over -> the kubelet's gap",
    "RSS growth from Allocate", "KVM check (open, API version, create VM)", "KVM check with guest",
    "host identity check",
    # What every node pays, each daemon in a memory cgroup of its own, beside the floor.
    *(f"{what}, {who} daemon" for who in ("main", "bootstrap") for what in (
        "process start -> Register", "working set idle", "working set after load and a scrape",
        "peak RSS (VmHWM) after load")),
    "working set at DEVICE_COUNT",
    # The DRA driver (benchmarks/dra_figures.py).
    "process start -> first ResourceSlice, DRA driver",
    *(f"NodePrepareResources {q}, DRA driver, {what}" for q in ("p50", "p99")
      for what in ("a new claim", "the same claim again")),
    "idle CPU, DRA driver", "working set idle, DRA driver",
)


@pytest.mark.slow
@pytest.mark.timeout(400)
@needs_root
@needs_kvm
def test_quick_benchmark_run_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run([*RUN, "--quick", "--json", str(out)], capture_output=True, text=True,
                            timeout=380, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    names = [f["name"] for f in data["figures"]]
    for figure in FIGURES:
        assert any(name.startswith(figure) for name in names), (figure, names)
    assert data["profile"] == "quick" and data["machine"]["nproc"]
    assert "figure" in result.stdout and "goal(s) missed" in result.stdout  # the table
    for f in data["figures"]:
        assert isinstance(f["value"], int | float) and math.isfinite(f["value"]), f
        if f["goal"] != "reported":
            assert isinstance(f["met"], bool), f
        if f["name"].startswith("Allocate p50"):
            assert f["baseline"] and f["ratio"], f  # measured in the same run
        assert f["name"] in result.stdout  # one line of the table per figure


def test_benchmarks_refuse_to_run_without_what_they_need(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without root or /dev/kvm the command says why and exits 2 (as root, it is run as nobody to
    see that); --help works either way (run in this process: one interpreter start fewer)."""
    monkeypatch.setattr(sys, "argv", [RUN[1], "--help"])
    monkeypatch.syspath_prepend(str(Path(RUN[1]).parent))  # as `python benchmarks/run.py` has it
    with pytest.raises(SystemExit) as helped:
        runpy.run_path(RUN[1], run_name="__main__")
    assert helped.value.code == 0 and "--quick" in capsys.readouterr().out
    result = subprocess.run([sys.executable, "-c", AS_NOBODY if IS_ROOT else AS_IS, RUN[1], "--quick",
                             "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "needs" in result.stderr
    assert not (tmp_path / "x.json").exists()


# The script is read and its modules imported first, then the process becomes nobody and asks for
# a run: as nobody from the start it could not even read a checkout in a 0700 directory (as CI
# clones it), nor start the virtual environment's interpreter there. The script's directory is
# on sys.path, as `python benchmarks/run.py` puts it.
AS_IS = """import os, runpy, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
sys.exit(runpy.run_path(sys.argv[1])["main"](sys.argv[2:]))
"""
AS_NOBODY = """import os, runpy, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
main = runpy.run_path(sys.argv[1])["main"]
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
sys.exit(main(sys.argv[2:]))
"""
