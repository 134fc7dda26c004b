"""deploy/components/monitoring against a real Prometheus (Debian's `prometheus` package, 2.x).

promtool lints both daemons' real /metrics output, checks the PrometheusRule's groups as
`kubectl kustomize` renders them and runs their unit tests (deploy/components/monitoring/tests);
a live Prometheus scrapes a running main daemon with those rules loaded and sees the
device-unhealthy alert go pending, fire and resolve when the CDI path is obstructed and freed.
Missing tools skip with what to install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import (
    HAVE_KVM,
    Node,
    documents,
    kustomize,
    needs_kvm,
    obstruct_with_directory,
    on_kubelet,
    tool,
    wait_until,
)

from hlplugin import cdi_spec
from hlplugin.tools.process import free_port, with_parent_death

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPONENT = DEPLOY / "components/monitoring"
OVERLAYS = ("overlays/kind", "overlays/aks")
OPERATIONS = ROOT / "docs/operations.md"
RUNBOOK = "https://github.com/hyperlight-dev/hlplugin/blob/main/docs/operations.md#"


def sh(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60, **kwargs)


def render(overlay: str, workdir: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of ``overlay`` with the monitoring component on top, as an operator's
    overlay would include it (kustomize wants relative paths)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(DEPLOY / overlay, workdir)],
        "components": [os.path.relpath(COMPONENT, workdir)],
    }))
    return documents(kustomize(workdir))


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The PrometheusRule's spec (its groups) as rendered on the KIND overlay."""
    rule = only(render("overlays/kind", tmp_path_factory.mktemp("render")), "PrometheusRule")
    spec: dict[str, Any] = rule["spec"]
    return spec


