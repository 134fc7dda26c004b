"""The chart's values (issue 19): every one takes effect on the objects it names, the defaults are
the released image in the release's namespace, and the schema refuses a wrong type, an
out-of-range value and an unknown key. helm comes from .ci/run; without it these tests skip."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from support.chart import (
    APP_VERSION,
    BOOTSTRAP,
    DEPLOY,
    DRA,
    DRA_ON,
    MAIN,
    PLUGIN_DIR,
    ROOT,
    TOGGLES,
    VALUES,
    Objects,
    closed_objects,
    container,
    daemonsets,
    default_of,
    env,
    host_paths,
    kinds,
    leaves,
    merged,
    nested,
    pod,
    refusal,
    render,
)
from support.deploy import NAMESPACE

pytestmark = pytest.mark.deploy


# --- every value: it takes effect, and a bad one is refused ---------------------------------------

DIGEST = "sha256:" + "ab" * 32
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


API_CIDRS = ["192.0.2.10/32", "2001:db8::1/128"]
DRA_RESOURCES = {"requests": {"cpu": "20m", "memory": "70Mi"}, "limits": {"cpu": "1", "memory": "100Mi"}}


def dra_egress(objs: Objects) -> dict[str, Any]:
    """The DRA driver's one egress rule (KeyError where there is no driver)."""
    policies = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == DRA]
    if not policies:
        raise KeyError(DRA)
    (rule,) = policies[0]["spec"]["egress"]
    return rule  # type: ignore[no-any-return]


def dra_on(values: dict[str, Any]) -> dict[str, Any]:
    return {"dra": {"enabled": True, **values}}


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
    "dra.enabled": (DRA_ON, lambda objs: DRA in daemonsets(objs) and kinds(objs) - kinds(render()) == {
        "ClusterRole", "ClusterRoleBinding", "DeviceClass"}),
    "dra.extendedResourceName": (dra_on({"extendedResourceName": "example.com/vm"}),
                                 lambda objs: [o["spec"].get("extendedResourceName") for o in objs
                                               if o["kind"] == "DeviceClass"] == ["example.com/vm"]),
    "dra.resources": (dra_on({"resources": DRA_RESOURCES}),
                      lambda objs: container(daemonsets(objs)[DRA])["resources"] == {
                          k: {**v, "hyperlight.dev/device-access": "1"} for k, v in DRA_RESOURCES.items()}),
    "dra.apiServer.cidrs": (dra_on({"apiServer": {"cidrs": API_CIDRS}}),
                            lambda objs: [p["ipBlock"]["cidr"] for p in dra_egress(objs)["to"]] == API_CIDRS),
    "dra.apiServer.ports": (dra_on({"apiServer": {"ports": [8443]}}),
                            lambda objs: dra_egress(objs)["ports"] == [{"protocol": "TCP", "port": 8443}]),
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
        # The driver's own values are judged against the driver with its defaults.
        baseline = DRA_ON if name.startswith("dra.") and name != "dra.enabled" else {}
        try:
            already = check(render(baseline))
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
