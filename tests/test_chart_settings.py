"""The chart's config.* values are the daemons' own settings (hlplugin.settings, the single source):
the same names, defaults and ranges, each reaching the daemons that take it; a duration the
daemons would ignore fails the render naming it and its range; and the defaults written in the
chart, deploy/base and the docs are the daemons'. helm comes from .ci/run; without it these skip."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import documents, helm_template, tool
from support.chart import (
    BOOTSTRAP,
    CHART,
    DEPLOY,
    DRA,
    DRA_ON,
    MAIN,
    ROOT,
    SCHEMA,
    SETTINGS,
    SUBCOMMAND_OPTIONS,
    VALUES,
    camel,
    daemon_default,
    daemon_duration_ranges,
    daemon_integer_ranges,
    daemon_parse,
    daemonsets,
    env,
    render,
)
from support.deploy import NAMESPACE

from hlplugin import config, durations

pytestmark = pytest.mark.deploy


# --- config.*: the daemons' own settings ----------------------------------------------------------


def test_config_values_are_the_daemons_settings_with_their_defaults() -> None:
    """Every setting of either daemon that the chart does not set itself is a config value, named
    in camelCase after its flag, and its default renders what the daemon's parser reads as the
    daemon's own default (a setting added to the daemons and not to the chart fails here). The
    DRA driver on: its DaemonSet is judged with the other two."""
    assert set(VALUES["config"]) == {camel(d) for d in SETTINGS}
    for dest in SETTINGS:
        assert config.OPTIONS[dest].flag == "--" + dest.replace("_", "-")
    rendered = daemonsets(render(DRA_ON))
    assert set(rendered) == set(SUBCOMMAND_OPTIONS)
    for dest in SETTINGS:
        option = config.OPTIONS[dest]
        for name, ds in rendered.items():
            takes = dest in SUBCOMMAND_OPTIONS[name]
            assert (option.env in env(ds)) == takes, f"{name}: {option.env}"
            if takes:
                read = daemon_parse(dest, env(ds)[option.env])
                assert read == daemon_default(dest), f"{name}: {option.env}"


def other_value(dest: str) -> Any:
    """A valid value other than the default, taken from the schema."""
    schema, default = SCHEMA["properties"]["config"]["properties"][camel(dest)], VALUES["config"][camel(dest)]
    if "enum" in schema:
        return next(v for v in reversed(schema["enum"]) if v != default)
    if schema.get("type") == "boolean":
        return not default
    if schema.get("type") == "integer":
        return schema["maximum"]  # the edge of the range renders exactly (no 4.29e+09)
    (number,) = [s for s in schema["oneOf"] if s["type"] == "number"]
    return number["maximum"]


@pytest.mark.parametrize("dest", SETTINGS)
def test_config_value_reaches_the_daemons_that_take_it(dest: str) -> None:
    option, value = config.OPTIONS[dest], other_value(dest)
    rendered = daemonsets(render({**DRA_ON, "config": {camel(dest): value}}))
    assert DRA in rendered
    for name, ds in rendered.items():
        if dest in SUBCOMMAND_OPTIONS[name]:
            parsed = daemon_parse(dest, env(ds)[option.env])
            assert parsed == value and parsed != daemon_default(dest), f"{name}: {env(ds)[option.env]!r}"
        else:
            assert option.env not in env(ds), name


def test_config_duration_with_a_unit_renders_as_given() -> None:
    rendered = daemonsets(render({"config": {"cdiInterval": "1m", "probeTimeout": "500ms"}}))
    assert env(rendered[MAIN])["HYPERLIGHT_CDI_INTERVAL"] == "1m"
    assert env(rendered[MAIN])["HYPERLIGHT_PROBE_TIMEOUT"] == "500ms"


def test_schema_bounds_are_the_daemons() -> None:
    """The schema's bounds and choices are the daemons': each range (the accessors at the top),
    both of its ends accepted by the daemons' parser, and each enum as the parser lists it."""
    props = SCHEMA["properties"]["config"]["properties"]
    ranges = {**daemon_integer_ranges(), **daemon_duration_ranges()}
    for dest in SETTINGS:
        schema = props[camel(dest)]
        if "enum" in schema:  # the parser's choices, as its refusal lists them
            with pytest.raises(ValueError) as refused:
                daemon_parse(dest, "not-a-choice")
            listed = re.search(r"one of (.*), got", str(refused.value))
            assert listed and listed.group(1).split(", ") == schema["enum"], dest
        bounded = [s for s in [schema, *schema.get("oneOf", [])] if "maximum" in s]
        assert bool(bounded) == (dest in ranges), dest
        for number in bounded:
            assert (number["minimum"], number["maximum"]) == ranges[dest], dest
            daemon_parse(dest, str(number["minimum"]))
            daemon_parse(dest, str(number["maximum"]))


