"""The chart's admission policies with the DRA driver on (issue 41 item 4), their CEL run by
cel-python as the API server would run it (tests/test_admission_cel.py says what celpy lacks):
the driver's pods, which request hyperlight.dev/device-access, are admitted by the policy that
reserves it, and no other pod is."""

from __future__ import annotations

from typing import Any

import pytest
from support.admission import Denied, admit, defaulted
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
    in another namespace, is denied. With the driver off, its account is not trusted."""
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
    off = policy(render(), "hyperlight-reserve-device-access")
    with pytest.raises(Denied, match="reserved"):
        admit(off, pod_of(driver))

