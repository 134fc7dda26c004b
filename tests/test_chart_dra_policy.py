"""The chart's admission policies with the DRA driver on (issue 41 item 4), their CEL run by
cel-python as the API server would run it (tests/test_admission_cel.py says what celpy lacks):
the driver's pods, which request hyperlight.dev/device-access, are admitted by the policy that
reserves it, and no other pod is; and each driver pod writes only its own node's ResourceSlices,
the policy naming the ServiceAccount the rendered DaemonSet runs as."""

from __future__ import annotations

from typing import Any

import pytest
from support.admission import KUBERNETES_ONLY, Denied, admit, celpy, defaulted
from support.chart import DRA_ON, Objects, daemonsets, render
from support.deploy import DRA, MAIN, NAMESPACE

pytestmark = pytest.mark.deploy

RESERVED = "hyperlight.dev/device-access"


def policy(objs: Objects, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == name]
    return found


def pod_of(ds: dict[str, Any], namespace: str = NAMESPACE, account: str | None = None) -> dict[str, Any]:
    spec = dict(ds["spec"]["template"]["spec"])
    if account is not None:
        spec["serviceAccountName"] = account
    return defaulted({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": ds["metadata"]["name"] + "-x", "namespace": namespace},
                      "spec": spec})


def test_the_driver_s_pods_may_request_device_access_and_no_one_else() -> None:
    """With the driver on, its pods (of its ServiceAccount, in the release namespace) get the
    device-access they request, as the main daemon's do; the same pod of any other account, or
    in another namespace, is denied. The policy is the same with the driver off (its account
    does not exist then, so no pod can name it): turning the driver on changes no policy that
    the API server could still hold old when the driver's first pods are created."""
    objs = render(DRA_ON)
    reserve = policy(objs, "hyperlight-reserve-device-access")
    sets = daemonsets(objs)
    driver = sets[DRA]
    assert driver["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][RESERVED] == "1"
    for name in (DRA, MAIN):
        assert admit(reserve, pod_of(sets[name])) is False, f"{name}: the policy must not apply"
    for namespace, account in ((NAMESPACE, "default"), ("elsewhere", DRA), (NAMESPACE, DRA + "-x")):
        with pytest.raises(Denied, match="reserved"):
            admit(reserve, pod_of(driver, namespace, account))
    assert policy(render(), "hyperlight-reserve-device-access") == reserve
    assert not [o for o in render() if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == DRA]


# --- each driver pod writes only its own node's ResourceSlices ------------------------------------

SLICES_POLICY = "hyperlight-dra-own-node-slices"
NODE_NAME = "authentication.kubernetes.io/node-name"


def user_of(objs: Objects) -> str:
    """The username the API server gives the driver's pods: their ServiceAccount's, read from
    the rendered DaemonSet (a policy naming any other account would never apply)."""
    ds = daemonsets(objs)[DRA]
    account = ds["spec"]["template"]["spec"]["serviceAccountName"]
    return f"system:serviceaccount:{ds['metadata']['namespace']}:{account}"


def a_slice(node: str | None, driver: str = "hyperlight.dev") -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": node or "all", "generation": 1,
                                                       "resourceSliceCount": 1}, "devices": []}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}"}, "spec": spec}


def judge(policy: dict[str, Any], operation: str, user: str, token_node: str | None,
          new: dict[str, Any] | None, old: dict[str, Any] | None = None) -> str | None:
    """The policy's verdict on a write of a ResourceSlice, as the API server reaches it: None
    where it does not apply, "" where it admits, else the message of the first failed
    validation. Its variables are bound in order, as the API server binds them (lazily there;
    every one here, which the policy's expressions allow)."""
    spec = policy["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    if not any("resource.k8s.io" in r["apiGroups"] and "resourceslices" in r["resources"]
               and operation in r["operations"] for r in rules):
        return None
    extra = {NODE_NAME: [token_node]} if token_node is not None else {}
    request = {"operation": operation, "userInfo": {"username": user, "extra": extra},
               "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"},
               "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"}}
    env = celpy.Environment()
    activation: dict[str, Any] = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(new),
                                  "oldObject": celpy.json_to_cel(old)}

    def evaluate(expression: str) -> Any:
        result = env.program(env.compile(expression)).evaluate(activation)
        assert not isinstance(result, celpy.CELEvalError), f"{expression!r}: {result}"
        return result

    for condition in spec["matchConditions"]:
        if not evaluate(condition["expression"]):
            return None
    variables: dict[Any, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(variable["name"])] = evaluate(variable["expression"])
    activation["variables"] = celpy.celtypes.MapType(variables)
    for validation in spec["validations"]:
        if not evaluate(validation["expression"]):
            if "messageExpression" in validation:
                return str(evaluate(validation["messageExpression"]))
            return str(validation["message"])
    return ""


