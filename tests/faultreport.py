"""The fault matrix's report: one row per scenario, printed as a table and written as JSON.

Kept apart from the scenarios so tests/test_faults*.py hold only the faults and their checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import HAVE_KVM, IS_ROOT

KVM = Path("/dev/kvm")
ROWS: list[dict[str, Any]] = []


@dataclass
class Row:
    scenario: str
    result: str = "pass"
    recovery_s: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)


def _kvm_identity() -> tuple[int, int, int, int] | None:
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(KVM)
        return st.st_mode, st.st_uid, st.st_gid, st.st_rdev
    return None


@contextlib.contextmanager
def scenario(name: str, keep: Iterable[Path] = ()) -> Iterator[Row]:
    """One row: FAIL with the error when the body raises; on the way out the files ``keep`` and
    /dev/kvm's mode, owner and numbers must be as they were."""
    row, before = Row(name), _kvm_identity()
    kept = {path: path.read_bytes() for path in keep}
    try:
        yield row
        for path, content in kept.items():
            assert path.read_bytes() == content, f"sibling {path} changed"
        assert _kvm_identity() == before, f"{KVM} mode, owner or numbers changed"
        row.facts["preserved"] = f"{len(kept)} sibling(s), {KVM}"
    except pytest.skip.Exception as exc:
        row.result, row.facts["why"] = "skipped", str(exc)
        raise
    except BaseException as exc:
        row.result, row.facts["error"] = "FAIL", f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        recovery = None if row.recovery_s is None else round(row.recovery_s, 4)
        ROWS.append({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                     "scenario": name, "result": row.result, "recovery_s": recovery, "facts": row.facts})


def format_table(rows: list[dict[str, Any]]) -> str:
    def recovery(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"

    lines = [("scenario", "result", "recovery", "facts")] + [
        (r["scenario"], r["result"], recovery(r["recovery_s"]),
         "; ".join(f"{k}={v}" for k, v in r["facts"].items() if k != "preserved")) for r in rows]
    widths = [max(len(cells[i]) for cells in lines) for i in range(3)] + [0]
    lines.insert(1, ("-" * widths[0], "-" * widths[1], "-" * widths[2], "-----"))
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines)


def write(request: pytest.FixtureRequest) -> None:
    """Once every row of the session has run (tests/conftest.py's fault_report): add the rows that
    did not run and the preservation summary, write the JSON ($HLPLUGIN_FAULT_REPORT or
    ./fault-matrix.json), print the table."""
    ran = {r["test"] for r in ROWS}
    for item in request.session.items:
        if item.get_closest_marker("faults") and item.nodeid not in ran:
            skip = item.get_closest_marker("skipif")
            reason = skip.kwargs.get("reason", "skipped") if skip else "not run (deselected or skipped)"
            ROWS.append({"test": item.nodeid, "scenario": item.name, "result": "skipped",
                         "recovery_s": None, "facts": {"why": reason}})
    if not ROWS:
        return
    failed = sum(r["result"] == "FAIL" for r in ROWS)
    checked = [r for r in ROWS if r["result"] != "skipped"]
    preserved = sum("preserved" in r["facts"] for r in checked)
    rows = [*ROWS, {"scenario": "Preservation (after every scenario above)",
                    "result": "pass" if preserved == len(checked) else "FAIL", "recovery_s": None,
                    "facts": {"checked": f"{preserved}/{len(checked)} scenarios",
                              "what": "sibling CDI spec bytes; /dev/kvm mode, uid, gid, rdev"}}]
    target = Path(os.environ.get("HLPLUGIN_FAULT_REPORT")
                  or request.config.rootpath / "fault-matrix.json")
    report = {"machine": {"nproc": os.cpu_count(), "kernel": os.uname().release,
                          "python": sys.version.split()[0], "root": IS_ROOT, "kvm": HAVE_KVM},
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "failed": failed}
    target.write_text(json.dumps(report, indent=2) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n\nFault matrix ({len(rows)} rows, {failed} failed; JSON: {target})\n"
              + format_table(rows) + "\n", flush=True)
