"""Offline checks of the deployment path (issue 7), the manifests: no cluster, no network.
kustomize renders every kustomization, which is validated against the Kubernetes schemas and
walked for the issue's security properties; checkov runs on all it covers (the image:
test_deploy_image.py; workflows, scripts and docs: test_deploy_tooling.py). Python tools come
from requirements-deploy-checks.txt, on PATH or in $DEPLOY_CHECKS_BIN (a venv's bin); kubectl
from the system. A missing tool skips its test and says which one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import documents, kustomize, tool
from support.deploy import (
    BOOTSTRAP,
    CHECKOV_ENV,
    DEPLOY,
    GITHUB,
    K8S_VERSION,
    MAIN,
    NAMESPACE,
    ROOT,
    SUBCOMMAND,
    WORKLOAD_UID,
    check_plugin_daemonsets,
    containers,
    find,
    pod_specs,
    restricted_violations,
    run,
    workflow,
)

pytestmark = pytest.mark.deploy
PLUGIN_KUSTOMIZATIONS = ("base", "overlays/kind", "overlays/aks")
EXAMPLE_KUSTOMIZATIONS = ("examples", "overlays/kind/examples")
# Not rendered here: an overlay with deploy/components/monitoring on top, which
# tests/test_monitoring.py renders as exactly the overlay's objects plus two Prometheus Operator
# CRDs that kubernetes-validate has no schema for (and checks them with promtool).


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each kustomization's output, in one directory."""
    out = tmp_path_factory.mktemp("rendered")
    sources = {name: DEPLOY / name for name in (*PLUGIN_KUSTOMIZATIONS, *EXAMPLE_KUSTOMIZATIONS)}
    for name, source in sources.items():
        (out / (name.replace("/", "-") + ".yaml")).write_text(kustomize(source))
    return {name: out / (name.replace("/", "-") + ".yaml") for name in sources}


@pytest.fixture(scope="module")
def objects(rendered: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    return {name: documents(path.read_text()) for name, path in rendered.items()}


def test_no_mount_over_dev_and_only_the_plugin_runs_as_root(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        for obj, spec in pod_specs(objs):
            for m in (m for c in containers(spec) for m in c.get("volumeMounts", [])):
                path = m["mountPath"].rstrip("/")
                assert path != "/dev" and not path.startswith("/dev/"), (name, obj, m)
            if restricted_violations(spec):
                assert obj["kind"] == "DaemonSet" and obj["metadata"]["name"] in SUBCOMMAND, name
                assert obj["metadata"]["namespace"] == NAMESPACE, name


def test_rendered_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, Path], objects: dict[str, list[dict[str, Any]]]
) -> None:
    validate = tool("kubernetes-validate")
    result = run([validate, "-k", K8S_VERSION, "--strict", *map(str, rendered.values())])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("passed for resource") == sum(map(len, objects.values())), output


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_plugin_daemonsets(objects: dict[str, list[dict[str, Any]]], kustomization: str) -> None:
    objs = objects[kustomization]
    # The namespace (both DaemonSets are found below) holds everything but the cluster-scoped
    # admission policy, which the overlays add.
    find(objs, "Namespace", NAMESPACE)
    if kustomization != "base":
        assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= {o["kind"] for o in objs}
    check_plugin_daemonsets(objs, kustomization)


