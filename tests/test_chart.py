"""The Helm chart, deploy/chart/hlplugin (issue 19), judged by the real helm: `helm lint --strict`,
the schema's refusals, every value's effect on the objects it names, one source of truth with
deploy/base (the chart's default rendering and kustomize's must be the same objects), and the
analysers of tests/test_deploy.py on its renderings. helm comes from .ci/run (.tools/bin); without
it these tests skip and say so.

`python tests/test_chart.py --write` regenerates the values table in the chart's README."""

from __future__ import annotations

import difflib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import documents, helm_template, kustomize, tool
from test_deploy import (
    CHECKOV_ENV,
    NAMESPACE,
    check_plugin_daemonsets,
    env_of,
    mib,
    millicores,
    restricted_violations,
)

from hlplugin import config, durations
from hlplugin.settings import ServeSettings

pytestmark = pytest.mark.deploy


# --- the daemons' own ranges and defaults, read in one place -------------------------------------
# hlplugin.config is being regrouped: when its names move, repoint these and nothing else.


def daemon_duration_ranges() -> dict[str, tuple[float, float]]:
    """Each duration setting's range in seconds (both bounds allowed), by its option name."""
    from hlplugin.settings import INTERVAL_RANGE, TIMEOUT_RANGE

    return {"cdi_interval": INTERVAL_RANGE, "health_interval": INTERVAL_RANGE,
            "probe_timeout": TIMEOUT_RANGE, "register_timeout": TIMEOUT_RANGE}


def daemon_integer_ranges() -> dict[str, tuple[int, int]]:
    """Each whole-number setting's range (both bounds allowed), by its option name."""
    from hlplugin.settings import MAX_DEVICE_COUNT, UINT32_MAX

    return {"device_count": (1, MAX_DEVICE_COUNT), "device_uid": (0, UINT32_MAX),
            "device_gid": (0, UINT32_MAX)}


def daemon_parse(dest: str, text: str) -> Any:
    """The setting as the daemons read it from their environment; ValueError where they refuse it."""
    return config.OPTIONS[dest].parse(text)