def alerts(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in spec["groups"]:
        yield from (r for r in group["rules"] if "alert" in r)


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces to -."""
    anchors = set()
    for line in markdown.splitlines():
        match = re.match(r"#+\s+(.*)", line)
        if match:
            text = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def subject(series: str) -> str | None:
    """What an input series of the unit tests is about: its node, else its DaemonSet."""
    for label in ("node", "daemonset"):
        match = re.search(label + r'="([^"]+)"', series)
        if match:
            return match.group(1)
    return None


# --- the component ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_component_renders_on_every_overlay(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay, tmp_path)
    monitor = only(objects, "PodMonitor")
    rule = only(objects, "PrometheusRule")
    for obj in (monitor, rule):
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert obj["metadata"]["namespace"] == "hyperlight-system"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expression["operator"] == "In"
    daemonsets = [o for o in objects if o["kind"] == "DaemonSet"]
    assert len(daemonsets) == 2
    for ds in daemonsets:
        # The PodMonitor selects each DaemonSet's pods and scrapes the port its probes use.
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert labels[expression["key"]] in expression["values"], ds["metadata"]["name"]
        (container,) = ds["spec"]["template"]["spec"]["containers"]
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["port"] == endpoint["port"]
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets == {"node": ["__meta_kubernetes_pod_node_name"],
                       "daemonset": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]}
    assert monitor["metadata"]["name"] == rule["metadata"]["name"] == "hyperlight"
    without = kustomize(DEPLOY / overlay)
    assert "PodMonitor" not in without and "PrometheusRule" not in without, "off by default"
    assert [o for o in objects if o not in (monitor, rule)] == [d for d in yaml.safe_load_all(without) if d]


def test_every_alert_names_node_severity_and_runbook(rules: dict[str, Any]) -> None:
    anchors = heading_anchors(OPERATIONS.read_text())
    names = []
    for rule in alerts(rules):
        names.append(rule["alert"])
        where = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), where
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, where
        assert "{{ $labels.node }}" in notes["summary"] or "any node" in notes["summary"], where
        assert notes["runbook_url"] == RUNBOOK + rule["alert"].lower(), where
        assert rule["alert"].lower() in anchors, f"docs/operations.md has no heading {where}"
    assert len(names) == len(set(names))
    assert {"HyperlightDeviceUnhealthy", "HyperlightCDISpecRepairedRepeatedly",
            "HyperlightCapacityWithdrawn", "HyperlightRegistrationFailing",
            "HyperlightDaemonNotReady", "HyperlightDaemonRestarting"} <= set(names)


def test_promtool_checks_the_rendered_rules(rules: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = sh([tool("promtool"), "check", "rules", str(path)])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(list(alerts(rules)))} rules found" in output, output
    assert "WARNING" not in output.upper(), output


def test_promtool_unit_tests_one_per_alert(rules: dict[str, Any], tmp_path: Path) -> None:
    tests_file = COMPONENT / "tests/alerts.yaml"
    unit = yaml.safe_load(tests_file.read_text())
    assert unit["rule_files"] == ["rules.yaml"]
    tested: dict[str, int] = {}
    for case in unit["tests"]:
        names = {check["alertname"] for check in case["alert_rule_test"]}
        assert len(names) == 1, f"one alert per test: {names}"
        (name,) = names
        fired = [a for check in case["alert_rule_test"] for a in check["exp_alerts"]]
        assert fired, f"{name}: the test never shows it firing"
        # It fires for one node (or DaemonSet) only: the others in the series stay silent.
        series = {subject(s["series"]) for s in case["input_series"]} - {None}
        firing = {a["exp_labels"].get("node", a["exp_labels"].get("daemonset")) for a in fired}
        assert len(firing) == 1 and series - firing, f"{name}: no healthy node to stay silent on"
        tested[name] = tested.get(name, 0) + 1
    assert tested == {rule["alert"]: 1 for rule in alerts(rules)}
    shutil.copy(tests_file, tmp_path / "alerts.yaml")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    result = sh([tool("promtool"), "test", "rules", "alerts.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# --- the daemons' /metrics ------------------------------------------------------------------------


@pytest.mark.parametrize("daemon", ["serve", "bootstrap"])
async def test_promtool_finds_nothing_in_the_metrics(daemon: str, tmp_path: Path) -> None:
    promtool = tool("promtool")

    node = Node.make(tmp_path)
    args = node.serve_args() if daemon == "serve" else [
        "bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(node.dev_dir)]
    resource = "hyperlight.dev/hypervisor" if daemon == "serve" else "hyperlight.dev/device-access"
    async with on_kubelet(node, args) as (kubelet, proc):
        if HAVE_KVM:  # registered and advertising: every family has moved at least once
            await kubelet.wait_for(lambda: kubelet.allocatable(resource) > 0)
        text = await proc.wait_http("/metrics", 200)
    assert b"hyperlight_registrations_total" in text and b"process_resident_memory_bytes" in text
    result = sh([promtool, "check", "metrics"], input=text.decode())
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", (
        result.stdout + result.stderr)


# --- a live Prometheus ----------------------------------------------------------------------------


class Prometheus:
    """A Prometheus server of our own: temporary config and storage, loopback only."""

    def __init__(self, workdir: Path, target_port: int, rules: dict[str, Any]) -> None:
        self.port = free_port()
        self.workdir = workdir
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{
                "job_name": "hyperlight",
                "static_configs": [{
                    "targets": [f"127.0.0.1:{target_port}"],
                    # What the component's PodMonitor relabelings add in a cluster.
                    "labels": {"node": "test-node", "daemonset": "hyperlight-device-plugin"},
                }],
            }],
        }))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(with_parent_death([
            tool("prometheus"), f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ]), stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def api(self, path: str) -> Any:
        """The ``data`` of a /api/v1 answer, or None while the server is not up."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}", timeout=5) as r:
                return json.load(r)["data"]
        except (urllib.error.URLError, ConnectionError):
            assert self.proc is not None and self.proc.poll() is None, self.output()
            return None

    def value(self, query: str) -> float | None:
        """The value of an instant query that returns one sample, else None."""
        data = self.api(f"query?query={urllib.parse.quote(query)}")
        return float(data["result"][0]["value"][1]) if data and data["result"] else None

    def output(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")


@needs_kvm
@pytest.mark.guard(60)
async def test_live_prometheus_fires_and_resolves_device_unhealthy(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    tool("prometheus")
    alert = "HyperlightDeviceUnhealthy"
    live = json.loads(json.dumps(rules))  # a copy: the shipped rules keep their 5 minutes
    (target,) = [r for r in alerts(live) if r["alert"] == alert]
    target["for"] = "3s"

    node = Node.make(tmp_path / "node")
    spec = node.cdi_dir / cdi_spec.SPEC_FILE
    async with on_kubelet(node, node.serve_args("--device-count", "4")) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable("hyperlight.dev/hypervisor") == 4)
        prometheus = Prometheus(tmp_path, proc.port, live)

        def states() -> list[str]:
            data = prometheus.api("alerts")
            return [a["state"] for a in (data["alerts"] if data else [])
                    if a["labels"]["alertname"] == alert and a["labels"]["node"] == "test-node"]

        prometheus.start()
        try:
            started = time.monotonic()
            await wait_until(lambda: prometheus.value("hyperlight_devices_healthy") == 4,
                             timeout=30)
            assert states() == []
            marks = {"start to healthy in Prometheus": time.monotonic() - started}

            # Obstruct: a directory where the spec belongs.
            obstruct_with_directory(spec)
            obstructed = time.monotonic()
            seen: list[str] = []

            def firing() -> bool:
                now = states()
                seen.extend(s for s in now if not seen or seen[-1] != s)
                return now == ["firing"]

            await wait_until(firing, timeout=20)
            assert seen[0] == "pending" and seen[-1] == "firing", seen
            marks["obstruction to firing"] = time.monotonic() - obstructed

            spec.rmdir()
            freed = time.monotonic()
            await wait_until(lambda: states() == [], timeout=20)
            marks["freed to resolved"] = time.monotonic() - freed
            assert prometheus.value("hyperlight_devices_healthy") == 4
        finally:
            prometheus.stop()
    print(f"live alert timings (s): {marks}")


@needs_kvm
@pytest.mark.guard(120)
async def test_live_prometheus_alerts_on_a_kubelet_gone_or_refusing_not_on_a_restart(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    """A kubelet restart fires nothing; a kubelet that stays gone withdraws the capacity
    (HyperlightCapacityWithdrawn), and one that refuses registration fires
    HyperlightRegistrationFailing; both resolve once a kubelet takes the registration again."""
    tool("prometheus")
    names = ("HyperlightCapacityWithdrawn", "HyperlightRegistrationFailing")
    live = json.loads(json.dumps(rules))
    for rule in alerts(live):
        if rule["alert"] in names:
            rule["for"] = "2s"
    resource = "hyperlight.dev/hypervisor"
    node = Node.make(tmp_path / "node")
    async with on_kubelet(node, node.serve_args("--device-count", "4")) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(resource) == 4)
        prometheus = Prometheus(tmp_path, proc.port, live)

        def states() -> dict[str, str]:
            data = prometheus.api("alerts")
            return {a["labels"]["alertname"]: a["state"] for a in (data["alerts"] if data else [])
                    if a["labels"]["alertname"] in names}

        prometheus.start()
        try:
            await wait_until(lambda: prometheus.value("hyperlight_listandwatch_streams") == 1,
                             timeout=30)
            # A restart within the daemon's 30 s wait: nothing fires, nothing is counted.
            await kubelet.restart(down=4.0)
            await kubelet.wait_for(lambda: kubelet.allocatable(resource) == 4, 30)
            await wait_until(lambda: prometheus.value(
                'hyperlight_registrations_total{result="success"}') == 2, timeout=30)
            assert prometheus.value('hyperlight_registrations_total{result="failure"}') == 0
            # Never even pending over the restart (ALERTS keeps every evaluation's state).
            assert prometheus.value(
                'max_over_time(ALERTS{alertname="HyperlightRegistrationFailing"}[5m])') is None

            # Gone for good (its dead kubelet.sock stays): the capacity is withdrawn.
            await kubelet.stop()
            await wait_until(lambda: states().get("HyperlightCapacityWithdrawn") == "firing",
                             timeout=30)
            assert "HyperlightRegistrationFailing" not in states(), "counted within the wait"

            # A kubelet that refuses every registration: registration truly failing.
            kubelet.mode = "reset"
            await kubelet.start()
            await wait_until(lambda: states().get("HyperlightRegistrationFailing") == "firing",
                             timeout=30)

            # A working kubelet again: both resolve.
            await kubelet.stop()
            kubelet.mode = "normal"
            await kubelet.start()
            await kubelet.wait_for(lambda: kubelet.allocatable(resource) == 4, 30)
            await wait_until(lambda: states() == {}, timeout=30)
        finally:
            prometheus.stop()
