"""What the deploy tests share (tests/test_deploy*.py, tests/test_chart*.py): the plugin's objects
as deploy/base and the chart make them, the properties both must have, and the figures they are
judged by."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hlplugin import config
from hlplugin.deviceplugin.process import probeclearance

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GITHUB = ROOT / ".github"
WORKFLOWS = sorted((GITHUB / "workflows").glob("*.yml"))
K8S_VERSION = "1.34"

NAMESPACE = "hyperlight-system"
BOOTSTRAP = "hyperlight-device-access"
MAIN = "hyperlight-device-plugin"
DRA = "hyperlight-dra"  # the DRA driver's DaemonSet, the chart's only (dra.enabled)
SUBCOMMAND = {MAIN: "serve", BOOTSTRAP: "bootstrap", DRA: "dra"}
HTTP_PORT = {MAIN: 8080, BOOTSTRAP: 8081, DRA: 8082}
# Peak RSS (VmHWM) in MiB as measured by benchmarks/run.py, recorded in docs/benchmarks.md.
MEASURED_PEAK_MIB = {MAIN: 48.2, BOOTSTRAP: 45.0}
# Seconds from container start to /healthz answering, at most, under the 200m CPU limit (a
# cgroup CPU quota of 20 ms per 100 ms; 7 starts each, median 0.9 s), and from SIGTERM to exit.
MEASURED_START_S = {MAIN: 1.31, BOOTSTRAP: 0.99}
MEASURED_STOP_S = 0.8
HEALTHZ_BUDGET_S = 2.0  # /healthz gives the event loop this long before answering 503
KUBELET_DIR = "/var/lib/kubelet/device-plugins"
WORKLOAD_UID = 65534

CHECKOV_ENV = {"BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"}


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **{"timeout": 100, **kwargs})


def mib(quantity: str) -> float:
    """The manifests state memory in Mi; any other unit fails here, loudly."""
    return float(quantity.removesuffix("Mi"))


def millicores(quantity: str) -> float:
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) for every object that makes pods (a CronJob's is a level deeper)."""
    for obj in objects:
        spec = obj.get("spec", {})
        spec = spec.get("jobTemplate", {}).get("spec", spec)
        spec = spec.get("template", {}).get("spec", spec)
        if "containers" in spec:
            yield obj, spec


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"{container['name']}: no port named {port}"
    return int(named[0])