def daemon_default(dest: str) -> Any:
    """The daemons' default of a setting: its hlplugin.settings field's (the main daemon's)."""
    return config.value_at(ServeSettings(), config.OPTIONS[dest].path)


ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/chart/hlplugin"
DEPLOY = ROOT / "deploy"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
BOOTSTRAP, MAIN = "hyperlight-device-access", "hyperlight-device-plugin"
TEST_POD = "hyperlight-test-vm"  # templates/tests/vm-check.yaml, what `helm test` runs
SUBCOMMAND_OPTIONS = {MAIN: config.SERVE_OPTIONS, BOOTSTRAP: config.BOOTSTRAP_OPTIONS}
# Every toggle on (networkPolicy and admissionPolicy are on by default).
TOGGLES = {"namespace": {"create": True},
           "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
CRD_GROUP = "monitoring.coreos.com/"
# The daemons' settings the chart sets itself, to match its mounts, probes and network policies;
# every other setting of either daemon is a config.* value.
CHART_OWNED = {"plugin_dir", "cdi_dir", "dev_dir", "host_dev_dir", "http_address"}
SETTINGS = sorted((set(config.SERVE_OPTIONS) | set(config.BOOTSTRAP_OPTIONS)) - CHART_OWNED)

Objects = list[dict[str, Any]]


def camel(dest: str) -> str:
    first, *rest = dest.split("_")
    return first + "".join(part.title() for part in rest)


def render(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> Objects:
    result = helm_template(CHART, namespace, values)
    assert result.returncode == 0, result.stderr
    return documents(result.stdout)


def refusal(values: dict[str, Any]) -> str:
    result = helm_template(CHART, NAMESPACE, values)
    assert result.returncode != 0, f"helm accepted {values}"
    assert "don't meet the specifications of the schema" in result.stderr, result.stderr
    return result.stderr


def nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    for key in reversed(path.split(".")):
        value = {key: value}
    return value  # type: ignore[no-any-return]


def merged(*trees: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tree in trees:
        for key, value in tree.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if both else value
    return out


def default_of(path: str) -> Any:
    node: Any = VALUES
    for key in path.split("."):
        node = node[key]
    return node


def leaves(node: dict[str, Any] = SCHEMA, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted name, schema) of every value: a schema node without `properties`."""
    for key, child in node["properties"].items():
        name = f"{prefix}{key}"
        if "properties" in child:
            yield from leaves(child, name + ".")
        else:
            yield name, child


def closed_objects(node: dict[str, Any] = SCHEMA, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, schema) of every object whose keys the schema names."""
    if "properties" in node or "propertyNames" in node:
        yield pointer, node
    for key, child in node.get("properties", {}).items():
        yield from closed_objects(child, f"{pointer}/{key}")


def daemonsets(objs: Objects) -> dict[str, dict[str, Any]]:
    found = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    assert set(found) == {BOOTSTRAP, MAIN}, found.keys()
    return found


def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod(ds)["containers"]
    return only  # type: ignore[no-any-return]


def env(ds: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(ds)["env"]}


def host_paths(ds: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod(ds)["volumes"]}


def hooks(objs: Objects) -> Objects:
    """The objects only `helm test` (or another hook) creates, not `helm install`."""
    return [o for o in objs if "helm.sh/hook" in o["metadata"].get("annotations", {})]


def installed(objs: Objects) -> Objects:
    return [o for o in objs if o not in hooks(objs)]


def kinds(objs: Objects) -> set[str]:
    return {o["kind"] for o in objs}


def index(objs: Objects) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        assert key not in out, f"two {key}"
        out[key] = o
    return out


def kustomized(workdir: Path, *components: str, deploy: Path = DEPLOY) -> Objects:
    """deploy/base with ``components``, as an operator's overlay would put them together."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(deploy / "base", workdir)],
        "components": [os.path.relpath(deploy / "components" / c, workdir) for c in components],
    }))
    return documents(kustomize(workdir))


# --- one source of truth --------------------------------------------------------------------------

SAME_AS_KUSTOMIZE = {  # case: (chart values, kustomize components, the Namespace only kustomize has)
    "defaults": ({}, ("reserve-device-access",), True),
    "namespace.create": ({"namespace": {"create": True}}, ("reserve-device-access",), False),
    "every toggle": (TOGGLES, ("reserve-device-access", "monitoring"), False),
}


def differences(chart: Objects, kustomize_objs: Objects) -> list[str]:
    ours, theirs = index(chart), index(kustomize_objs)
    out = [f"only the chart renders {k}" for k in ours.keys() - theirs.keys()]
    out += [f"only kustomize renders {k}" for k in theirs.keys() - ours.keys()]
    for key in sorted(ours.keys() & theirs.keys()):
        if ours[key] != theirs[key]:
            diff = difflib.unified_diff(yaml.safe_dump(theirs[key]).splitlines(),
                                        yaml.safe_dump(ours[key]).splitlines(),
                                        "kustomize", "helm template", lineterm="")
            out.append(f"{key} differs:\n" + "\n".join(diff))
    return out


@pytest.mark.parametrize("case", SAME_AS_KUSTOMIZE)
def test_chart_renders_exactly_what_deploy_base_renders(case: str, tmp_path: Path) -> None:
    """The chart and deploy/base (with its components) are two renderings of one install: every
    object both produce must be equal, field for field, and neither may have one the other lacks.
    (The default leaves the namespace to `helm install --create-namespace`.) The `helm test` pod
    is the chart's alone: `helm install` does not create it."""
    values, components, drop_namespace = SAME_AS_KUSTOMIZE[case]
    theirs = kustomized(tmp_path, *components)
    if drop_namespace:
        theirs = [o for o in theirs if o["kind"] != "Namespace"]
    ours = render(values)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in hooks(ours)) == [
        ("NetworkPolicy", TEST_POD), ("Pod", TEST_POD)]
    found = differences(installed(ours), theirs)
    assert not found, "the chart and deploy/ drifted apart:\n" + "\n".join(found)


def test_drift_is_caught_whichever_side_changes(tmp_path: Path) -> None:
    """The comparison above is not vacuous: the same one-line edit to a copy of the chart alone, or
    to a copy of deploy/ alone, is found as exactly that difference."""
    edit = ("value: /host-dev\n", "value: /elsewhere\n")  # HYPERLIGHT_HOST_DEV_DIR of the main daemon
    shutil.copytree(CHART, tmp_path / "chart")
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("chart"))
    for path in (tmp_path / "chart/templates/device-plugin.yaml",
                 tmp_path / "deploy/base/device-plugin.yaml"):
        assert path.read_text().count(edit[0]) == 1, path
        path.write_text(path.read_text().replace(*edit))

    def kustomize_objects(deploy: Path, workdir: str) -> Objects:
        objs = kustomized(tmp_path / workdir, "reserve-device-access", deploy=deploy)
        return [o for o in objs if o["kind"] != "Namespace"]

    edited_chart = helm_template(tmp_path / "chart", NAMESPACE)
    assert edited_chart.returncode == 0, edited_chart.stderr
    for ours, theirs in ((installed(documents(edited_chart.stdout)), kustomize_objects(DEPLOY, "k1")),
                         (installed(render()), kustomize_objects(tmp_path / "deploy", "k2"))):
        found_all = differences(ours, theirs)
        assert len(found_all) == 1, "\n".join(found_all)
        (found,) = found_all
        assert found.startswith(f"('DaemonSet', '{NAMESPACE}', '{MAIN}') differs"), found
        changed = re.findall(r"^[-+]\s+value: (\S+)$", found, re.M)
        assert sorted(changed) == ["/elsewhere", "/host-dev"], found


# --- helm lint and the analysers, on the default rendering and with every toggle on ---------------

RENDERINGS = {"defaults": {}, "every toggle": TOGGLES}


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_helm_lint_strict(rendering: str, tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(RENDERINGS[rendering]))
    result = subprocess.run([tool("helm"), "lint", "--strict", "--namespace", NAMESPACE, str(CHART),
                             "--values", str(tmp_path / "values.yaml")],
                            capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0 and "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_chart_daemonsets_have_the_deploy_properties(rendering: str) -> None:
    """tests/test_deploy.py's checks of the DaemonSets (locked down, probes on the admitted port,
    resources from the measured peak, host paths, rollout), the environment read by the daemons'
    own parsers, on the chart's rendering."""
    objs = render(RENDERINGS[rendering])
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "NetworkPolicy"} <= kinds(objs)
    check_plugin_daemonsets(objs, f"chart ({rendering})")


@pytest.mark.parametrize("version", ["1.30", "1.34"])
def test_renderings_validate_against_kubernetes_schemas(version: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    count = 0
    for name, values in RENDERINGS.items():
        objs = render(values)
        (tmp_path / f"{name.replace(' ', '-')}.yaml").write_text(yaml.safe_dump_all(objs))
        count += sum(not o["apiVersion"].startswith(CRD_GROUP) for o in objs)
    result = subprocess.run([validate, "-k", version, "--strict", *map(str, sorted(tmp_path.iterdir()))],
                            capture_output=True, text=True, timeout=100, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("passed for resource") == count, output
    # The Prometheus Operator's kinds have no schema there: only they may be unchecked.
    unchecked = re.findall(r"Couldn't find schema for kind (\w+)", output)
    assert sorted(unchecked) == ["PodMonitor", "PrometheusRule"], output


def test_checkov_finds_nothing_in_the_renderings(tmp_path: Path) -> None:
    """Both renderings, and one with the image pinned by digest, which needs no CKV_K8S_43 skip."""
    checkov = tool("checkov")
    pinned = {"image": {"digest": "sha256:" + "0" * 64}}
    for name, values in {**RENDERINGS, "digest": pinned}.items():
        (tmp_path / f"{name.replace(' ', '-')}.yaml").write_text(yaml.safe_dump_all(render(values)))
    result = subprocess.run([checkov, "--directory", str(tmp_path), "--framework", "kubernetes",
                             "--skip-download", "--output", "json", "--compact"],
                            capture_output=True, text=True, timeout=110, check=False,
                            env={**os.environ, **CHECKOV_ENV})
    assert result.stdout.strip(), result.stderr
    report = json.loads(result.stdout)
    (report,) = report if isinstance(report, list) else [report]
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})"
              for c in report["results"]["failed_checks"]]
    assert report["summary"]["failed"] == 0, "\n".join(failed)
    assert report["summary"]["parsing_errors"] == 0 and report["summary"]["passed"] > 0
    for skipped in report["results"]["skipped_checks"]:
        reason = skipped["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20, skipped["check_id"]
        assert not (skipped["check_id"] == "CKV_K8S_43" and skipped["file_path"].endswith("digest.yaml"))


# --- every value: it takes effect, and a bad one is refused ---------------------------------------

DIGEST = "sha256:" + "ab" * 32
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
SNAP_PLUGINS = "/var/snap/microk8s/common" + PLUGIN_DIR


def on_both(check: Callable[[dict[str, Any]], bool]) -> Callable[[Objects], bool]:
    return lambda objs: all(check(ds) for ds in daemonsets(objs).values())


def image_is(reference: str) -> Callable[[Objects], bool]:
    return on_both(lambda ds: container(ds)["image"] == reference)


def resources_are(name: str, wanted: dict[str, Any]) -> Callable[[Objects], bool]:
    extra = {"hyperlight.dev/device-access": "1"} if name == MAIN else {}
    other = BOOTSTRAP if name == MAIN else MAIN
    expected = {k: {**v, **extra} for k, v in wanted.items()}
    return lambda objs: (container(daemonsets(objs)[name])["resources"] == expected
                         and container(daemonsets(objs)[other])["resources"] == container(
                             daemonsets(render())[other])["resources"])


def only_kind_missing(kind: str) -> Callable[[Objects], bool]:
    return lambda objs: kind not in kinds(objs) and kinds(render()) - kinds(objs) == {kind}


AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["hyperlight"]}]}]}}}
TOLERATIONS = [{"key": "dedicated", "operator": "Equal", "value": "hl", "effect": "NoSchedule"}]
PLUGIN_RESOURCES = {"requests": {"cpu": "20m", "memory": "80Mi"}, "limits": {"cpu": "1", "memory": "128Mi"}}
BOOTSTRAP_RESOURCES = {"requests": {"cpu": "5m", "memory": "50Mi"},
                       "limits": {"cpu": "100m", "memory": "80Mi"}}


