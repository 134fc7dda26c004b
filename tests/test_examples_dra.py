"""The DRA driver's example, deploy/examples/dra (issue 41 item 4): a ResourceClaimTemplate that
asks the chart's DeviceClass for one slot of the node's shared device, and a pod that uses it
as a Restricted workload (UID 65534, no token, no capabilities) and runs the device check the
chart's `helm test` runs; its namespace is deploy/examples' own; the Kubernetes 1.34 schemas and
checkov accept it. Whether a real scheduler allocates it and the pod creates a VM is the
cluster tests' (issue 41 item 5). helm and kustomize come from .ci/run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from harness import documents, kustomize, tool
from support.chart import DRA_ON, hook_pod, render
from support.deploy import (
    CHECKOV_ENV,
    DEPLOY,
    WORKLOAD_UID,
    containers,
    pod_specs,
    restricted_violations,
    run,
)

pytestmark = pytest.mark.deploy

EXAMPLE = DEPLOY / "examples/dra"


@pytest.fixture(scope="module")
def example() -> list[dict[str, Any]]:
    return documents(kustomize(EXAMPLE))


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def test_the_claim_asks_the_chart_s_device_class_for_one_slot(example: list[dict[str, Any]]) -> None:
    template = one(example, "ResourceClaimTemplate")
    assert template["apiVersion"] == "resource.k8s.io/v1"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    (device_class,) = [o for o in render(DRA_ON) if o["kind"] == "DeviceClass"]
    assert request["exactly"] == {"deviceClassName": device_class["metadata"]["name"],
                                  "capacity": {"requests": {"slots": "1"}}}
    pod = one(example, "Pod")
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim == {"name": claim["name"], "resourceClaimTemplateName": template["metadata"]["name"]}
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["claims"] == [{"name": claim["name"]}]
    for kind in ("requests", "limits"):  # the device comes through the claim alone
        assert not [r for r in c["resources"][kind] if r.startswith("hyperlight.dev/")], kind


def test_the_pod_is_a_restricted_workload_running_the_helm_test_s_check(
        example: list[dict[str, Any]]) -> None:
    (ns,) = [o for o in example if o["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    ((obj, spec),) = list(pod_specs(example))
    assert restricted_violations(spec) == [], obj["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    taint = {"key": "hyperlight.dev/hypervisor", "operator": "Exists", "effect": "NoSchedule"}
    assert taint in spec["tolerations"]
    (c,) = containers(spec)
    sc = {**spec["securityContext"], **c["securityContext"]}
    assert sc["runAsUser"] == sc["runAsGroup"] == WORKLOAD_UID and sc["readOnlyRootFilesystem"] is True
    check = hook_pod(render())["spec"]["containers"][0]
    assert c["args"] == check["args"] == ["doctor", "--device-only"]
    limits = {k: v for k, v in check["resources"]["limits"].items() if not k.startswith("hyperlight.dev/")}
    assert c["resources"]["limits"] == limits


def test_the_namespace_is_deploy_examples_own(example: list[dict[str, Any]]) -> None:
    """Applied alone or beside deploy/examples, the same namespace, account and deny-all policy."""
    theirs = documents(kustomize(DEPLOY / "examples"))
    for kind in ("Namespace", "ServiceAccount", "NetworkPolicy"):
        assert one(example, kind) == one(theirs, kind), kind


def test_the_example_validates_and_checkov_finds_nothing(tmp_path: Path) -> None:
    (tmp_path / "example.yaml").write_text(kustomize(EXAMPLE))
    result = run([tool("kubernetes-validate"), "-k", "1.34", "--strict", str(tmp_path / "example.yaml")])
    output = result.stdout + result.stderr
    assert result.returncode == 0 and output.count("passed for resource") == 5, output
    result = run([tool("checkov"), "--directory", str(tmp_path), "--framework", "kubernetes",
                  "--skip-download", "--output", "json", "--compact"],
                 env={**os.environ, **CHECKOV_ENV}, timeout=110)
    report = json.loads(result.stdout)
    (report,) = report if isinstance(report, list) else [report]
    failed = [f"{c['check_id']} {c['resource']}" for c in report["results"]["failed_checks"]]
    assert report["summary"]["failed"] == 0, "\n".join(failed)
    assert report["summary"]["passed"] > 0 and report["summary"]["parsing_errors"] == 0
    for skipped in report["results"]["skipped_checks"]:
        assert len(skipped["check_result"].get("suppress_comment") or "") > 20, skipped["check_id"]