@pytest.mark.parametrize("namespace", [NAMESPACE, "hl-elsewhere"])
def test_a_driver_pod_writes_only_its_own_node_s_slices(namespace: str) -> None:
    objs = render(DRA_ON, namespace=namespace)
    slices = policy(objs, SLICES_POLICY)
    (binding,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"
                  and o["spec"]["policyName"] == SLICES_POLICY]
    assert binding["spec"]["validationActions"] == ["Deny"] and "paramRef" not in binding["spec"]
    assert slices["spec"]["failurePolicy"] == "Fail"
    user = user_of(objs)
    mine, theirs = a_slice("node-a"), a_slice("node-b")
    # Its own node's slice: created, updated, deleted.
    assert judge(slices, "CREATE", user, "node-a", mine) == ""
    assert judge(slices, "UPDATE", user, "node-a", mine, mine) == ""
    assert judge(slices, "DELETE", user, "node-a", None, mine) == ""
    # Any other node's, a slice of no node, another driver's: refused, saying why.
    refused = {
        "create another node's": judge(slices, "CREATE", user, "node-a", theirs),
        "update another node's": judge(slices, "UPDATE", user, "node-a", theirs, theirs),
        "take another node's over": judge(slices, "UPDATE", user, "node-a", mine, theirs),
        "give its own away": judge(slices, "UPDATE", user, "node-a", theirs, mine),
        "delete another node's": judge(slices, "DELETE", user, "node-a", None, theirs),
        "a slice of every node": judge(slices, "CREATE", user, "node-a", a_slice(None)),
        "another driver's": judge(slices, "CREATE", user, "node-a", a_slice("node-a", "gpu.example.com")),
        "a token of no node": judge(slices, "CREATE", user, None, mine),
    }
    for case, verdict in refused.items():
        assert verdict, f"{case}: admitted"
    assert refused["create another node's"] == (
        "a DRA driver pod on node node-a may write only that node's ResourceSlices")
    assert refused["take another node's over"] == (
        "a DRA driver pod on node node-a may not take over another node's ResourceSlice")
    assert "hyperlight.dev" in refused["another driver's"]
    assert NODE_NAME in refused["a token of no node"]


def test_the_slice_policy_applies_to_the_driver_s_account_alone() -> None:
    """The kubelet (which deletes a gone driver's slices), the garbage collector, other accounts
    and the same account's name in another namespace are not judged by it; with the driver
    off there is no such policy."""
    objs = render(DRA_ON)
    slices = policy(objs, SLICES_POLICY)
    user = user_of(objs)
    theirs = a_slice("node-b")
    assert judge(slices, "CREATE", user, "node-a", theirs)  # the driver's own account: judged
    namespace, _, account = user.removeprefix("system:serviceaccount:").partition(":")
    for other in ("system:node:node-a", "system:serviceaccount:kube-system:generic-garbage-collector",
                  f"system:serviceaccount:elsewhere:{account}", f"system:serviceaccount:{namespace}:default",
                  f"system:serviceaccount:{namespace}:{account}-x"):
        assert judge(slices, "DELETE", other, "node-a", None, theirs) is None, other
    assert not [o for o in render() if o["metadata"]["name"] == SLICES_POLICY]
    # Every write the driver's RBAC allows is judged (delete too, should a grant add it).
    (rule,) = slices["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"} and rule["apiVersions"] == ["*"]


def test_the_slice_policy_uses_only_standard_cel() -> None:
    """celpy lacks Kubernetes' CEL extensions (test_admission_cel.py lists them): the policy
    must not need one, or the test above could not judge it."""
    spec = policy(render(DRA_ON), SLICES_POLICY)["spec"]
    texts = [c["expression"] for c in spec["matchConditions"]] + [v["expression"] for v in spec["variables"]]
    texts += [v.get("messageExpression", v["expression"]) for v in spec["validations"]]
    texts += [v["expression"] for v in spec["validations"]]
    for text in texts:
        assert not [name for name in KUBERNETES_ONLY if name in text], text
