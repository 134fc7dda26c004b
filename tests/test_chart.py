"""The Helm chart, deploy/chart/hlplugin (issue 19), judged by the real helm as a whole: one source
of truth with deploy/base (the chart's default rendering and kustomize's must be the same
objects), `helm lint --strict`, the Kubernetes schemas and the analysers of the deploy tests on
its renderings, and its README's values table (its values: test_chart_values.py; the daemons'
settings: test_chart_settings.py; `helm test`: test_chart_hook.py; the docs: test_chart_docs.py).
helm comes from .ci/run (.tools/bin); without it these tests skip and say so.

`python tests/test_chart.py --write` regenerates the values table in the chart's README."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import documents, helm_template, tool
from support.chart import (
    APP_VERSION,
    CHART,
    CRD_GROUP,
    DEPLOY,
    DRA_ON,
    MAIN,
    README,
    TEST_POD,
    TOGGLES,
    Objects,
    default_of,
    hooks,
    index,
    installed,
    kinds,
    kustomized,
    leaves,
    merged,
    render,
)
from support.deploy import CHECKOV_ENV, NAMESPACE, check_plugin_daemonsets

pytestmark = pytest.mark.deploy


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
# With the DRA driver too (its properties: tests/test_chart_dra.py); resource.k8s.io/v1 needs 1.34.
WITH_DRA = {**RENDERINGS, "dra and every toggle": merged(TOGGLES, DRA_ON)}


@pytest.mark.parametrize("rendering", WITH_DRA)
def test_helm_lint_strict(rendering: str, tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(WITH_DRA[rendering]))
    result = subprocess.run([tool("helm"), "lint", "--strict", "--namespace", NAMESPACE, str(CHART),
                             "--values", str(tmp_path / "values.yaml")],
                            capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0 and "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_chart_daemonsets_have_the_deploy_properties(rendering: str) -> None:
    """tests/support/deploy.py's checks of the DaemonSets (locked down, probes on the admitted port,
    resources from the measured peak, host paths, rollout), the environment read by the daemons'
    own parsers, on the chart's rendering."""
    objs = render(RENDERINGS[rendering])
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "NetworkPolicy"} <= kinds(objs)
    check_plugin_daemonsets(objs, f"chart ({rendering})")


@pytest.mark.parametrize("version", ["1.30", "1.34", "1.36"])
def test_renderings_validate_against_kubernetes_schemas(version: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    count = 0
    for name, values in (WITH_DRA if version >= "1.34" else RENDERINGS).items():
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
    assert set(unchecked) == {"PodMonitor", "PrometheusRule"}, output


def test_checkov_finds_nothing_in_the_renderings(tmp_path: Path) -> None:
    """Both renderings, and one with the image pinned by digest, which needs no CKV_K8S_43 skip."""
    checkov = tool("checkov")
    pinned = {"image": {"digest": "sha256:" + "0" * 64}}
    for name, values in {**WITH_DRA, "digest": merged(pinned, DRA_ON)}.items():
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


# --- the values table in the chart's README -------------------------------------------------------

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
