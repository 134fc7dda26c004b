"""The README tells the truth: its configuration table is generated from config.OPTIONS, its metrics
table names every family in metrics.py, and it starts with the two quickstart commands.

Regenerate the configuration table after changing an option: `python tests/test_readme.py --write`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from hlplugin import config
from hlplugin.metrics import Metrics

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- BEGIN options: generated from config.OPTIONS by `python tests/test_readme.py --write` -->"
END = "<!-- END options -->"
QUICKSTART = (
    "```\n"
    "pip install . && hlplugin demo      # install and run the main job: both daemons against a "
    "built-in kubelet emulator\n"
    "bash .ci/run                        # run the tests: installs podman, runc, shellcheck and the "
    "Python test tools, lints, then python -m pytest\n"
    "```\n"
)
_USERS = (("serve", config.SERVE_OPTIONS), ("bootstrap", config.BOOTSTRAP_OPTIONS),
          ("cdi", config.CDI_OPTIONS), ("doctor", config.DOCTOR_OPTIONS))


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return f"`{value[0]}:{value[1]}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None or value == "":
        return "(empty)"
    return f"`{value}`"


def render_options_table() -> str:
    rows = ["| flag | environment | default | used by | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for name, option in config.OPTIONS.items():
        default = _shown(option.default)
        for command, overrides in config.DEFAULT_OVERRIDES.items():
            if name in overrides:
                default += f" ({command}: {_shown(overrides[name])})"
        users = ", ".join(command for command, names in _USERS if name in names)
        flag = f"`{option.flag}`" if option.is_switch else f"`{option.flag} {option.metavar}`"
        env = f"`{option.env}`" if option.env else ""
        cells = [flag, env, default, users, option.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _block(text: str) -> str:
    start = text.index(BEGIN) + len(BEGIN) + 1
    return text[start:text.index(END)]


def test_readme_starts_with_the_quickstart() -> None:
    assert README.read_text().startswith(QUICKSTART)


def test_options_table_matches_config() -> None:
    assert _block(README.read_text()) == render_options_table(), (
        "README options table is stale: run `python tests/test_readme.py --write`")


def test_options_table_covers_every_flag_of_both_daemons() -> None:
    table = _block(README.read_text())
    for name in (*config.SERVE_OPTIONS, *config.BOOTSTRAP_OPTIONS):
        option = config.OPTIONS[name]
        row = next(line for line in table.splitlines() if f"`{option.flag}" in line)
        assert option.env is None or f"`{option.env}`" in row


def _families() -> dict[str, tuple[str, ...]]:
    """Exposed name -> label names of every family metrics.py declares."""
    found = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        family = next(iter(metric.describe()))
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels = tuple(metric._labelnames) or (("version",) if family.type == "info" else ())
        found[family.name + suffix] = labels
    return found


def _metrics_rows() -> dict[str, str]:
    text = README.read_text()
    section = text[text.index("## Metrics"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(hyperlight_\w+)`", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_every_metric_family_is_documented_with_its_labels() -> None:
    rows = _metrics_rows()
    families = _families()
    assert len(families) == 14
    for name, labels in families.items():
        assert name in rows, f"{name} is not in the README metrics table"
        for label in labels:
            assert f"`{label}`" in rows[name], f"{name}: label {label} not documented"
    assert set(rows) == set(families), "the README documents metrics that do not exist"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_readme.py --write")
    text = README.read_text()
    README.write_text(text.replace(_block(text), render_options_table()))
