"""The ValidatingAdmissionPolicy's CEL, evaluated as the API server would, against rendered pods.

Every matchConditions and validations expression of the rendered policy is compiled and run with
cel-python (celpy), a pure-Python CEL implementation, over the variables the API server binds
(`object`, `oldObject`, `request`). The API server's semantics are reproduced here: the policy
applies when its matchConstraints match and every matchCondition is true; then the first false
validation denies with its message; an error is a denial under failurePolicy Fail.

What celpy lacks of Kubernetes' CEL environment, and why it does not matter for this policy:
- Kubernetes' extension libraries (quantity(), url(), ip()/cidr(), isSorted()/sum() and the other
  list extensions, regex find(), format(), authorizer, optional types `?.`/`.orValue`): not in celpy.
  The policy uses only standard CEL (has(), all(), `in` on a map, &&, ||, !), and
  test_the_policy_uses_only_standard_cel fails if an expression starts using one of them.
- Type-checking against the Pod OpenAPI schema at policy creation, and the cost budget: celpy is
  dynamically typed and has neither. The API server also defaults fields before admission
  (e.g. `resources: {}` on every container); the pods below are given that defaulting.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import documents, kustomize
from support.admission import KUBERNETES_ONLY, Denied, admit, defaulted

celpy = pytest.importorskip("celpy", reason="cel-python is not installed: pip install -e '.[test]'")

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = ROOT / "deploy/overlays/kind"
EXAMPLES = ROOT / "deploy/overlays/kind/examples"
RESERVED = "hyperlight.dev/device-access"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return documents(kustomize(OVERLAY))


@pytest.fixture(scope="module")
def policy(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    policies = [d for d in rendered if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 1, "the overlay renders one ValidatingAdmissionPolicy"
    return policies[0]


def pod_from_template(owner: dict[str, Any]) -> dict[str, Any]:
    """The Pod a DaemonSet's or Deployment's controller creates, in the owner's namespace."""
    template = owner["spec"]["template"]
    return defaulted({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {**template.get("metadata", {}),
                                   "name": owner["metadata"]["name"] + "-x",
                                   "namespace": owner["metadata"]["namespace"]},
                      "spec": template["spec"]})


def expressions(policy: dict[str, Any]) -> Iterator[str]:
    for condition in policy["spec"].get("matchConditions", []):
        yield condition["expression"]
    for validation in policy["spec"]["validations"]:
        yield validation["expression"]


def test_the_policy_uses_only_standard_cel(policy: dict[str, Any]) -> None:
    env = celpy.Environment()
    for expression in expressions(policy):
        lacking = [name for name in KUBERNETES_ONLY if name in expression]
        assert not lacking, (f"{expression!r} uses {lacking}, a Kubernetes CEL extension that "
                             "cel-python lacks: this test can no longer evaluate the policy")
        env.compile(expression)  # parses


def test_the_binding_denies_and_the_policy_fails_closed(rendered: list[dict[str, Any]],
                                                        policy: dict[str, Any]) -> None:
    (binding,) = [d for d in rendered if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert policy["metadata"]["name"] == "hyperlight-reserve-device-access"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"


def test_the_device_plugin_daemonset_pod_is_admitted(rendered: list[dict[str, Any]],
                                                     policy: dict[str, Any]) -> None:
    main = next(d for d in rendered if d["kind"] == "DaemonSet"
                and any(RESERVED in c.get("resources", {}).get("limits", {})
                        for c in d["spec"]["template"]["spec"]["containers"]))
    pod = pod_from_template(main)
    # The policy does not apply to it (matchConditions), and would deny it if it did.
    assert admit(policy, pod) is False
    other_sa = copy.deepcopy(pod)
    other_sa["spec"]["serviceAccountName"] = "default"
    with pytest.raises(Denied):
        admit(policy, other_sa)


def test_every_other_rendered_pod_is_admitted(rendered: list[dict[str, Any]],
                                              policy: dict[str, Any]) -> None:
    pods = [pod_from_template(d) for d in rendered + documents(kustomize(EXAMPLES))
            if d["kind"] in ("DaemonSet", "Deployment")]
    pods += [defaulted(d) for d in documents(kustomize(EXAMPLES)) if d["kind"] == "Pod"]
    pods.append(defaulted({"metadata": {"name": "plain", "namespace": "default"},  # no resources
                           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))
    names = [p["metadata"]["name"] for p in pods]
    assert any("vm-check" in n for n in names) and any("vm-worker" in n for n in names), names
    for pod in pods:
        for operation in ("CREATE", "UPDATE"):
            admit(policy, pod, operation)  # raises Denied on a denial


def reserved_pod(where: str, namespace: str, service_account: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "image": "busybox", "resources": {}}
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": "grab", "namespace": namespace},
                           "spec": {"serviceAccountName": service_account,
                                    "containers": [{"name": "app", "image": "busybox"}]}}
    if where == "init":
        container["resources"] = {"limits": {RESERVED: "1"}, "requests": {RESERVED: "1"}}
        pod["spec"]["initContainers"] = [container]
    else:
        pod["spec"]["containers"][0]["resources"] = {where: {RESERVED: "1"}}
    return defaulted(pod)


@pytest.mark.parametrize("where", ["requests", "limits", "init"])
@pytest.mark.parametrize(("namespace", "service_account"), [
    ("default", "hyperlight-device-plugin"),        # the right SA name, another namespace
    ("hyperlight-system", "hyperlight-device-access"),  # the right namespace, another SA
    ("hyperlight-examples", "hyperlight-example"),
])
def test_a_pod_requesting_device_access_is_denied_with_the_message(
        policy: dict[str, Any], where: str, namespace: str, service_account: str) -> None:
    messages = {v["message"] for v in policy["spec"]["validations"]}
    pod = reserved_pod(where, namespace, service_account)
    for operation in ("CREATE", "UPDATE"):
        with pytest.raises(Denied) as denied:
            admit(policy, pod, operation)
        assert str(denied.value) in messages
        assert re.search(r"reserved for the hyperlight-device-plugin", str(denied.value))
    # The same pod from the device plugin's own namespace and ServiceAccount is not matched.
    own = reserved_pod(where, "hyperlight-system", "hyperlight-device-plugin")
    assert admit(policy, own) is False


@pytest.mark.parametrize("quantity", ["1", "2", "3"])
def test_every_device_access_slot_stays_reserved(policy: dict[str, Any], quantity: str) -> None:
    """The bootstrap advertises three slots (the main pod's, its surge pod's, issue 29, and one
    for a pod still terminating): the spare ones are no more a workload's than the first, in any
    quantity."""
    pod = reserved_pod("limits", "hyperlight-examples", "hyperlight-example")
    pod["spec"]["containers"][0]["resources"] = {"limits": {RESERVED: quantity},
                                                 "requests": {RESERVED: quantity}}
    with pytest.raises(Denied):
        admit(policy, pod)
    surge = reserved_pod("limits", "hyperlight-system", "hyperlight-device-plugin")
    assert admit(policy, surge) is False  # a second main pod, as a surge creates, is not matched