def test_base_manifests_explain_root() -> None:
    for path in sorted((DEPLOY / "base").glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*runAsUser:\s*0\s*$", line):
                context = " ".join(lines[max(0, i - 4) : i + 1])
                assert "root-owned" in context and "#" in context, f"{path.name}:{i + 1}"


def test_kind_path_is_whole() -> None:
    """`kubectl apply -k deploy/overlays/kind` alone pulls an image no registry has: the README, the
    overlay and the e2e workflow give every step, with the overlay's image tag and the cluster's names."""
    cluster = yaml.safe_load((DEPLOY / "overlays/kind/kind-config.yaml").read_text())
    e2e = (GITHUB / "workflows/e2e.yml").read_text()
    # The cluster config is a KIND config beside the overlay, not one of its resources.
    assert cluster["kind"] == "Cluster" and cluster["apiVersion"].startswith("kind.x-k8s.io/")
    (node,) = cluster["nodes"]
    assert re.fullmatch(r"kindest/node:v1\.\d+\.\d+@sha256:[0-9a-f]{64}", node["image"])
    assert {"hostPath": "/dev/kvm", "containerPath": "/dev/kvm"} in node["extraMounts"]
    overlay = yaml.safe_load((DEPLOY / "overlays/kind/kustomization.yaml").read_text())
    assert "kind-config.yaml" not in overlay.get("resources", [])
    assert f"CLUSTER: {cluster['name']}" in e2e and f"NODE: {cluster['name']}-control-plane" in e2e

    # The README and the overlay's header give the recipe, each step after the one before.
    (image,) = overlay["images"]
    tag = f"{image['newName']}:{image['newTag']}"
    steps = [
        "kind create cluster --config deploy/overlays/kind/kind-config.yaml", f"docker build -t {tag} .",
        f"kind load docker-image {tag} --name {cluster['name']}",
        f"deploy/label-nodes.sh --hypervisor kvm {cluster['name']}-control-plane",
        "kubectl apply -k deploy/overlays/kind", f"rollout status daemonset/{MAIN}",
        "kubectl apply -k deploy/overlays/kind/examples", "logs pod/hyperlight-vm-check",
    ]  # fmt: skip
    readme = (ROOT / "README.md").read_text()
    deploy_section = readme[readme.index("## Deploy") :]
    deploy_section = deploy_section[: deploy_section.index("\n## ", 1)]
    header = (DEPLOY / "overlays/kind/kustomization.yaml").read_text().split("apiVersion:")[0]
    for text, where in ((deploy_section, "README.md, Deploy"), (header, "deploy/overlays/kind")):
        at = 0
        for step in steps:
            found = text.find(step, at)
            assert found >= 0, f"{where} lacks {step!r} (after the steps before it)"
            at = found + len(step)

    # The e2e workflow runs that path, dumps events on failure, and always deletes the cluster.
    (job,) = workflow("e2e.yml")["jobs"].values()
    script = "\n".join(s.get("run", "") for s in job["steps"])
    for needle in (
        'KERNEL=="kvm"', "docker build", "kind create cluster --config deploy/overlays/kind/kind-config.yaml",
        "kind load docker-image", "deploy/label-nodes.sh", "kubectl apply -k deploy/overlays/kind",
        f"rollout status daemonset/{BOOTSTRAP}", f"rollout status daemonset/{MAIN}",
        r"allocatable.hyperlight\.dev/hypervisor", "kubectl apply -k deploy/overlays/kind/examples",
        f"as uid={WORKLOAD_UID}", "get events", "logs",
    ):  # fmt: skip
        assert needle in script, needle
    assert any(s.get("if") == "failure()" and "get events" in s.get("run", "") for s in job["steps"])
    assert job["steps"][-1].get("if") == "always()" and "kind delete cluster" in job["steps"][-1]["run"]


@pytest.mark.parametrize("kustomization", EXAMPLE_KUSTOMIZATIONS)
def test_examples_are_restricted_workloads_for_the_dedicated_pool(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    objs = objects[kustomization]
    (ns,) = [o for o in objs if o["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = list(pod_specs(objs))
    assert {o["kind"] for o, _ in workloads} == {"Pod", "Deployment"}
    operations = (ROOT / "docs/operations.md").read_text()
    taints = re.findall(r"--node-taints ([\w./-]+)=([\w.-]+):(\w+)", operations)
    assert taints, "docs/operations.md suggests a taint for dedicated pools"
    for obj, spec in workloads:
        where = f"{kustomization}: {obj['kind']}/{obj['metadata']['name']}"
        assert restricted_violations(spec) == [], where
        assert spec["automountServiceAccountToken"] is False, where
        for key, value, effect in taints:
            assert any(
                t["key"] == key and t.get("effect", effect) == effect
                and (t["operator"] == "Exists" or t.get("value") == value)
                for t in spec.get("tolerations", [])
            ), f"{where} does not tolerate {key}"
        for c in containers(spec):
            sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
            assert sc["runAsUser"] == WORKLOAD_UID and sc["runAsGroup"] == WORKLOAD_UID, where
            assert sc["readOnlyRootFilesystem"] is True, where
            for key in ("requests", "limits"):
                assert c["resources"][key]["hyperlight.dev/hypervisor"] == "1", where
                assert "hyperlight.dev/device-access" not in c["resources"][key], where


def test_checkov_finds_nothing(rendered: dict[str, Path], tmp_path: Path) -> None:
    """One checkov run over the rendered manifests, the Dockerfile and the workflows; every
    check it skips says why, beside the setting."""
    checkov = tool("checkov")
    shutil.copytree(next(iter(rendered.values())).parent, tmp_path / "rendered")
    shutil.copy(ROOT / "Dockerfile", tmp_path / "Dockerfile")
    shutil.copytree(GITHUB / "workflows", tmp_path / ".github" / "workflows")
    frameworks = ("kubernetes", "dockerfile", "github_actions")
    result = run([checkov, "--directory", str(tmp_path), "--framework", ",".join(frameworks),
                  "--skip-download", "--output", "json", "--compact"],
                 env={**os.environ, **CHECKOV_ENV}, timeout=110)
    assert result.stdout.strip(), result.stderr
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    for framework in frameworks:
        (report,) = [r for r in reports if r["check_type"] == framework]
        summary, results = report["summary"], report["results"]
        failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})" for c in results["failed_checks"]]
        assert summary["failed"] == 0, f"{framework}:\n" + "\n".join(failed)
        assert summary["parsing_errors"] == 0, framework
        assert summary["passed"] > 0, framework
        for skipped in results["skipped_checks"]:
            reason = skipped["check_result"].get("suppress_comment") or ""
            assert len(reason) > 20 and reason != "No comment provided", skipped["check_id"]
            if framework == "kubernetes" and skipped["check_id"] in ("CKV_K8S_23", "CKV_K8S_40"):
                assert skipped["resource"].startswith(f"DaemonSet.{NAMESPACE}."), skipped["resource"]
                assert "root-owned" in reason