# --- durations: refused at render when the daemons would ignore them ------------------------------

LIMITS = yaml.safe_load((CHART / "files/limits.yaml").read_text())["durations"]
DURATIONS = sorted(daemon_duration_ranges())


def test_the_chart_s_duration_ranges_are_the_daemons() -> None:
    """files/limits.yaml (what the template compares with) and the schema's bounds of a number of
    seconds both carry the daemons' ranges, and the range the refusal prints is the one their
    --help prints."""
    assert set(LIMITS) == {camel(dest) for dest in DURATIONS}
    props = SCHEMA["properties"]["config"]["properties"]
    for dest in DURATIONS:
        low, high = daemon_duration_ranges()[dest]
        limit = LIMITS[camel(dest)]
        assert (limit["min"], limit["max"]) == (low, high), dest
        assert limit["shown"] == f"{durations.show(low)}-{durations.show(high)}", dest
        assert limit["shown"] in config.OPTIONS[dest].help, dest
        (number,) = [s for s in props[camel(dest)]["oneOf"] if s["type"] == "number"]
        assert (number["minimum"], number["maximum"]) == (low, high), dest


def beyond(seconds: float, unit: str, step: float) -> str:
    """``seconds`` written in ``unit`` (ms, s, m, h) and moved by ``step`` of that unit."""
    size = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]
    return f"{round(seconds / size + step, 6):g}{unit}"


@pytest.mark.parametrize("dest", DURATIONS)
def test_an_out_of_range_duration_fails_the_render_naming_it_and_its_range(dest: str) -> None:
    """`config.cdiInterval=2h` used to install and be ignored (the daemon warned and ran 10 s):
    now `helm template`/`install` fails, and says which value and what range. Just inside the
    range, in a unit other than seconds, renders."""
    low, high = daemon_duration_ranges()[dest]
    shown = LIMITS[camel(dest)]["shown"]
    for bad in (beyond(high, "m", 0.5), beyond(low, "ms", -1)):
        with pytest.raises(ValueError):
            daemon_parse(dest, bad)  # the daemon would refuse it too
        result = helm_template(CHART, NAMESPACE, {"config": {camel(dest): bad}})
        assert result.returncode != 0, f"helm accepted {camel(dest)}={bad}"
        assert f"config.{camel(dest)}={bad} is out of range: {shown}" in result.stderr, result.stderr
    edges = {"high": beyond(high, "m", 0), "low": beyond(low, "ms", 0)}
    rendered = daemonsets(render({"config": {camel(dest): edges["high"]}}))
    assert env(rendered[MAIN])[config.OPTIONS[dest].env] == edges["high"]
    render({"config": {camel(dest): edges["low"]}})


def duration_cases(low: float, high: float) -> list[str]:
    """Durations around both bounds of a range, in every unit and without one, and a spread of
    others: where a parser that compared in the wrong unit, or off by one step, would differ."""
    cases = {"0", "0s", "10", "10s", "1.5m", "000000000000000000001s", "1" + "0" * 20 + "ms"}
    for bound in (low, high):
        for unit in ("ms", "s", "m", "h"):
            for step in (0, 1e-6, -1e-6, 1e-3, -1e-3, 1, -1):
                cases.add(beyond(bound, unit, step))
        cases.add(f"{bound:g}")
    rng = random.Random(29)
    for _ in range(120):
        whole = str(rng.choice([rng.randrange(0, 10), rng.randrange(0, 5000)]))
        fraction = rng.choice(["", "." + str(rng.randrange(0, 10_000)).zfill(rng.randrange(1, 5))])
        cases.add(whole + fraction + rng.choice(["", "ms", "s", "m", "h"]))
    return sorted(c for c in cases if not c.startswith("-"))


