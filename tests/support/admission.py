"""The API server's admission of a pod by a ValidatingAdmissionPolicy, its CEL run by cel-python
(tests/test_admission_cel.py says what is reproduced and what celpy lacks). A module that imports
this skips where celpy is missing: import it where a test needs it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

celpy = pytest.importorskip("celpy", reason="cel-python is not installed: pip install -e '.[test]'")


# Kubernetes CEL functions and syntax that celpy does not implement: a policy using one cannot be
# judged here (tests/test_admission_cel.py, tests/test_chart_dra_policy.py).
KUBERNETES_ONLY = ("quantity(", "isQuantity(", "url(", "isURL(", "ip(", "isIP(", "cidr(", "isCIDR(",
                   "isSorted(", ".sum(", ".min(", ".max(", ".indexOf(", ".lastIndexOf(", ".find(",
                   ".findAll(", "format(", "authorizer", "?.", ".orValue(", "optional.", "semver(")


def defaulted(pod: dict[str, Any]) -> dict[str, Any]:
    """What admission sees after the API server's defaulting: every container has resources."""
    pod = copy.deepcopy(pod)
    for key in ("containers", "initContainers"):
        for container in pod["spec"].get(key, []):
            container.setdefault("resources", {})
    return pod


class Denied(Exception):
    pass


def admit(policy: dict[str, Any], pod: dict[str, Any], operation: str = "CREATE") -> bool:
    """True if the policy applies and admits, False if it does not apply; raises Denied."""
    spec = policy["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    if not any("" in r["apiGroups"] and "v1" in r["apiVersions"] and "pods" in r["resources"]
               and operation in r["operations"] for r in rules):
        return False
    env = celpy.Environment()
    request = {"namespace": pod["metadata"]["namespace"], "name": pod["metadata"]["name"],
               "operation": operation, "kind": {"group": "", "version": "v1", "kind": "Pod"},
               "resource": {"group": "", "version": "v1", "resource": "pods"},
               "userInfo": {"username": "system:serviceaccount:kube-system:daemon-set-controller"}}
    activation = {"object": celpy.json_to_cel(pod), "oldObject": None,
                  "request": celpy.json_to_cel(request)}

    def evaluate(expression: str) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    for condition in spec.get("matchConditions", []):
        result = evaluate(condition["expression"])
        if isinstance(result, celpy.CELEvalError):
            if spec.get("failurePolicy", "Fail") == "Fail":
                raise Denied(f"matchCondition {condition['name']} failed: {result}")
            return False
        if not bool(result):
            return False
    for validation in spec["validations"]:
        result = evaluate(validation["expression"])
        if isinstance(result, celpy.CELEvalError):
            raise Denied(f"expression {validation['expression']!r} failed: {result}")
        if not bool(result):
            raise Denied(validation.get("message") or validation["expression"])
    return True
