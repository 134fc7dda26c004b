"""Surge rollouts (issue 29 #1): both DaemonSets, in the chart and in deploy/base, start the new pod
beside the old one (maxSurge) and never take a node's pod away first (maxUnavailable 0); the
chart's values still allow the old in-place rollout (maxSurge 0), and refuse what the API server
would (both 0) or what is out of range, naming it. The main pod's surge needs a second
hyperlight.dev/device-access slot, which the bootstrap advertises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import documents, helm_template, kustomize

from hlplugin.bootstrap import SLOTS, slot_ids

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/chart/hlplugin"
BASE = ROOT / "deploy/base"
DAEMONSETS = ("hyperlight-device-access", "hyperlight-device-plugin")
ACCESS = "hyperlight.dev/device-access"


def strategies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["updateStrategy"]
            for o in objs if o["kind"] == "DaemonSet"}


def chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    result = helm_template(CHART, "hyperlight-system", values)
    assert result.returncode == 0, result.stderr
    return documents(result.stdout)


def refused(values: dict[str, Any]) -> str:
    result = helm_template(CHART, "hyperlight-system", values)
    assert result.returncode != 0, f"helm accepted {values}"
    return result.stderr


SURGE = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": "25%"}}


@pytest.mark.parametrize("rendering", ["chart", "base"])
def test_both_daemonsets_surge_and_never_go_unavailable(rendering: str) -> None:
    objs = chart() if rendering == "chart" else documents(kustomize(BASE))
    assert strategies(objs) == {name: SURGE for name in DAEMONSETS}


def test_max_surge_0_stays_possible_with_an_unavailable_budget() -> None:
    values = {"updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "25%"}}}
    in_place = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": 0}}
    assert strategies(chart(values)) == {name: in_place for name in DAEMONSETS}
    surge_one = {"updateStrategy": {"rollingUpdate": {"maxSurge": 1}}}
    assert {s["rollingUpdate"]["maxSurge"] for s in strategies(chart(surge_one)).values()} == {1}


@pytest.mark.parametrize("surge, unavailable", [(0, 0), ("0%", 0), (0, "0%"), ("0%", "0%")])
def test_both_zero_is_refused_naming_the_values(surge: Any, unavailable: Any) -> None:
    """The API server refuses a DaemonSet with neither budget; the chart says so at render."""
    message = refused({"updateStrategy": {"rollingUpdate": {"maxSurge": surge,
                                                            "maxUnavailable": unavailable}}})
    assert "maxUnavailable and maxSurge cannot both be 0" in message, message


@pytest.mark.parametrize("name", ["maxSurge", "maxUnavailable"])
@pytest.mark.parametrize("bad", [-1, "101%", "25", "1.5%"])
def test_the_schema_bounds_the_budgets(name: str, bad: Any) -> None:
    message = refused({"updateStrategy": {"rollingUpdate": {name: bad}}})
    assert "don't meet the specifications of the schema" in message
    assert f"at '/updateStrategy/rollingUpdate/{name}'" in message, message


def test_the_bootstrap_advertises_a_slot_for_the_old_main_pod_and_one_for_its_surge_pod() -> None:
    """A surge creates at most one new pod per node beside the old one (a DaemonSet's surge is
    per node), and the rollout before may leave one terminating; each main pod requests one slot:
    three, the first named as a one-slot release did."""
    main = next(o for o in documents(kustomize(BASE))
                if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "hyperlight-device-plugin")
    (container,) = main["spec"]["template"]["spec"]["containers"]
    per_pod = int(container["resources"]["requests"][ACCESS])
    assert container["resources"]["limits"][ACCESS] == str(per_pod)
    assert 3 * per_pod == SLOTS  # a terminating pod's, the old pod's and its surge pod's
    assert slot_ids("kvm") == ["device-access-kvm", "device-access-kvm-1", "device-access-kvm-2"]
    assert slot_ids("mshv") == ["device-access-mshv", "device-access-mshv-1", "device-access-mshv-2"]
