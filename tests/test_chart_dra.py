"""The chart's DRA driver (issue 41 item 4, `dra.enabled`): its DaemonSet as the device plugin's
are made (surge, per-pod socket names, device access without privilege, probes on its port),
the kubelet's plugin directories at the kubelet's own paths, a projected expiring token where the
API client reads it, egress to the API server only, RBAC exactly what the slice controller calls
(run against the fake API server to see), and the DeviceClass. The admission policies are
tests/test_chart_dra_policy.py's. helm comes from .ci/run; without it these tests skip."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from harness import helm_template, wait_until
from support.chart import (
    BOOTSTRAP,
    CHART,
    DRA_ON,
    MAIN,
    TOGGLES,
    Objects,
    container,
    daemonsets,
    merged,
    pod,
    refusal,
    render,
)
from support.deploy import (
    DRA,
    HTTP_PORT,
    NAMESPACE,
    SCRAPERS,
    check_plugin_daemonsets,
    find,
    port_number,
)
from support.fakeapi import FakeApiServer, Sleeps
from support.fakeslices import NODE, add_node

from hlplugin import config
from hlplugin.dra import driver as dra
from hlplugin.dra.slices import SliceController
from hlplugin.kubeapi import RESOURCE_SLICES, Backoff, Client, Config
from hlplugin.kubeapi import config as kubeapi_config
from hlplugin.names import DRA_DRIVER, HYPERVISOR_RESOURCE
from hlplugin.nodefacts import NodeDevice
from hlplugin.settings import DraPluginSettings

pytestmark = pytest.mark.deploy

RENDERINGS = {"dra": DRA_ON, "dra and every toggle": merged(TOGGLES, DRA_ON)}
ON_NODES = ("hyperlight.dev/dra", "true")


def driver(objs: Objects) -> dict[str, Any]:
    return daemonsets(objs)[DRA]


def volumes(ds: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod(ds)["volumes"]}


def mounts(ds: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container(ds)["volumeMounts"]}


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_the_driver_runs_as_the_device_plugin_runs(rendering: str) -> None:
    """Off by default; on, a third DaemonSet `hlplugin dra` with the main daemon's rollout (a
    surge), pod and container security, priority, probes (on its own port, the one its
    NetworkPolicy admits) and device access (its one hyperlight.dev/device-access, no
    privilege); the other two keep every deploy property."""
    assert DRA not in daemonsets(render(RENDERINGS[rendering] | {"dra": {"enabled": False}}))
    objs = render(RENDERINGS[rendering])
    check_plugin_daemonsets(objs, f"chart ({rendering})")
    ds, main = driver(objs), daemonsets(objs)[MAIN]
    c, m = container(ds), container(main)
    assert c["args"] == ["dra"] and c["image"] == m["image"]
    assert ds["spec"]["updateStrategy"] == main["spec"]["updateStrategy"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 0
    for key in ("automountServiceAccountToken", "enableServiceLinks", "hostNetwork", "hostPID",
                "hostIPC", "securityContext", "terminationGracePeriodSeconds", "tolerations"):
        assert pod(ds)[key] == pod(main)[key], key
    assert pod(ds)["priorityClassName"] == "system-node-critical"
    assert c["securityContext"] == m["securityContext"] and c["securityContext"]["privileged"] is False
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["hyperlight.dev/device-access"] == "1", kind
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        assert c[probe] == m[probe] and c[probe]["httpGet"]["path"] == path, probe
        assert port_number(c, c[probe]["httpGet"]["port"]) == HTTP_PORT[DRA]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(HTTP_PORT[DRA])


def test_the_driver_needs_kubernetes_1_34() -> None:
    """resource.k8s.io/v1 (the DeviceClass, the slices the driver writes) is served from 1.34 on:
    an older cluster fails the install with the reason, not with an unknown kind."""
    result = helm_template(CHART, NAMESPACE, DRA_ON, "--kube-version", "1.33.9")
    assert result.returncode != 0
    assert "dra.enabled needs Kubernetes 1.34 or later (resource.k8s.io/v1)" in result.stderr
    assert helm_template(CHART, NAMESPACE, {}, "--kube-version", "1.30.0").returncode == 0
    assert helm_template(CHART, NAMESPACE, DRA_ON, "--kube-version", "1.34.0").returncode == 0


def test_the_driver_s_environment_is_its_command_line_s() -> None:
    """Every variable is a `hlplugin dra` setting with a value its parser takes; the sockets are
    named after the pod (its UID) and the pool after the node, from the downward API; the HTTP
    address is the port the probes use."""
    c = container(driver(render(DRA_ON)))
    settings = {config.OPTIONS[d].env: config.OPTIONS[d] for d in config.DRA_OPTIONS}
    given = {}
    for var in c["env"]:
        assert var["name"] in settings, f"{var['name']} is not a `hlplugin dra` setting"
        if "value" in var:
            settings[var["name"]].parse(var["value"])
            given[var["name"]] = var["value"]
        else:
            given[var["name"]] = var["valueFrom"]["fieldRef"]["fieldPath"]
    assert given["HYPERLIGHT_POD_UID"] == "metadata.uid"
    assert given["HYPERLIGHT_NODE_NAME"] == "spec.nodeName"
    assert given["HYPERLIGHT_HTTP_ADDRESS"] == f"0.0.0.0:{HTTP_PORT[DRA]}"
    assert given["HYPERLIGHT_DEV_DIR"] == "/dev" and given["HYPERLIGHT_HOST_DEV_DIR"] == "/host-dev"


def test_the_kubelet_s_plugin_directories_are_mounted_at_the_kubelet_s_paths() -> None:
    """The registration socket goes where the plugin watcher looks, and the service socket's
    path, which GetInfo hands the kubelet, must be the same inside and out: each kubelet
    directory is mounted at its host path, the one the driver's settings name."""
    ds = driver(render(DRA_ON))
    c, found = container(ds), mounts(driver(render(DRA_ON)))
    env = {e["name"]: e.get("value") for e in c["env"]}
    defaults = DraPluginSettings()
    for var, path, kind in (("HYPERLIGHT_REGISTRY_DIR", defaults.registry_dir, "Directory"),
                            ("HYPERLIGHT_DRA_DIR", defaults.plugin_dir, "DirectoryOrCreate")):
        assert env[var] == str(path), var
        host = volumes(ds)[found[str(path)]["name"]]["hostPath"]
        assert host == {"path": str(path), "type": kind}, var
        assert not found[str(path)].get("readOnly"), var
    assert str(defaults.plugin_dir).endswith("/plugins/" + DRA_DRIVER)
    assert found["/host-dev"]["readOnly"] and found["/host-dev"]["recursiveReadOnly"] == "IfPossible"
    assert volumes(ds)[found["/var/run/cdi"]["name"]]["hostPath"]["path"] == "/var/run/cdi"