def pod_meta(ds: dict[str, Any], field: str) -> dict[str, str]:
    return ds["spec"]["template"]["metadata"][field]  # type: ignore[no-any-return]


def unpinned(objs: Objects) -> bool:
    """The DaemonSets say why checkov's CKV_K8S_43 (image by digest) is skipped."""
    return any("checkov.io/skip3" in ds["metadata"]["annotations"] for ds in daemonsets(objs).values())


# value: (values that set it, what the rendering must then show)
CASES: dict[str, tuple[dict[str, Any], Callable[[Objects], bool]]] = {
    "image.registry": ({"image": {"registry": "registry.example:5000", "repository": "team/hlplugin"}},
                       image_is(f"registry.example:5000/team/hlplugin:{APP_VERSION}")),
    "image.repository": ({"image": {"repository": "localhost/hlplugin"}},
                         image_is(f"localhost/hlplugin:{APP_VERSION}")),
    "image.tag": ({"image": {"tag": "i19"}}, image_is("ghcr.io/hyperlight-dev/hlplugin:i19")),
    "image.digest": ({"image": {"tag": "ignored", "digest": DIGEST}},
                     lambda objs: image_is(f"ghcr.io/hyperlight-dev/hlplugin@{DIGEST}")(objs)
                     and not unpinned(objs)),
    "image.pullPolicy": ({"image": {"pullPolicy": "Always"}},
                         on_both(lambda ds: container(ds)["imagePullPolicy"] == "Always")),
    "imagePullSecrets": ({"imagePullSecrets": [{"name": "regcred"}]},
                         on_both(lambda ds: pod(ds)["imagePullSecrets"] == [{"name": "regcred"}])),
    "nodeSelector": ({"nodeSelector": {"pool": "hyperlight"}},  # added to the default's keys
                     on_both(lambda ds: pod(ds)["nodeSelector"]
                             == {**VALUES["nodeSelector"], "pool": "hyperlight"})),
    "affinity": ({"affinity": AFFINITY}, on_both(lambda ds: pod(ds)["affinity"] == AFFINITY)),
    "tolerations": ({"tolerations": TOLERATIONS}, on_both(lambda ds: pod(ds)["tolerations"] == TOLERATIONS)),
    "priorityClassName": ({"priorityClassName": ""}, on_both(lambda ds: "priorityClassName" not in pod(ds))),
    "podAnnotations": ({"podAnnotations": {"example.com/team": "vm", "prometheus.io/scrape": "false"}},
                       on_both(lambda ds: pod_meta(ds, "annotations")["example.com/team"] == "vm"
                               and pod_meta(ds, "annotations")["prometheus.io/scrape"] == "false")),
    "podLabels": ({"podLabels": {"team": "vm", "app.kubernetes.io/name": "mine"}},
                  on_both(lambda ds: pod_meta(ds, "labels")["team"] == "vm"
                          and pod_meta(ds, "labels")["app.kubernetes.io/name"]
                          == ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"])),
    "updateStrategy.type": ({"updateStrategy": {"type": "OnDelete"}},
                            on_both(lambda ds: ds["spec"]["updateStrategy"] == {"type": "OnDelete"})),
    "updateStrategy.rollingUpdate.maxUnavailable": (
        {"updateStrategy": {"rollingUpdate": {"maxUnavailable": 2}}},
        on_both(lambda ds: ds["spec"]["updateStrategy"]["rollingUpdate"]
                == {"maxUnavailable": 2, "maxSurge": "25%"})),
    "updateStrategy.rollingUpdate.maxSurge": (
        {"updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}},
        on_both(lambda ds: ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0)),
    "plugin.resources": ({"plugin": {"resources": PLUGIN_RESOURCES}}, resources_are(MAIN, PLUGIN_RESOURCES)),
    "bootstrap.resources": ({"bootstrap": {"resources": BOOTSTRAP_RESOURCES}},
                            resources_are(BOOTSTRAP, BOOTSTRAP_RESOURCES)),
    # The kubelet's socket directory moves on the host only: the daemons still see it where the
    # container mounts it.
    "paths.devicePlugins": ({"paths": {"devicePlugins": SNAP_PLUGINS}},
                            on_both(lambda ds: host_paths(ds)["device-plugins"] == SNAP_PLUGINS
                                    and env(ds)["HYPERLIGHT_PLUGIN_DIR"] == PLUGIN_DIR)),
    "paths.cdi": ({"paths": {"cdi": "/etc/cdi"}},
                  lambda objs: host_paths(daemonsets(objs)[MAIN])["cdi"] == "/etc/cdi"
                  and env(daemonsets(objs)[MAIN])["HYPERLIGHT_CDI_DIR"] == "/var/run/cdi"),
    "paths.dev": ({"paths": {"dev": "/host/dev"}},
                  on_both(lambda ds: host_paths(ds)["host-dev"] == "/host/dev")),
    "monitoring.podMonitor.enabled": ({"monitoring": {"podMonitor": {"enabled": True}}},
                                      lambda objs: kinds(objs) - kinds(render()) == {"PodMonitor"}),
    "monitoring.prometheusRule.enabled": ({"monitoring": {"prometheusRule": {"enabled": True}}},
                                          lambda objs: kinds(objs) - kinds(render()) == {"PrometheusRule"}),
    "networkPolicy.enabled": ({"networkPolicy": {"enabled": False}}, only_kind_missing("NetworkPolicy")),
    "admissionPolicy.enabled": ({"admissionPolicy": {"enabled": False}},
                                lambda objs: kinds(render()) - kinds(objs) == {
                                    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}),
    "namespace.create": ({"namespace": {"create": True}},
                         lambda objs: [o["metadata"] for o in objs if o["kind"] == "Namespace"] == [{
                             "name": NAMESPACE, "labels": {
                                 "pod-security.kubernetes.io/enforce": "privileged",
                                 "pod-security.kubernetes.io/enforce-version": "latest",
                                 "app.kubernetes.io/part-of": "hyperlight"}}]),
}


def test_every_value_has_a_case_and_a_description() -> None:
    names = {name for name, _ in leaves()}
    assert names - {n for n in names if n.startswith("config.")} == set(CASES)
    for name, schema in leaves():
        assert len(schema.get("description", "")) > 10, f"{name}: no description in the schema"
        default_of(name)  # in values.yaml too


@pytest.mark.parametrize("name", CASES)
def test_value_takes_effect(name: str) -> None:
    values, check = CASES[name]
    objs = render(values)
    assert check(objs), f"{name}: {values} did not take effect"
    if name != "updateStrategy.rollingUpdate.maxSurge":  # always 0: the schema refuses any other
        try:
            already = check(render())
        except KeyError:  # the default does not even have the field
            already = False
        assert not already, f"{name}: the default rendering already shows it"


def test_default_image_is_the_released_one_at_the_app_version() -> None:
    """One name for the released image: the chart's, deploy/base's, the release workflow's."""
    base = yaml.safe_load((DEPLOY / "base/kustomization.yaml").read_text())["images"][0]
    assert VALUES["image"]["repository"] == base["newName"] == "ghcr.io/hyperlight-dev/hlplugin"
    assert image_is(f"{base['newName']}:{APP_VERSION}")(render())
    release = (ROOT / ".github/workflows/release.yml").read_text()
    assert re.search(r"^\s+IMAGE: ghcr\.io/hyperlight-dev/hlplugin$", release, re.M), "release.yml"
    # The chart goes beside the image, at a path of its own: chart hlplugin:VERSION is not the image.
    charts = re.search(r"^\s+CHARTS: (oci://\S+)$", release, re.M)
    assert charts and charts.group(1) == "oci://ghcr.io/hyperlight-dev/charts", "release.yml"
    for step in ("helm lint --strict deploy/chart/hlplugin", "helm package deploy/chart/hlplugin",
                 'helm push "dist/hlplugin-$version.tgz" "$CHARTS"'):
        assert step in release, step


def test_release_namespace_holds_everything_and_the_policy_names_it() -> None:
    objs = render(TOGGLES, namespace="hl-elsewhere")
    for o in objs:
        if o["kind"] not in ("Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            assert o["metadata"]["namespace"] == "hl-elsewhere", o["metadata"]["name"]
    (policy,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    (condition,) = policy["spec"]["matchConditions"]
    assert "request.namespace == 'hl-elsewhere'" in condition["expression"]
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"] == ["hl-elsewhere"]
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "DaemonSet"} == {BOOTSTRAP, MAIN}


# --- config.*: the daemons' own settings ----------------------------------------------------------


def test_config_values_are_the_daemons_settings_with_their_defaults() -> None:
    """Every setting of either daemon that the chart does not set itself is a config value, named
    in camelCase after its flag, and its default renders what the daemon's parser reads as the
    daemon's own default (a setting added to the daemons and not to the chart fails here)."""
    assert set(VALUES["config"]) == {camel(d) for d in SETTINGS}
    for dest in SETTINGS:
        assert config.OPTIONS[dest].flag == "--" + dest.replace("_", "-")
    rendered = daemonsets(render())
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
    rendered = daemonsets(render({"config": {camel(dest): value}}))
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


# --- the schema refuses --------------------------------------------------------------------------


def wrong_type(schema: dict[str, Any]) -> Any:
    return "x" if schema.get("type") == "array" else ["x"]


def test_schema_refuses_a_wrong_type_for_every_value() -> None:
    names = [name for name, _ in leaves()]
    values = merged(*(nested(name, wrong_type(schema)) for name, schema in leaves()))
    message = refusal(values)
    for name in names:
        assert f"at '/{name.replace('.', '/')}'" in message, f"{name}: a wrong type was not refused"


def out_of_range(schema: dict[str, Any]) -> list[Any]:
    """Values just outside what the schema allows: beyond a bound, off an enum, off a pattern."""
    bad: list[Any] = []
    for branch in [schema, *schema.get("oneOf", [])]:
        if "maximum" in branch:
            bad.append(branch["maximum"] + 1)
            bad += [branch["minimum"] - 1] if "minimum" in branch else []
        elif "minimum" in branch and branch.get("type") in ("integer", "number"):
            bad.append(branch["minimum"] - 1)
        if "enum" in branch:
            bad.append("Sometimes")
        if "pattern" in branch:
            bad.append("not a valid one: ")
        if "const" in branch:
            bad.append(branch["const"] + 1)
    return bad


def test_schema_refuses_an_out_of_range_value() -> None:
    checked = 0
    for name, schema in leaves():
        for bad in out_of_range(schema):
            assert f"at '/{name.replace('.', '/')}'" in refusal(nested(name, bad)), f"{name}={bad!r}"
            checked += 1
    assert checked >= 30


def test_schema_refuses_unknown_keys() -> None:
    closed = list(closed_objects())
    assert len(closed) >= 15
    values: dict[str, Any] = {}
    for pointer, _ in closed:
        values = merged(values, nested(".".join([*pointer.split("/")[1:], "unknownKey"]), 1))
    message = refusal(values)
    for pointer, schema in closed:
        if "propertyNames" in schema:
            assert "invalid propertyName 'unknownKey'" in message
        else:
            assert f"at '{pointer}': additional properties 'unknownKey' not allowed" in message, pointer
    # The chart adds the one hyperlight.dev/device-access itself.
    access = {"plugin": {"resources": {"limits": {"hyperlight.dev/device-access": 2}}}}
    assert "invalid propertyName 'hyperlight.dev/device-access'" in refusal(access)


# --- the values table in the chart's README -------------------------------------------------------

README = CHART / "README.md"
BEGIN, END = "<!-- values table: python tests/test_chart.py --write -->", "<!-- end of values table -->"


def type_of(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"always `{schema['const']}`"
    if "oneOf" in schema:
        return " or ".join(type_of(s) for s in schema["oneOf"])
    kind = schema["type"]
    if "minimum" in schema and "maximum" in schema:
        return f"{kind} {schema['minimum']} to {schema['maximum']}"
    if "pattern" in schema and kind == "string" and schema["pattern"] != "^/":
        return f"{kind} matching `{schema['pattern']}`".replace("|", "\\|")
    return "absolute path" if schema.get("pattern") == "^/" else str(kind)


def render_values_table() -> str:
    rows = ["| Value | Default | Type | Description |", "| --- | --- | --- | --- |"]
    for name, schema in leaves():
        default = json.dumps(default_of(name), separators=(", ", ": "))
        description = schema["description"].replace("|", "\\|")
        rows.append(f"| `{name}` | `{default}` | {type_of(schema)} | {description} |")
    return "\n".join([BEGIN, *rows, END])


def _block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def test_values_table_matches_values_and_schema() -> None:
    assert _block(README.read_text()) == render_values_table(), (
        "the chart's values table is stale: run `python tests/test_chart.py --write`")


def test_chart_readme_says_where_the_image_comes_from() -> None:
    text = README.read_text()
    for needle in ("helm install", "ghcr.io/hyperlight-dev/hlplugin", "deploy/local-node.sh build",
                   "--set image.repository=", "--set image.tag=", "oci://ghcr.io/hyperlight-dev/charts/hlplugin",
                   "paths.devicePlugins", "--create-namespace"):
        assert needle in text, needle


def test_packaged_chart_carries_the_schema_and_readme(tmp_path: Path) -> None:
    result = subprocess.run([tool("helm"), "package", str(CHART), "--destination", str(tmp_path)],
                            capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("hlplugin-*.tgz")
    assert archive.name == f"hlplugin-{APP_VERSION}.tgz"
    listing = subprocess.run(["tar", "tzf", str(archive)], capture_output=True, text=True, check=True).stdout
    for member in ("Chart.yaml", "values.yaml", "values.schema.json", "README.md",
                   "files/prometheus-rules.yaml", "files/limits.yaml", "templates/device-plugin.yaml",
                   "templates/tests/vm-check.yaml"):
        assert f"hlplugin/{member}" in listing.split(), member
    # The duration ranges travel with it: the packaged chart refuses what the directory refuses.
    refused = subprocess.run([tool("helm"), "template", "x", str(archive), "--set-string",
                              "config.cdiInterval=2h"], capture_output=True, text=True, timeout=100,
                             check=False)
    assert refused.returncode != 0 and "config.cdiInterval=2h is out of range: 1s-1h" in refused.stderr
    shutil.rmtree(tmp_path)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_chart.py --write")
    text = README.read_text() if README.exists() else f"{BEGIN}\n{END}\n"
    README.write_text(text.replace(_block(text), render_values_table()))


# --- the docs: where the image comes from, Helm first, the recipes --------------------------------


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_readme_deploy_leads_with_the_image_and_helm_install() -> None:
    deploy = section((ROOT / "README.md").read_text(), "## Deploy\n")
    image, helm_install, kustomize_apply = (deploy.index("ghcr.io/hyperlight-dev/hlplugin"),
                                            deploy.index("helm install"), deploy.index("kubectl apply -k"))
    assert image < helm_install < kustomize_apply, "the image, then helm install, kustomize beside it"
    assert deploy.index("```") > image, "the image story comes before any command"
    for needle in ("oci://ghcr.io/hyperlight-dev/charts/hlplugin", "--create-namespace",
                   "deploy/local-node.sh build", "podman push", "--set image.repository=",
                   "--set image.tag=", "newName:", f"--version {APP_VERSION}"):
        assert needle in deploy, needle


def test_local_node_recipe_uses_a_venv() -> None:
    recipe = section((ROOT / "README.md").read_text(), "## Run the whole node locally")
    commands = re.search(r"```sh\n(.*?)```", recipe, re.S)
    assert commands
    lines = [line.split("#")[0].strip() for line in commands.group(1).splitlines()]
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'" in lines
    assert not [line for line in lines if re.match(r"(sudo )?pip3? ", line)], "no pip into the system Python"
    assert "sudo deploy/local-node.sh test" in lines
    script = (ROOT / "deploy/local-node.sh").read_text()
    assert '"$repo/.venv/bin/python"' in script and "${PYTHON:-}" in script


def test_operations_names_paths_device_plugins_not_root_dir() -> None:
    operations = (ROOT / "docs/operations.md").read_text()
    assert "paths.devicePlugins" in operations
    assert not re.search(r"non-default `--root-dir` needs", operations)
    assert "?ref=<commit SHA>" in operations and "helm install" in operations


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


# --- `helm test`: a pod that proves a node serves Hyperlight ---------------------------------------

# Peak RSS of `hlplugin doctor --device-only` (VmHWM, this machine's venv, KVM, guest run): MiB.
MEASURED_TEST_PEAK_MIB = 38


def hook_pod(objs: Objects) -> dict[str, Any]:
    (found,) = [o for o in hooks(objs) if o["kind"] == "Pod"]
    return found


def test_helm_test_pod_is_a_locked_down_workload_asking_one_slot() -> None:
    """What `helm test` runs is a workload like any other: one hyperlight.dev/hypervisor, no
    device-access, the Restricted Pod Security Standard (non-root, no capability, read-only root,
    RuntimeDefault seccomp), bounded resources, no network, deleted once it passed and before
    the next run; on the DaemonSets' nodes, with their image and pull policy."""
    values = {"image": {"tag": "i29", "pullPolicy": "Always"}, "imagePullSecrets": [{"name": "regcred"}],
              "config": {"hypervisor": "kvm", "probeTimeout": "500ms"}}
    for objs in (render(), render(values), render(TOGGLES)):
        hook = hook_pod(objs)
        meta, spec = hook["metadata"], hook["spec"]
        assert meta["name"] == TEST_POD and meta["namespace"] == NAMESPACE
        assert meta["annotations"]["helm.sh/hook"] == "test"
        assert set(meta["annotations"]["helm.sh/hook-delete-policy"].split(",")) == {
            "hook-succeeded", "before-hook-creation"}
        assert restricted_violations(spec) == []
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault"
        res = c["resources"]
        for kind in ("requests", "limits"):
            assert res[kind]["hyperlight.dev/hypervisor"] == "1"
            assert "hyperlight.dev/device-access" not in res[kind]
            assert {"cpu", "memory"} <= set(res[kind])
        assert millicores(res["requests"]["cpu"]) <= millicores(res["limits"]["cpu"])
        assert MEASURED_TEST_PEAK_MIB <= mib(res["requests"]["memory"]) <= mib(res["limits"]["memory"])
        assert mib(res["limits"]["memory"]) >= 1.5 * MEASURED_TEST_PEAK_MIB
        plugin = daemonsets(objs)[MAIN]
        for key in ("image", "imagePullPolicy"):
            assert c[key] == container(plugin)[key], key
        for key in ("nodeSelector", "tolerations", "imagePullSecrets", "affinity"):
            assert spec.get(key) == pod(plugin).get(key), key
        # The daemons' settings that shape the verdict, as the main daemon has them.
        for var, text in env_of(c).items():
            assert env(plugin)[var] == text, var
        # No network: the policy created with it (first, by weight) selects it and allows nothing.
        (policy,) = [o for o in hooks(objs) if o["kind"] == "NetworkPolicy"]
        assert int(policy["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
            meta["annotations"].get("helm.sh/hook-weight", "0"))
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= meta["labels"].items()
        assert policy["spec"]["ingress"] == policy["spec"]["egress"] == []
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert hook_pod(render(values))["spec"]["containers"][0]["imagePullPolicy"] == "Always"


def test_helm_test_pod_is_admitted_by_the_chart_s_admission_policy() -> None:
    from test_admission_cel import admit, defaulted

    objs = render()
    (policy,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    assert admit(policy, defaulted(hook_pod(objs))) is True  # it applies, and admits


def hook_command(tmp: Path, dev: Path) -> tuple[list[str], dict[str, str]]:
    """The hook container's command line and environment, run here: the image's entrypoint is
    the console script; only the device directory differs (the container's /dev is the node's)."""
    c = hook_pod(render())["spec"]["containers"][0]
    environ = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp),
               **env_of(c), config.OPTIONS["dev_dir"].env or "": str(dev)}
    return [sys.executable, "-m", "hlplugin", *c["args"]], environ


@pytest.mark.skipif(not (os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)),
                    reason="needs a usable /dev/kvm")
def test_helm_test_command_passes_on_a_working_device_and_fails_without_one(tmp_path: Path) -> None:
    """The hook's own command and settings give the verdict: exit 0 with a VM created and a guest
    run through a device node as the CDI spec makes it, exit 1 (saying why) where the container
    got no device, as a pod admitted without the slot would."""
    dev = tmp_path / "dev"
    dev.mkdir()
    if os.geteuid() == 0:  # the node as the runtime creates it: mode 0666, owned by DEVICE_UID
        from harness import mknod_char

        kvm = mknod_char(dev / "kvm", os.stat("/dev/kvm").st_rdev)
        os.chmod(kvm, 0o666)
    else:
        (dev / "kvm").symlink_to("/dev/kvm")
    argv, environ = hook_command(tmp_path, dev)
    ok = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "VM creation      OK" in ok.stdout and "guest run        OK" in ok.stdout, ok.stdout
    assert "verdict: OK" in ok.stdout
    (dev / "kvm").unlink()
    bad = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and "verdict: FAIL" in bad.stdout, bad.stdout + bad.stderr


# --- the docs of the namespace, helm test, reboot and uninstall -----------------------------------


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_readme_gives_the_namespace_ways_that_work() -> None:
    """The chart's README no longer says to install with namespace.create=true and without
    --create-namespace (helm writes its release record into the namespace first: that fails); it
    gives both ways that work, with commands Helm accepts, and says what helm uninstall does to
    the namespace in each. The rendering agrees: the chart's Namespace is the release namespace
    and carries no keep policy, so helm uninstall deletes it."""
    text = section(README.read_text(), "## The namespace\n")
    prose = " ".join(text.split())
    assert "(then without `--create-namespace`)" not in " ".join(README.read_text().split())
    assert 'namespaces "hyperlight-system" not found' in prose
    commands = [" ".join(line.split("#")[0].replace("\\", " ").split())
                for block in sh_blocks(text) for line in re.sub(r"\\\n", " ", block).splitlines()]
    installs = [c for c in commands if c.startswith("helm install")]
    plain = [c for c in installs if "namespace.create=true" not in c]
    owned = [c for c in installs if "namespace.create=true" in c]
    assert any("--create-namespace" in c for c in plain), installs
    assert any("--create-namespace" in c for c in owned), "Helm 4's way"
    assert any("--take-ownership" in c for c in owned), "an existing namespace, adopted"
    assert all(f"-n {NAMESPACE}" in c for c in installs), installs
    # Helm's ownership metadata by hand: the keys and values Helm checks for this release.
    assert f"kubectl create namespace {NAMESPACE}" in commands
    assert f"kubectl label namespace {NAMESPACE} app.kubernetes.io/managed-by=Helm" in commands
    assert (f"kubectl annotate namespace {NAMESPACE} meta.helm.sh/release-name=hlplugin "
            f"meta.helm.sh/release-namespace={NAMESPACE}") in commands
    assert "pod-security.kubernetes.io/enforce=privileged" in " ".join(commands)
    assert "`helm uninstall` leaves it" in prose and "`helm uninstall` deletes it" in prose
    (namespace,) = [o for o in render({"namespace": {"create": True}}) if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NAMESPACE
    assert "helm.sh/resource-policy" not in namespace["metadata"].get("annotations", {})
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_docs_of_helm_test_name_what_the_hook_runs() -> None:
    hook = hook_pod(render())
    (c,) = hook["spec"]["containers"]
    command = " ".join(["hlplugin", *c["args"]])
    readme, operations = README.read_text(), (ROOT / "docs/operations.md").read_text()
    for text in (" ".join(section(readme, "## Test\n").split()), " ".join(operations.split())):
        assert "helm test hlplugin -n hyperlight-system --logs" in text
        assert f"`{hook['metadata']['name']}`" in text and f"`{command}`" in text
        assert f"UID {hook['spec']['securityContext']['runAsUser']}" in text
    assert "helm test hlplugin -n hyperlight-system --logs" in section((ROOT / "README.md").read_text(),
                                                                      "## Deploy\n")
    # What helm install prints after installing (NOTES.txt) says it too, for the release's name.
    dry = subprocess.run([tool("helm"), "install", "--dry-run=client", "my-hl", str(CHART), "-n", NAMESPACE],
                         capture_output=True, text=True, timeout=100, check=False)
    assert dry.returncode == 0, dry.stderr
    notes = dry.stdout[dry.stdout.index("NOTES:"):]
    assert f"helm test my-hl -n {NAMESPACE} --logs" in notes, notes


def test_operations_says_what_stays_after_a_reboot_and_after_uninstall() -> None:
    """The cleanup of workload pods that failed admission after a reboot deletes exactly those:
    phase Failed, the reason the same section quotes; after helm uninstall, the capacity kubectl
    shows for the kubelet's grace, then 0, and the CDI spec left on the node."""
    operations = (ROOT / "docs/operations.md").read_text()
    reboot = section(operations, "## After a node reboot")
    prose = " ".join(reboot.split())
    (cleanup,) = [b for b in sh_blocks(reboot) if "delete pod" in b]
    assert "--field-selector=status.phase=Failed" in cleanup
    (reason,) = re.findall(r'@\.status\.reason=="(\w+)"', cleanup)
    assert f"status `{reason}`" in prose and reason == "UnexpectedAdmissionError"
    assert "ReplicaSet" in prose and "spec.nodeName=<node>" in prose
    uninstall = operations[operations.index("To uninstall"):]
    uninstall = " ".join(uninstall[: uninstall.index("\n## ")].split())
    count = daemon_default("device_count")
    for needle in (f"`hyperlight.dev/hypervisor: {count // 1000}k`", "`hyperlight.dev/device-access: 2`",
                   "5 minutes", "show 0 for good", "`/var/run/cdi/hyperlight.json` stays",
                   "`namespace.create=true`"):
        assert needle in uninstall, needle
