"""The chart's monitoring of the DRA driver (issue 41 item 4), with promtool (Debian's
`prometheus` package): the PodMonitor scrapes the driver's pods; its alerts (a group of their
own, files/prometheus-rules-dra.yaml) pass `promtool check rules` beside the device plugins', each
names node, severity and a runbook in docs/dra.md, and each has a unit test
(tests/data/dra-alerts.yaml); and no device-plugin alert fires on a driver pod: the device
plugins' own unit tests (deploy/components/monitoring/tests/alerts.yaml), their series relabelled
as the driver's, fire none of them. Missing tools skip with what to install."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import tool
from support.chart import DRA_ON, TOGGLES, Objects, container, daemonsets, merged, render
from support.deploy import BOOTSTRAP, DRA, MAIN, ROOT

pytestmark = pytest.mark.prometheus

DOCS = ROOT / "docs/dra.md"
RUNBOOK = "https://github.com/hyperlight-dev/hlplugin/blob/main/docs/dra.md#"
UNIT_TESTS = ROOT / "tests/data/dra-alerts.yaml"
DEVICE_PLUGIN_TESTS = ROOT / "deploy/components/monitoring/tests/alerts.yaml"
WITH_DRA = merged(TOGGLES, DRA_ON)


def only(objs: Objects, kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def groups(objs: Objects) -> dict[str, list[dict[str, Any]]]:
    """The rendered PrometheusRule's alerts, by group."""
    return {g["name"]: g["rules"] for g in only(objs, "PrometheusRule")["spec"]["groups"]}


def promtool(*args: str, cwd: Path) -> str:
    result = subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60,
                            check=False, cwd=cwd)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def heading_anchors(markdown: str) -> set[str]:
    return {re.sub(r"[^\w\- ]", "", m.strip().lower()).replace(" ", "-")
            for m in re.findall(r"^#+\s+(.*)$", markdown, re.M)}


def test_the_pod_monitor_scrapes_the_driver_s_pods() -> None:
    objs = render(WITH_DRA)
    monitor = only(objs, "PodMonitor")
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for name, ds in daemonsets(objs).items():
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert labels[expression["key"]] in expression["values"], name
        assert container(ds)["readinessProbe"]["httpGet"]["port"] == endpoint["port"], name
    assert set(expression["values"]) == {MAIN, BOOTSTRAP, DRA}
    # The relabelling gives the driver's series daemonset="hyperlight-dra", which its alerts select.
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
            "targetLabel": "daemonset"} in endpoint["relabelings"]
    off = only(render(TOGGLES), "PodMonitor")["spec"]["selector"]["matchExpressions"][0]["values"]
    assert DRA not in off and "hyperlight-dra" not in groups(render(TOGGLES))


def test_every_dra_alert_selects_the_driver_names_node_severity_and_runbook() -> None:
    rendered = groups(render(WITH_DRA))
    anchors = heading_anchors(DOCS.read_text())
    dra = rendered["hyperlight-dra"]
    assert len(dra) >= 6
    for rule in dra:
        where = rule["alert"]
        assert where.startswith("HyperlightDRA") and 'daemonset="hyperlight-dra"' in rule["expr"], where
        assert rule["labels"]["severity"] in ("critical", "warning"), where
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, where
        assert "{{ $labels.node }}" in rule["annotations"]["summary"], where
        assert rule["annotations"]["runbook_url"] == RUNBOOK + where.lower(), where
        assert where.lower() in anchors, f"docs/dra.md has no heading {where}"
    # The device plugins' alerts never select the driver (the next test shows none fires on it).
    for name, rules in rendered.items():
        if name != "hyperlight-dra":
            assert not [r for r in rules if DRA in r["expr"]], name


def write_rules(objs: Objects, workdir: Path) -> dict[str, Any]:
    spec: dict[str, Any] = only(objs, "PrometheusRule")["spec"]
    (workdir / "rules.yaml").write_text(yaml.safe_dump(spec))
    return spec


def test_promtool_checks_the_rules_and_unit_tests_one_per_dra_alert(tmp_path: Path) -> None:
    spec = write_rules(render(WITH_DRA), tmp_path)
    count = sum(len(g["rules"]) for g in spec["groups"])
    output = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert f"SUCCESS: {count} rules found" in output and "WARNING" not in output.upper(), output
    unit = yaml.safe_load(UNIT_TESTS.read_text())
    tested: dict[str, int] = {}
    for case in unit["tests"]:
        (name,) = {check["alertname"] for check in case["alert_rule_test"]}
        fired = [a for check in case["alert_rule_test"] for a in check["exp_alerts"]]
        assert fired and {a["exp_labels"]["node"] for a in fired} == {"n1"}, name
        nodes = {m for s in case["input_series"] for m in re.findall(r'node="([^"]+)"', s["series"])}
        assert nodes - {"n1"}, f"{name}: no healthy node to stay silent on"
        tested[name] = tested.get(name, 0) + 1
    assert tested == {r["alert"]: 1 for g in spec["groups"] if g["name"] == "hyperlight-dra"
                      for r in g["rules"]}
    shutil.copy(UNIT_TESTS, tmp_path / "dra-alerts.yaml")
    assert "SUCCESS" in promtool("test", "rules", "dra-alerts.yaml", cwd=tmp_path)


def as_the_driver(unit: dict[str, Any], alerts: set[str]) -> Iterator[dict[str, Any]]:
    """The device plugins' unit tests with every series of theirs the driver's (its DaemonSet and
    pods' names), each expecting its alert silent at every evaluation."""
    for case in unit["tests"]:
        case = copy.deepcopy(case)
        for series in case["input_series"]:
            series["series"] = re.sub(r"hyperlight-device-(plugin|access)", DRA, series["series"])
        for check in case["alert_rule_test"]:
            assert check["alertname"] in alerts, check["alertname"]
            check["exp_alerts"] = []
        yield case


def test_no_device_plugin_alert_fires_on_a_driver_pod(tmp_path: Path) -> None:
    """The driver exports the device plugins' families (it never has a ListAndWatch stream, never
    advertises devices, counts its own registrations, repairs the same CDI spec): fed exactly the
    series that fire each device-plugin alert, under the driver's names, none fires. The same
    series under the device plugins' names fire each one (their own unit tests), so the silence
    is the selectors'."""
    spec = write_rules(render(WITH_DRA), tmp_path)
    device_plugin = {r["alert"] for g in spec["groups"] if g["name"] == "hyperlight" for r in g["rules"]}
    unit = yaml.safe_load(DEVICE_PLUGIN_TESTS.read_text())
    silent = {**unit, "tests": list(as_the_driver(unit, device_plugin))}
    assert len(silent["tests"]) == len(device_plugin)
    (tmp_path / "silent.yaml").write_text(yaml.safe_dump(silent))
    assert "SUCCESS" in promtool("test", "rules", "silent.yaml", cwd=tmp_path)
    shutil.copy(DEVICE_PLUGIN_TESTS, tmp_path / "alerts.yaml")
    assert "SUCCESS" in promtool("test", "rules", "alerts.yaml", cwd=tmp_path)