def test_the_driver_and_the_main_daemon_are_exclusive_per_node() -> None:
    """A node has three hyperlight.dev/device-access, one consumer's (its pod, its surge pod and
    one still terminating). The driver
    runs on the nodes also labelled hyperlight.dev/dra=true, the main daemon (only while the
    driver is enabled) on the others but those labelled hyperlight.dev/dra=moving (neither runs
    there: deploy/move-node.sh lets one go before the other comes), whatever affinity the values
    add; the bootstrap on both."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}
    away = {"key": ON_NODES[0], "operator": "NotIn", "values": [ON_NODES[1], "moving"]}
    for values in (DRA_ON, {**DRA_ON, "affinity": affinity}):
        sets = daemonsets(render(values))
        assert pod(sets[DRA])["nodeSelector"] == {**pod(sets[MAIN])["nodeSelector"], ON_NODES[0]: ON_NODES[1]}
        terms = pod(sets[MAIN])["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert terms and all(away in t["matchExpressions"] for t in terms), terms
        assert pod(sets[BOOTSTRAP]).get("affinity", {}) == values.get("affinity", {})
        assert pod(sets[DRA]).get("affinity", {}) == values.get("affinity", {})
    assert "affinity" not in pod(daemonsets(render())[MAIN]), "unchanged while the driver is off"


def test_only_the_driver_gets_a_token_projected_and_expiring_where_the_client_reads_it() -> None:
    """No pod mounts the ServiceAccount's token (automountServiceAccountToken false, pod and
    account); the driver's pod gets a projected one bound to it, that expires, with the CA of
    kube-root-ca.crt and its namespace, read-only at the path hlplugin.kubeapi reads."""
    objs = render(DRA_ON)
    ds = driver(objs)
    account = find(objs, "ServiceAccount", pod(ds)["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert pod(ds)["automountServiceAccountToken"] is False
    where = str(kubeapi_config.SERVICE_ACCOUNT)
    assert where == str(dra.SERVICE_ACCOUNT_TOKEN.parent)
    mount = mounts(ds)[where]
    assert mount["readOnly"] is True
    sources = volumes(ds)[mount["name"]]["projected"]["sources"]
    (token,) = [s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s]
    assert token["path"] == dra.SERVICE_ACCOUNT_TOKEN.name and "audience" not in token
    assert 600 <= token["expirationSeconds"] <= 3600
    (ca,) = [s["configMap"] for s in sources if "configMap" in s]
    assert ca == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    (namespace,) = [s["downwardAPI"] for s in sources if "downwardAPI" in s]
    assert namespace == {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}
    for name in (MAIN, BOOTSTRAP):
        other = daemonsets(objs)[name]
        assert not [v for v in pod(other)["volumes"] if "projected" in v or "secret" in v], name
        assert find(objs, "ServiceAccount", pod(other)["serviceAccountName"])[
            "automountServiceAccountToken"] is False


def driver_policy(objs: Objects) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == "NetworkPolicy" and o["spec"]["podSelector"]
                == {"matchLabels": {"app.kubernetes.io/name": DRA}}]
    return found


def test_the_driver_may_reach_the_api_server_and_nothing_else() -> None:
    """Its NetworkPolicy selects its pods, admits only the metrics scrapers on its port, and lets
    it connect only to dra.apiServer's addresses and ports; the other daemons keep `egress: []`
    (check_plugin_daemonsets); with networkPolicy off there is none."""
    objs = render(DRA_ON)
    spec = driver_policy(objs)["spec"]
    labels = driver(objs)["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["ingress"] == [{"from": [SCRAPERS], "ports": [{"protocol": "TCP", "port": HTTP_PORT[DRA]}]}]
    assert spec["egress"] == [{
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
        "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}]
    narrowed = render({"dra": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [6443]}}})
    assert driver_policy(narrowed)["spec"]["egress"] == [
        {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"protocol": "TCP", "port": 6443}]}]
    assert not [o for o in render({**DRA_ON, "networkPolicy": {"enabled": False}})
                if o["kind"] == "NetworkPolicy"]


def device_class(values: dict[str, Any]) -> dict[str, Any]:
    (cls,) = [o for o in render(values) if o["kind"] == "DeviceClass"]
    return cls


def test_the_device_class_selects_the_driver() -> None:
    cls = device_class(DRA_ON)
    assert cls["apiVersion"] == "resource.k8s.io/v1" and cls["metadata"]["name"] == DRA_DRIVER
    assert cls["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]
    assert "DeviceClass" not in {o["kind"] for o in render()}


def test_the_device_class_stands_for_the_device_plugin_s_resource() -> None:
    """KEP-5004 (issue 42 item 1): by default the class carries the device plugin's resource
    name, so a pod asking `hyperlight.dev/hypervisor` is served by the driver on a node with none
    of it allocatable; "" leaves the class with its selector only (ResourceClaims only)."""
    assert device_class(DRA_ON)["spec"] == {
        "selectors": [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}],
        "extendedResourceName": HYPERVISOR_RESOURCE}
    assert HYPERVISOR_RESOURCE == "hyperlight.dev/hypervisor"
    assert device_class(merged(DRA_ON, {"dra": {"extendedResourceName": "example.com/vm"}}))["spec"][
        "extendedResourceName"] == "example.com/vm"
    off = device_class(merged(DRA_ON, {"dra": {"extendedResourceName": ""}}))
    assert off["spec"] == {"selectors": [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]}


@pytest.mark.parametrize("name", [
    "hypervisor",                    # no domain: a native resource name
    "kubernetes.io/hypervisor",      # the kubernetes.io domain is Kubernetes' own
    "node.kubernetes.io/kvm",
    "requests.hyperlight.dev/kvm",   # a quota name, not a resource
    "Hyperlight.dev/kvm",            # the domain is a DNS subdomain: lower case
    "hyperlight.dev/-kvm",           # the name begins and ends alphanumeric
    "hyperlight.dev/" + "k" * 64,    # at most 63 characters
    "hyperlight.dev/kvm/0",
])
def test_the_schema_refuses_a_name_the_api_server_would(name: str) -> None:
    """The API server refuses a DeviceClass whose extendedResourceName is not an extended resource
    name (v1helper.IsExtendedResourceName): the chart refuses it first, at install."""
    refused = refusal({"dra": {"enabled": True, "extendedResourceName": name}})
    assert "at '/dra/extendedResourceName'" in refused


# --- RBAC: exactly what the code calls ------------------------------------------------------------


def granted(objs: Objects) -> dict[tuple[str, str], set[str]]:
    """(API group, resource): verbs, of the roles bound to the driver's ServiceAccount."""
    account = pod(driver(objs))["serviceAccountName"]
    out: dict[tuple[str, str], set[str]] = {}
    for binding in (o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} not in binding["subjects"]:
            continue
        role = find(objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for rule in role["rules"]:
            assert not rule.get("resourceNames") and "*" not in rule["verbs"] + rule["resources"]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def rbac_of(path: str) -> tuple[str, str]:
    """(API group, resource) of a request's path."""
    parts = path.split("?")[0].strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return ("" if parts[0] == "api" else parts[1]), rest[0]


async def called_by_the_slice_controller() -> dict[tuple[str, str], set[str]]:
    """Every (group, resource): verbs the slice controller sends, through each path it has:
    publish, a deleted slice put back, an edited one updated, a taint on and off."""
    slices = RESOURCE_SLICES.path()
    name = f"{NODE}-{DRA_DRIVER}"
    async with FakeApiServer() as server:
        add_node(server)
        client = Client(Config.from_url(server.url), Backoff(attempts=2, sleep=Sleeps(), random=lambda: 1.0))
        controller = SliceController(client, NODE, NodeDevice("kvm", kvm_api_version=12))
        task = asyncio.create_task(controller.run())

        def stored() -> dict[str, Any] | None:
            return server.objects.get(slices, {}).get(("", name))

        async def published(check: Any = lambda s: True) -> dict[str, Any]:
            await wait_until(lambda: (s := stored()) is not None and controller.published == s and check(s),
                             10, "published")
            found = stored()
            assert found is not None
            return found

        try:
            first = await published()
            server.remove(slices, name)
            await published(lambda s: s["metadata"]["uid"] != first["metadata"]["uid"])
            again = stored()
            assert again is not None
            server.put(slices, {**again, "spec": {**again["spec"], "devices": []}})
            await published(lambda s: s["spec"]["devices"])
            controller.set_healthy(False)
            await published(lambda s: "taints" in s["spec"]["devices"][0])
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        out: dict[tuple[str, str], set[str]] = {}
        for seen in server.requests:
            out.setdefault(rbac_of(seen.path), set()).add(seen.verb)
        return out


@pytest.mark.guard(30)
async def test_rbac_grants_what_the_driver_calls_and_nothing_more() -> None:
    """The driver's ServiceAccount is granted what the slice controller sends (ResourceSlices:
    get, list, watch, create, update; the Node: get, for the uid of the slice's ownerReference),
    and beside that only get on ResourceClaims (Prepare reads a claim's allocation): no delete (a
    stopping driver leaves its slice), no patch, no claim status, nothing namespaced."""
    objs = render(DRA_ON)
    rights = granted(objs)
    used = await called_by_the_slice_controller()
    for resource, verbs in used.items():
        assert verbs <= rights.get(resource, set()), f"{resource}: {verbs - rights.get(resource, set())}"
    claims = ("resource.k8s.io", "resourceclaims")
    assert {k: v for k, v in rights.items() if k != claims} == used, "granted but never called"
    assert rights[claims] == {"get"}
    assert used[("resource.k8s.io", "resourceslices")] == {"get", "list", "watch", "create", "update"}
    assert used[("", "nodes")] == {"get"}
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    (binding,) = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod(driver(objs))["serviceAccountName"],
                                    "namespace": NAMESPACE}]