def test_the_chart_and_the_daemons_agree_on_every_duration(tmp_path: Path) -> None:
    """The template's verdict ("hlplugin.durationProblem") against the daemons' own parser, on
    several hundred durations of each setting: the same ones pass, the same ones are refused. One
    render of a copy of the chart with a template that only asks the helper."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    cases = [[camel(dest), text] for dest in DURATIONS
             for text in duration_cases(*daemon_duration_ranges()[dest])]
    numbers = [[camel(dest), value] for dest in DURATIONS for bound in daemon_duration_ranges()[dest]
               for value in (bound, bound - 0.001, bound + 0.001)]
    (chart / "files/cases.json").write_text(json.dumps(cases + numbers))
    (chart / "templates/verdicts.yaml").write_text(
        '{{- $out := list }}{{- range $c := .Files.Get "files/cases.json" | fromJsonArray }}'
        '{{- $out = append $out (include "hlplugin.durationProblem" (list $ (index $c 0) (index $c 1))) }}'
        '{{- end }}\nverdicts: {{ toJson $out | quote }}\n')
    result = subprocess.run([tool("helm"), "template", "x", str(chart), "--show-only",
                             "templates/verdicts.yaml"], capture_output=True, text=True,
                            timeout=100, check=False)
    assert result.returncode == 0, result.stderr
    verdicts = json.loads(yaml.safe_load(result.stdout)["verdicts"])
    assert len(verdicts) == len(cases) + len(numbers) > 400
    disagree, refused = [], 0
    for (name, value), problem in zip(cases + numbers, verdicts, strict=True):
        dest = next(d for d in DURATIONS if camel(d) == name)
        try:
            daemon_parse(dest, value if isinstance(value, str) else repr(value))
            daemon_ok = True
        except ValueError:
            daemon_ok = False
        refused += not daemon_ok
        if daemon_ok != (problem == ""):
            disagree.append(f"{name}={value!r}: daemon {'accepts' if daemon_ok else 'refuses'}, "
                            f"chart says {problem!r}")
        elif problem:
            assert problem.startswith(f"config.{name}={value} is "), problem
    assert not disagree, "\n".join(disagree)
    assert 0.2 < refused / len(verdicts) < 0.8, "both verdicts are well represented"


# --- the defaults written down in the chart and in deploy/base are the daemons' ---------------------


def test_defaults_in_values_base_and_docs_are_the_daemons() -> None:
    """Every config.* default in values.yaml, and every setting deploy/base's DaemonSets write,
    read by the daemons' own parser, is the daemons' default (the device count's 2000 among them);
    the docs that state the device count say the same, and the capacity as kubectl prints it."""
    for dest in SETTINGS:
        written = VALUES["config"][camel(dest)]
        text = str(written).lower() if isinstance(written, bool) else str(written)
        assert daemon_parse(dest, text) == daemon_default(dest), f"values.yaml config.{camel(dest)}"
    base = {o["metadata"]["name"]: o for path in sorted((DEPLOY / "base").glob("*.yaml"))
            for o in documents(path.read_text()) if o["kind"] == "DaemonSet"}
    by_env = {config.OPTIONS[dest].env: dest for dest in SETTINGS}
    checked = 0
    for name, ds in base.items():
        for var, text in env(ds).items():
            if var in by_env:
                assert daemon_parse(by_env[var], text) == daemon_default(by_env[var]), f"{name}: {var}"
                checked += 1
    assert checked == sum(len(set(SUBCOMMAND_OPTIONS[n]) & set(SETTINGS)) for n in (MAIN, BOOTSTRAP))
    count = daemon_default("device_count")
    operations = (ROOT / "docs/operations.md").read_text()
    assert f"`DEVICE_COUNT` (default {count})" in operations
    assert f"`DEVICE_COUNT` per node ({count})" in (ROOT / "docs/architecture.md").read_text()
    assert count % 1000 == 0 and f"`hyperlight.dev/hypervisor: {count // 1000}k`" in operations, (
        "kubectl prints the quantity canonically")