def workflow(name: str) -> dict[str, Any]:
    data = yaml.safe_load((GITHUB / "workflows" / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def steps_of(wf: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for job in wf["jobs"].values():
        yield from job.get("steps", [])


PLUGIN_MOUNTS = {  # name: {mountPath: (hostPath, type, readOnly)}
    BOOTSTRAP: {KUBELET_DIR: (KUBELET_DIR, "Directory", False), "/host-dev": ("/dev", "Directory", True)},
    MAIN: {KUBELET_DIR: (KUBELET_DIR, "Directory", False), "/host-dev": ("/dev", "Directory", True),
           "/var/run/cdi": ("/var/run/cdi", "DirectoryOrCreate", False)},
}
CLUSTER_SCOPED = {"Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "ClusterRole", "ClusterRoleBinding", "DeviceClass"}
SCRAPERS = {"namespaceSelector": {"matchLabels": {"hyperlight.dev/metrics-scraper": "true"}}}


def check_plugin_daemonsets(objs: list[dict[str, Any]], kustomization: str) -> None:
    """The DaemonSets' properties (shared with tests/test_chart.py, which checks the chart's)."""
    for obj in objs:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]
    operations = (ROOT / "docs/operations.md").read_text()
    # The DRA driver's policy, which lets it reach the API server, is tests/test_chart_dra.py's.
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"
                and o["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") != DRA]
    # Network policies: no egress, and ingress only over TCP from namespaces an administrator
    # labelled, not every pod in the cluster (the kubelet's probes come from the node, which a
    # NetworkPolicy never blocks).
    for policy in policies:
        spec = policy["spec"]
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, policy["metadata"]["name"]
        assert spec.get("egress", []) == [], "the daemons open no network connections"
        for rule in spec["ingress"]:
            assert rule.get("from"), f"{policy['metadata']['name']}: no `from` admits everyone"
            for peer in rule["from"]:
                assert peer == SCRAPERS, peer
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP"
    images = set()
    for name in (BOOTSTRAP, MAIN):
        ds = find(objs, "DaemonSet", name)
        pod = ds["spec"]["template"]["spec"]
        (c,) = containers(pod)
        images.add(c["image"])
        where = f"{kustomization}: {name}"

        # Locked down.
        for key in ("hostNetwork", "hostPID", "hostIPC", "automountServiceAccountToken"):
            assert pod.get(key) is False, f"{where}: {key} must be explicitly false"
        account = find(objs, "ServiceAccount", pod["serviceAccountName"])
        assert account["automountServiceAccountToken"] is False, where
        assert pod["nodeSelector"]["hyperlight.dev/enabled"] == "true", where
        assert pod["priorityClassName"] == "system-node-critical", where
        tolerations = {("CriticalAddonsOnly", "Exists"), ("hyperlight.dev/hypervisor", "Exists")}
        assert tolerations <= {(t["key"], t["operator"]) for t in pod["tolerations"]}, where
        assert not any(t.get("operator") == "Exists" and "key" not in t for t in pod["tolerations"])
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        sc = c["securityContext"]
        for key, value in (("privileged", False), ("allowPrivilegeEscalation", False),
                           ("readOnlyRootFilesystem", True), ("runAsNonRoot", False)):
            assert sc[key] is value, f"{where}: {key}"
        assert sc["capabilities"] == {"drop": ["ALL"]}, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert sc["runAsUser"] == 0, where
        assert c["terminationMessagePath"], where
        assert not c["terminationMessagePath"].startswith(("/dev/", "/host-dev/")), where
        assert c["args"] == [SUBCOMMAND[name]], where
        # The environment is the CLI's, with values the daemon accepts.
        names = {MAIN: config.SERVE_OPTIONS, BOOTSTRAP: config.BOOTSTRAP_OPTIONS}[name]
        settings = {o.env: o for o in map(config.OPTIONS.__getitem__, names) if o.env}
        for var, text in env_of(c).items():
            assert var in settings, f"{where}: {var} is not a `{SUBCOMMAND[name]}` setting"
            settings[var].parse(text)  # raises on a value the daemon would reject

        # Probes on the HTTP port, the only one the network policies admit.
        port = HTTP_PORT[name]
        assert env_of(c)["HYPERLIGHT_HTTP_ADDRESS"] == f"0.0.0.0:{port}", where
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"),
                            ("startupProbe", "/healthz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path and port_number(c, get["port"]) == port, f"{where}: {probe}"
            # Each may take 5 s: on a busy node an answer from state waits for its share of a CPU
            # (over 3 s once, a Warning; docs/operations.md "CPU under load").
            assert c[probe]["timeoutSeconds"] >= 5, f"{where}: {probe}"
        labels = ds["spec"]["template"]["metadata"]["labels"]
        selecting = [p["spec"] for p in policies
                     if p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()]
        assert selecting, f"{kustomization}: no NetworkPolicy selects {name}"
        admitted = {port_number(c, p["port"]) for s in selecting for r in s["ingress"] for p in r["ports"]}
        assert admitted == {port}, f"{kustomization}: {name} admits {admitted}"

        # Resources from the measured peak; only the main daemon asks for device access.
        res = c["resources"]
        for kind in ("cpu", "memory"):
            assert kind in res["requests"] and kind in res["limits"], f"{where}: {kind}"
        assert millicores(res["requests"]["cpu"]) <= millicores(res["limits"]["cpu"]), where
        assert mib(res["requests"]["memory"]) <= mib(res["limits"]["memory"]), where
        assert mib(res["limits"]["memory"]) >= 1.5 * MEASURED_PEAK_MIB[name], where
        assert mib(res["requests"]["memory"]) >= MEASURED_PEAK_MIB[name], where
        got = [res[k].get("hyperlight.dev/device-access") for k in res]
        assert got == (["1", "1"] if name == MAIN else [None, None]), name

        # Host paths: the kubelet's socket dir, the CDI dir (main only), /dev read-only.
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {}
        for m in c["volumeMounts"]:
            host = volumes[m["name"]]["hostPath"]
            mounts[m["mountPath"]] = (host["path"], host["type"], m.get("readOnly", False))
            if m["mountPath"] == "/host-dev":
                assert m.get("recursiveReadOnly") == "IfPossible", name
        assert mounts == PLUGIN_MOUNTS[name], f"{kustomization}: {name} mounts {mounts}"
        assert len(volumes) == len(mounts), f"{kustomization}: {name} has unused volumes"

        # Start, stop and roll without traps. A node-critical pod must come back after a reboot
        # while the registry is unreachable.
        assert c["imagePullPolicy"] == "IfNotPresent", where
        # The image is built for amd64 only (test_workflows), and the probe runs x86 code.
        assert pod["nodeSelector"]["kubernetes.io/arch"] == "amd64", where
        # The first check comes after the measured start, so a normal start logs no failure.
        startup = c["startupProbe"]  # on the HTTP port (above)
        assert MEASURED_START_S[name] < startup["initialDelaySeconds"] <= 3 * MEASURED_START_S[name]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20, "room for a slow start"
        # Grace and liveness from the measured figures: a hung daemon's worst case, stated.
        grace = pod["terminationGracePeriodSeconds"]
        assert 3 * MEASURED_STOP_S <= grace <= 10, where
        # A stop waits for the next readiness probe, due this period after a pod's only one.
        assert c["readinessProbe"]["periodSeconds"] == probeclearance.MANIFEST_PERIOD, where
        live = c["livenessProbe"]
        assert live["timeoutSeconds"] > HEALTHZ_BUDGET_S, "the 503 must arrive before the timeout"
        assert live["failureThreshold"] >= 2, "one slow answer must not restart a node's plugin"
        worst = live["periodSeconds"] * live["failureThreshold"] + live["timeoutSeconds"] + grace
        assert f"restarted within {worst} s" in operations, f"{where}: docs/operations.md"
        # A broken node's NotReady pod must not stall every later rollout (docs: "Upgrade"), and
        # a surge (the bootstrap's second device-access slot) fails no pod.
        strategy = ds["spec"]["updateStrategy"]
        assert strategy["type"] == "RollingUpdate", where
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0, where  # surge: tests/test_surge.py
        assert re.fullmatch(r"\d+%", str(strategy["rollingUpdate"]["maxSurge"])), where
        assert f"maxSurge: {strategy['rollingUpdate']['maxSurge']}" in operations
    assert len(images) == 1, f"{kustomization}: both daemons must run one image, got {images}"


RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What the Restricted Pod Security Standard (latest) would reject in a pod spec."""
    pod_sc = spec.get("securityContext", {})
    rules = {host: bool(spec.get(host)) for host in ("hostNetwork", "hostPID", "hostIPC")}
    for volume in spec.get("volumes", []):
        rules[f"volume {volume['name']}"] = not set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES
    rules |= {"sysctls": bool(pod_sc.get("sysctls")), "pod runAsUser 0": pod_sc.get("runAsUser") == 0}
    for c in containers(spec):
        sc = c.get("securityContext", {})
        caps = sc.get("capabilities", {})
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        for rule, broken in {
            "privileged": bool(sc.get("privileged")),
            "allowPrivilegeEscalation": sc.get("allowPrivilegeEscalation") is not False,
            "capabilities not dropped": "ALL" not in caps.get("drop", []),
            "capabilities added": bool(set(caps.get("add", [])) - {"NET_BIND_SERVICE"}),
            "runAsNonRoot": not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")),
            "runAsUser 0": sc.get("runAsUser", pod_sc.get("runAsUser")) == 0,
            f"seccompProfile {seccomp}": seccomp not in ("RuntimeDefault", "Localhost"),
            "hostPort": any(p.get("hostPort") for p in c.get("ports", [])),
            "procMount": sc.get("procMount", "Default") != "Default",
        }.items():
            rules[f"{c['name']}: {rule}"] = broken
    return [rule for rule, broken in rules.items() if broken]
