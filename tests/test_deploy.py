"""Offline checks of the deployment path (issue 7): manifests, image, workflows.

No cluster and no network: kustomize renders every kustomization, the result is validated
against the Kubernetes schemas and walked for the security properties the issue lists, and
the static analysers (checkov, hadolint, check-jsonschema, zizmor, yamllint, shellcheck) run
on everything they cover. The Python tools come from requirements-deploy-checks.txt, found on
PATH or in $DEPLOY_CHECKS_BIN (a virtual environment's bin directory); kubectl and shellcheck
come from the system. A missing tool skips its test and says which one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GITHUB = ROOT / ".github"
WORKFLOWS = sorted((GITHUB / "workflows").glob("*.yml"))
KUSTOMIZATIONS = ("base", "overlays/kind", "overlays/aks", "examples", "overlays/kind/examples")
# Each overlay with deploy/components/monitoring on top, as an operator's overlay includes it.
MONITORED = {f"{o}+monitoring": o for o in ("overlays/kind", "overlays/aks")}
# Prometheus Operator kinds: CRDs, so kubernetes-validate has no schema for them (it warns and
# skips them); tests/test_monitoring.py checks them instead (promtool, and the PodMonitor's
# selector and port against the DaemonSets).
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
PLUGIN_KUSTOMIZATIONS = ("base", "overlays/kind", "overlays/aks")
EXAMPLE_KUSTOMIZATIONS = ("examples", "overlays/kind/examples")
K8S_VERSION = "1.34"

NAMESPACE = "hyperlight-system"
BOOTSTRAP = "hyperlight-device-access"
MAIN = "hyperlight-device-plugin"
SUBCOMMAND = {MAIN: "serve", BOOTSTRAP: "bootstrap"}
HTTP_PORT = {MAIN: 8080, BOOTSTRAP: 8081}
# Peak RSS (VmHWM) in MiB as measured by benchmarks/run.py, recorded in docs/benchmarks.md.
MEASURED_PEAK_MIB = {MAIN: 48.2, BOOTSTRAP: 45.0}
# Seconds from container start to /healthz answering, at most, under the 200m CPU limit (a
# cgroup CPU quota of 20 ms per 100 ms; 7 starts each, median 0.9 s), and from SIGTERM to exit.
MEASURED_START_S = {MAIN: 1.31, BOOTSTRAP: 0.99}
MEASURED_STOP_S = 0.8
HEALTHZ_BUDGET_S = 2.0  # /healthz gives the event loop this long before answering 503
KUBELET_DIR = "/var/lib/kubelet/device-plugins"
WORKLOAD_UID = 65534

PIP_HINT = "pip install -r requirements-deploy-checks.txt"
TOOL_HINTS = {
    "kubectl": "install kubectl (1.27+ for its built-in kustomize v5)",
    "shellcheck": "apt-get install shellcheck",
}
CHECKOV_ENV = {"BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"}
METRICS = (
    "hyperlight_health_condition",
    "hyperlight_health_transitions_total",
    "hyperlight_probe_duration_seconds",
    "hyperlight_probe_failures_total",
    "hyperlight_cdi_repairs_total",
    "hyperlight_cdi_refusals_total",
    "hyperlight_allocations_total",
    "hyperlight_registrations_total",
    "hyperlight_listandwatch_streams",
    "hyperlight_devices_advertised",
    "hyperlight_devices_healthy",
    "hyperlight_build_info",
    "hyperlight_ready",
)


# --- helpers -------------------------------------------------------------------------------


def tool(name: str) -> str:
    """Path of a command-line tool, or skip the test naming what to install."""
    extra = os.environ.get("DEPLOY_CHECKS_BIN")
    found = (shutil.which(name, path=extra) if extra else None) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: {TOOL_HINTS.get(name, PIP_HINT)}")
    return found


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 100)
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2**20


def millicores(quantity: str) -> float:
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) for every object that makes pods."""
    for obj in objects:
        if obj["kind"] == "Pod":
            yield obj, obj["spec"]
        elif obj["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            yield obj, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


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


def interpreter_with(module: str) -> str:
    """A Python that can import `module`: this one, or the one running the deploy tools."""
    candidates = [sys.executable]
    extra = os.environ.get("DEPLOY_CHECKS_BIN")
    for script in ("kubernetes-validate", "checkov", "yamllint"):
        path = (shutil.which(script, path=extra) if extra else None) or shutil.which(script)
        if path:
            first = Path(path).read_bytes()[:256].split(b"\n", 1)[0]
            if first.startswith(b"#!"):
                candidates.append(first[2:].decode().strip().split()[0])
    for python in candidates:
        try:
            if run([python, "-c", f"import {module}"], timeout=30).returncode == 0:
                return python
        except OSError:
            continue
    pytest.skip(f"no Python here can import {module}: {PIP_HINT}")


def shell_scripts() -> list[Path]:
    """Every shell script that this repository ships or runs."""
    scripts = set(DEPLOY.rglob("*.sh")) | set(GITHUB.rglob("*.sh"))
    for path in DEPLOY.rglob("*"):
        first = path.read_bytes()[:128].split(b"\n", 1)[0] if path.is_file() else b""
        if first.startswith(b"#!") and first.endswith((b"/sh", b" sh", b"bash")):
            scripts.add(path)
    ci_run = ROOT / ".ci" / "run"
    if ci_run.is_file():
        scripts.add(ci_run)
    return sorted(scripts)


# --- rendering -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    kubectl = tool("kubectl")
    out = {}
    for name in KUSTOMIZATIONS:
        result = run([kubectl, "kustomize", str(DEPLOY / name)])
        assert result.returncode == 0, f"kubectl kustomize deploy/{name}:\n{result.stderr}"
        out[name] = result.stdout
    for name, overlay in MONITORED.items():
        work = tmp_path_factory.mktemp("monitored")
        (work / "kustomization.yaml").write_text(yaml.safe_dump({  # kustomize wants relative paths
            "resources": [os.path.relpath(DEPLOY / overlay, work)],
            "components": [os.path.relpath(DEPLOY / "components/monitoring", work)],
        }))
        result = run([kubectl, "kustomize", str(work)])
        assert result.returncode == 0, f"kubectl kustomize {name}:\n{result.stderr}"
        out[name] = result.stdout
    return out


@pytest.fixture(scope="module")
def objects(rendered: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in rendered.items()}


def test_every_kustomization_renders(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name in PLUGIN_KUSTOMIZATIONS:
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objects[name]}
        assert ("Namespace", NAMESPACE) in kinds
        assert ("DaemonSet", MAIN) in kinds and ("DaemonSet", BOOTSTRAP) in kinds, name
        for obj in objects[name]:
            if obj["kind"] not in ("Namespace",) and not obj["kind"].startswith("ValidatingAdm"):
                assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]
    for name in ("overlays/kind", "overlays/aks"):
        kinds = {o["kind"] for o in objects[name]}
        assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds, name
    for name in EXAMPLE_KUSTOMIZATIONS:
        assert {o["kind"] for o in objects[name]} >= {"Namespace", "Pod", "Deployment"}, name


def test_kind_cluster_config_is_not_a_resource() -> None:
    config = yaml.safe_load((DEPLOY / "overlays/kind/kind-config.yaml").read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"].startswith("kind.x-k8s.io/")
    (node,) = config["nodes"]
    assert re.fullmatch(r"kindest/node:v1\.\d+\.\d+@sha256:[0-9a-f]{64}", node["image"])
    assert {"hostPath": "/dev/kvm", "containerPath": "/dev/kvm"} in node["extraMounts"]
    kustomization = yaml.safe_load((DEPLOY / "overlays/kind/kustomization.yaml").read_text())
    assert "kind-config.yaml" not in kustomization.get("resources", [])
    e2e = (GITHUB / "workflows/e2e.yml").read_text()
    assert f"CLUSTER: {config['name']}" in e2e and f"NODE: {config['name']}-control-plane" in e2e


def test_rendered_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, str], objects: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    validate = tool("kubernetes-validate")
    files = []
    for name, text in rendered.items():
        files.append(tmp_path / (name.replace("/", "-") + ".yaml"))
        files[-1].write_text(text)
    result = run([validate, "-k", K8S_VERSION, "--strict", *map(str, files)])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    crds = [o for objs in objects.values() for o in objs if o["kind"] in CRD_KINDS]
    assert len(crds) == 2 * len(MONITORED)
    assert output.count("passed for resource") == sum(map(len, objects.values())) - len(crds), output
    unvalidated = re.findall(r"Couldn't find schema for kind (\w+)", output)
    assert sorted(unvalidated) == sorted(o["kind"] for o in crds), output


def test_monitoring_component_adds_only_its_two_objects(
    objects: dict[str, list[dict[str, Any]]],
) -> None:
    for name, overlay in MONITORED.items():
        def key(o: dict[str, Any]) -> tuple[str, str]:
            return o["kind"], o["metadata"]["name"]

        added = sorted(map(key, objects[name]))
        for obj in objects[overlay]:
            added.remove(key(obj))
        assert added == [("PodMonitor", "hyperlight"), ("PrometheusRule", "hyperlight")], name
        assert [o for o in objects[name] if o["kind"] not in CRD_KINDS] == objects[overlay], name


# --- the plugin's pods -----------------------------------------------------------------------


def plugin_daemonsets(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name in (BOOTSTRAP, MAIN):
        yield name, find(objects, "DaemonSet", name)


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_plugin_pods_are_locked_down(objects: dict[str, list[dict[str, Any]]], kustomization: str) -> None:
    objs = objects[kustomization]
    images = set()
    for name, ds in plugin_daemonsets(objs):
        pod = ds["spec"]["template"]["spec"]
        where = f"{kustomization}: {name}"
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert pod.get(host) is False, f"{where}: {host} must be explicitly false"
        assert pod["automountServiceAccountToken"] is False, where
        account = find(objs, "ServiceAccount", pod["serviceAccountName"])
        assert account["automountServiceAccountToken"] is False, where
        assert pod["nodeSelector"]["hyperlight.dev/enabled"] == "true", where
        assert pod["priorityClassName"] == "system-node-critical", where
        tolerations = {(t["key"], t["operator"]) for t in pod["tolerations"]}
        assert {("CriticalAddonsOnly", "Exists"), ("hyperlight.dev/hypervisor", "Exists")} <= (tolerations), (
            where
        )
        assert not any(t.get("operator") == "Exists" and "key" not in t for t in pod["tolerations"])
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        (c,) = containers(pod)
        images.add(c["image"])
        sc = c["securityContext"]
        assert sc["privileged"] is False, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"] == {"drop": ["ALL"]}, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False, where
        assert c["terminationMessagePath"], where
        assert not c["terminationMessagePath"].startswith(("/dev/", "/host-dev/")), where
        assert c["args"] == [SUBCOMMAND[name]], where

        port = HTTP_PORT[name]
        assert env_of(c)["HYPERLIGHT_HTTP_ADDRESS"] == f"0.0.0.0:{port}", where
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path and port_number(c, get["port"]) == port, f"{where}: {probe}"

        res = c["resources"]
        for kind in ("cpu", "memory"):
            assert kind in res["requests"] and kind in res["limits"], f"{where}: {kind}"
        assert millicores(res["requests"]["cpu"]) <= millicores(res["limits"]["cpu"]), where
        assert mib(res["requests"]["memory"]) <= mib(res["limits"]["memory"]), where
        assert mib(res["limits"]["memory"]) >= 1.5 * MEASURED_PEAK_MIB[name], where
        assert mib(res["requests"]["memory"]) >= MEASURED_PEAK_MIB[name], where
    assert len(images) == 1, f"{kustomization}: both daemons must run one image, got {images}"


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_plugin_mounts(objects: dict[str, list[dict[str, Any]]], kustomization: str) -> None:
    expected = {
        # name: {mountPath: (hostPath, type, readOnly)}
        BOOTSTRAP: {
            KUBELET_DIR: (KUBELET_DIR, "Directory", False),
            "/host-dev": ("/dev", "Directory", True),
        },
        MAIN: {
            KUBELET_DIR: (KUBELET_DIR, "Directory", False),
            "/var/run/cdi": ("/var/run/cdi", "DirectoryOrCreate", False),
            "/host-dev": ("/dev", "Directory", True),
        },
    }
    for name, ds in plugin_daemonsets(objects[kustomization]):
        pod = ds["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (c,) = containers(pod)
        mounts = {}
        for m in c["volumeMounts"]:
            host = volumes[m["name"]]["hostPath"]
            mounts[m["mountPath"]] = (host["path"], host["type"], m.get("readOnly", False))
            if m["mountPath"] == "/host-dev":
                assert m.get("recursiveReadOnly") == "IfPossible", name
        assert mounts == expected[name], f"{kustomization}: {name} mounts {mounts}"
        assert len(volumes) == len(mounts), f"{kustomization}: {name} has unused volumes"


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_only_the_main_plugin_requests_device_access(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    for name, ds in plugin_daemonsets(objects[kustomization]):
        (c,) = containers(ds["spec"]["template"]["spec"])
        got = [c["resources"][k].get("hyperlight.dev/device-access") for k in c["resources"]]
        assert got == (["1", "1"] if name == MAIN else [None, None]), name
    rolling = find(objects[kustomization], "DaemonSet", MAIN)["spec"]["updateStrategy"]
    assert rolling["rollingUpdate"]["maxSurge"] == 0, "one device-access per node: never surge"


def test_no_container_mounts_anything_over_dev(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        for obj, spec in pod_specs(objs):
            for c in containers(spec):
                for m in c.get("volumeMounts", []):
                    path = m["mountPath"].rstrip("/")
                    assert path != "/dev" and not path.startswith("/dev/"), (name, obj, m)


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_plugin_pods_start_stop_and_roll_without_traps(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    operations = (ROOT / "docs/operations.md").read_text()
    for name, ds in plugin_daemonsets(objects[kustomization]):
        where = f"{kustomization}: {name}"
        pod = ds["spec"]["template"]["spec"]
        (c,) = containers(pod)
        # A node-critical pod must come back after a reboot while the registry is unreachable.
        assert c["imagePullPolicy"] == "IfNotPresent", where
        # The image is built for amd64 only (release.yml below), and the probe runs x86 code.
        assert pod["nodeSelector"]["kubernetes.io/arch"] == "amd64", where
        # The first check comes after the measured start, so a normal start logs no failure.
        startup = c["startupProbe"]
        assert startup["httpGet"]["path"] == "/healthz", where
        assert port_number(c, startup["httpGet"]["port"]) == HTTP_PORT[name], where
        assert MEASURED_START_S[name] < startup["initialDelaySeconds"] <= 3 * MEASURED_START_S[name]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20, "room for a slow start"
        # Grace and liveness from the measured figures: a hung daemon's worst case, stated.
        grace = pod["terminationGracePeriodSeconds"]
        assert 3 * MEASURED_STOP_S <= grace <= 10, where
        live = c["livenessProbe"]
        assert live["timeoutSeconds"] > HEALTHZ_BUDGET_S, "the 503 must arrive before the timeout"
        assert live["failureThreshold"] >= 2, "one slow answer must not restart a node's plugin"
        worst = live["periodSeconds"] * live["failureThreshold"] + live["timeoutSeconds"] + grace
        assert f"restarted within {worst} s" in operations, f"{where}: docs/operations.md"
        # A broken node's NotReady pod must not stall every later rollout (docs: "Upgrade").
        strategy = ds["spec"]["updateStrategy"]
        assert strategy["type"] == "RollingUpdate", where
        assert re.fullmatch(r"\d+%", str(strategy["rollingUpdate"]["maxUnavailable"])), where
        assert strategy["rollingUpdate"]["maxSurge"] == 0, where
        assert f"maxUnavailable: {strategy['rollingUpdate']['maxUnavailable']}" in operations
    build = next(s for s in steps_of(workflow("release.yml"))
                 if s.get("uses", "").startswith("docker/build-push"))  # fmt: skip
    assert build["with"].get("platforms", "linux/amd64") == "linux/amd64", (
        "a multi-arch release: widen the kubernetes.io/arch node selector")


def test_examples_tolerate_the_dedicated_pool_taint(objects: dict[str, list[dict[str, Any]]]) -> None:
    operations = (ROOT / "docs/operations.md").read_text()
    taints = re.findall(r"--node-taints ([\w./-]+)=([\w.-]+):(\w+)", operations)
    assert taints, "docs/operations.md suggests a taint for dedicated pools"
    for kustomization in EXAMPLE_KUSTOMIZATIONS:
        for obj, spec in pod_specs(objects[kustomization]):
            for key, value, effect in taints:
                assert any(
                    t["key"] == key and t.get("effect", effect) == effect
                    and (t["operator"] == "Exists" or t.get("value") == value)
                    for t in spec.get("tolerations", [])
                ), f"{kustomization}: {obj['kind']}/{obj['metadata']['name']} does not tolerate {key}"


def test_kind_recipe_is_whole_in_the_readme_and_the_overlay() -> None:
    """`kubectl apply -k deploy/overlays/kind` alone pulls an image no registry has: the README
    and the overlay give every step, with the overlay's image tag and the cluster's names."""
    overlay = yaml.safe_load((DEPLOY / "overlays/kind/kustomization.yaml").read_text())
    (image,) = overlay["images"]
    tag = f"{image['newName']}:{image['newTag']}"
    cluster = yaml.safe_load((DEPLOY / "overlays/kind/kind-config.yaml").read_text())["name"]
    steps = [
        "kind create cluster --config deploy/overlays/kind/kind-config.yaml",
        f"docker build -t {tag} .",
        f"kind load docker-image {tag} --name {cluster}",
        f"deploy/label-nodes.sh --hypervisor kvm {cluster}-control-plane",
        "kubectl apply -k deploy/overlays/kind",
        f"rollout status daemonset/{MAIN}",
        "kubectl apply -k deploy/overlays/kind/examples",
        "logs pod/hyperlight-vm-check",
    ]
    readme = (ROOT / "README.md").read_text()
    deploy_section = readme[readme.index("## Deploy") :]
    deploy_section = deploy_section[: deploy_section.index("\n## ", 1)]
    header = (DEPLOY / "overlays/kind/kustomization.yaml").read_text().split("apiVersion:")[0]
    for text, where in ((deploy_section, "README.md, Deploy"), (header, "deploy/overlays/kind")):
        at = 0
        for step in steps:  # each one after the one before
            found = text.find(step, at)
            assert found >= 0, f"{where} lacks {step!r} (after the steps before it)"
            at = found + len(step)


def test_running_as_root_is_explained_beside_the_setting() -> None:
    for path in sorted((DEPLOY / "base").glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*runAsUser:\s*0\s*$", line):
                context = " ".join(lines[max(0, i - 4) : i + 1])
                assert "root-owned" in context and "#" in context, f"{path.name}:{i + 1}"


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_network_policies_admit_only_probe_and_metrics_ports(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    objs = objects[kustomization]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    for name, ds in plugin_daemonsets(objs):
        labels = ds["spec"]["template"]["metadata"]["labels"]
        selecting = [
            p for p in policies if p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
        ]
        assert selecting, f"{kustomization}: no NetworkPolicy selects {name}"
        (c,) = containers(ds["spec"]["template"]["spec"])
        admitted = set()
        for policy in selecting:
            spec = policy["spec"]
            assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, policy["metadata"]["name"]
            assert spec.get("egress", []) == [], "the daemons open no network connections"
            for rule in spec["ingress"]:
                for port in rule["ports"]:
                    assert port.get("protocol", "TCP") == "TCP"
                    admitted.add(port_number(c, port["port"]))
        assert admitted == {HTTP_PORT[name]}, f"{kustomization}: {name} admits {admitted}"


SCRAPER_LABEL = {"hyperlight.dev/metrics-scraper": "true"}


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_network_policies_admit_only_labelled_scraper_namespaces(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    """Not every pod in the cluster: the kubelet's probes come from the node (never blocked by a
    NetworkPolicy), and scrapers from namespaces an administrator labelled."""
    for policy in (o for o in objects[kustomization] if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from")
            assert peers, f"{policy['metadata']['name']}: an ingress rule without `from` admits everyone"
            for peer in peers:
                assert set(peer) == {"namespaceSelector"}, peer
                assert peer["namespaceSelector"] == {"matchLabels": SCRAPER_LABEL}, peer


def test_manifest_environment_matches_the_cli() -> None:
    config = pytest.importorskip("hlplugin.config")
    tables = {"serve": "SERVE_OPTIONS", "bootstrap": "BOOTSTRAP_OPTIONS"}
    if not all(hasattr(config, t) for t in (*tables.values(), "OPTIONS")):
        pytest.skip("hlplugin.config no longer has OPTIONS/SERVE_OPTIONS/BOOTSTRAP_OPTIONS")
    for path in (DEPLOY / "base/device-plugin.yaml", DEPLOY / "base/device-access.yaml"):
        ds = yaml.safe_load(path.read_text())
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        options = [config.OPTIONS[n] for n in getattr(config, tables[c["args"][0]])]
        by_env = {o.env: o for o in options if o.env}
        for name, value in env_of(c).items():
            assert name in by_env, f"{path.name}: {name} is not a `{c['args'][0]}` setting"
            by_env[name].parse(value)  # raises on a value the daemon would reject


# --- examples and admission policy -----------------------------------------------------------

RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What the Restricted Pod Security Standard (latest) would reject in a pod spec."""
    bad = []
    pod_sc = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            bad.append(host)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"volume {volume['name']}: {kinds}")
    if pod_sc.get("sysctls"):
        bad.append("sysctls")
    if pod_sc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    for c in containers(spec):
        sc = c.get("securityContext", {})
        where = c["name"]
        if sc.get("privileged"):
            bad.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{where}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}: capabilities added")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{where}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{where}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{where}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{where}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{where}: procMount")
    return bad


@pytest.mark.parametrize("kustomization", EXAMPLE_KUSTOMIZATIONS)
def test_examples_pass_the_restricted_standard(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    objs = objects[kustomization]
    (ns,) = [o for o in objs if o["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = list(pod_specs(objs))
    assert {o["kind"] for o, _ in workloads} == {"Pod", "Deployment"}
    for obj, spec in workloads:
        where = f"{kustomization}: {obj['kind']}/{obj['metadata']['name']}"
        assert restricted_violations(spec) == [], where
        assert spec["automountServiceAccountToken"] is False, where
        for c in containers(spec):
            sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
            assert sc["runAsUser"] == WORKLOAD_UID and sc["runAsGroup"] == WORKLOAD_UID, where
            assert sc["readOnlyRootFilesystem"] is True, where
            for key in ("requests", "limits"):
                assert c["resources"][key]["hyperlight.dev/hypervisor"] == "1", where
                assert "hyperlight.dev/device-access" not in c["resources"][key], where


def test_plugin_pods_are_the_only_root_pods(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        for obj, spec in pod_specs(objs):
            if restricted_violations(spec):
                assert obj["kind"] == "DaemonSet" and obj["metadata"]["name"] in SUBCOMMAND, name
                assert obj["metadata"]["namespace"] == NAMESPACE, name


CEL_HELPER = r"""
import json, sys
import celpy
policy, cases = json.load(sys.stdin)
env = celpy.Environment()
def holds(expr, activation):
    return bool(env.program(env.compile(expr)).evaluate(activation))
verdicts = []
for namespace, pod in cases:
    activation = {
        "object": celpy.json_to_cel(pod),
        "request": celpy.json_to_cel({"namespace": namespace, "operation": "CREATE"}),
    }
    if not all(holds(m["expression"], activation) for m in policy["spec"]["matchConditions"]):
        verdicts.append("not matched")
    elif all(holds(v["expression"], activation) for v in policy["spec"]["validations"]):
        verdicts.append("allowed")
    else:
        verdicts.append("denied")
print(json.dumps(verdicts))
"""


def test_admission_policy_reserves_device_access(
    objects: dict[str, list[dict[str, Any]]],
) -> None:
    objs = objects["overlays/aks"]
    policy = find(objs, "ValidatingAdmissionPolicy", "hyperlight-reserve-device-access")
    binding = find(objs, "ValidatingAdmissionPolicyBinding", "hyperlight-reserve-device-access")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"

    plugin = find(objs, "DaemonSet", MAIN)["spec"]["template"]["spec"]
    bootstrap = find(objs, "DaemonSet", BOOTSTRAP)["spec"]["template"]["spec"]
    workload = next(s for o, s in pod_specs(objects["examples"]) if o["kind"] == "Pod")

    def asking(where: str, resources: dict[str, Any]) -> dict[str, Any]:
        c = {"name": "c", "image": "x", "resources": resources}
        key = "initContainers" if where == "init" else "containers"
        spec: dict[str, Any] = {"serviceAccountName": "default", "containers": [{"name": "m"}]}
        spec[key] = [*spec.get(key, []), c]
        return {"spec": spec}

    one = {"hyperlight.dev/device-access": "1"}
    cases = [
        (NAMESPACE, {"spec": plugin}, "not matched"),
        (NAMESPACE, {"spec": bootstrap}, "allowed"),
        ("default", {"spec": workload}, "allowed"),
        ("default", {"spec": {"containers": [{"name": "c"}]}}, "allowed"),
        ("default", {"spec": plugin}, "denied"),
        ("default", asking("main", {"limits": one}), "denied"),
        ("default", asking("main", {"requests": one}), "denied"),
        ("default", asking("init", {"limits": one}), "denied"),
        (NAMESPACE, {"spec": {**plugin, "serviceAccountName": BOOTSTRAP}}, "denied"),
        (NAMESPACE, asking("main", {"limits": one}), "denied"),
    ]  # fmt: skip
    python = interpreter_with("celpy")
    payload = json.dumps([policy, [[ns, pod] for ns, pod, _ in cases]])
    result = run([python, "-c", CEL_HELPER], input=payload)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [verdict for _, _, verdict in cases]


def _python_for(uid: int) -> str | None:
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = run([python, "-c", "pass"], user=uid, group=uid, extra_groups=[], timeout=30)
        except OSError:  # not there, or not executable by that user
            continue
        if probe.returncode == 0:
            return python
    return None


@pytest.fixture
def workload_dir() -> Iterator[Path]:
    """A world-readable directory with the example workloads' script and, as root, a dev/kvm
    owned by the workload's UID, as the kubelet makes it through CDI (else dev is /dev)."""
    kvm = Path("/dev/kvm")
    if not kvm.exists():
        pytest.skip("no /dev/kvm on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        (work / "vm_check.py").write_text((DEPLOY / "examples/vm_check.py").read_text())
        if os.geteuid() != 0:
            if not os.access(kvm, os.R_OK | os.W_OK):
                pytest.skip("/dev/kvm is not read-write for this user")
            (work / "dev").symlink_to("/dev")
        else:
            (work / "dev").mkdir(mode=0o755)
            try:
                os.mknod(work / "dev" / "kvm", stat.S_IFCHR | 0o600, kvm.stat().st_rdev)
            except OSError as err:
                pytest.skip(f"cannot create a device node here: {err}")
            os.chown(work / "dev" / "kvm", WORKLOAD_UID, WORKLOAD_UID)
        yield work


def test_example_check_creates_a_vm_as_non_root(workload_dir: Path) -> None:
    """The example workloads' script, against a CDI-style node owned by UID 65534."""
    cmd = [str(workload_dir / "vm_check.py"), "--dev-dir", str(workload_dir / "dev")]
    if os.geteuid() != 0:
        result = run([sys.executable, *cmd])
    else:
        as_root = run([sys.executable, *cmd])
        assert as_root.returncode == 1 and "running as root" in as_root.stderr
        python = _python_for(WORKLOAD_UID)
        if python is None:
            pytest.skip(f"no Python that UID {WORKLOAD_UID} may run")
        result = run([python, *cmd], user=WORKLOAD_UID, group=WORKLOAD_UID, extra_groups=[])
    assert result.returncode == 0, result.stderr
    assert re.search(r"created a KVM VM as uid=(\d+) ", result.stdout), result.stdout
    assert "uid=0 " not in result.stdout


def test_example_check_stops_on_sigterm_as_pid_1(workload_dir: Path) -> None:
    """In a container the script is PID 1, which the kernel gives no default action for SIGTERM:
    it must handle the signal itself, or every stop of the worker waits out the grace period and
    ends in SIGKILL. Run as the workload would be: PID 1 of its own PID namespace, UID 65534."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a PID namespace and a device node owned by the workload's UID")
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        pytest.skip("needs unshare and setpriv (util-linux)")
    python = _python_for(WORKLOAD_UID)
    if python is None:
        pytest.skip(f"no Python that UID {WORKLOAD_UID} may run")
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", setpriv, f"--reuid={WORKLOAD_UID}",
         f"--regid={WORKLOAD_UID}", "--clear-groups", python, str(workload_dir / "vm_check.py"),
         "--interval", "60", "--dev-dir", str(workload_dir / "dev")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one check done: it now sleeps for 60 s
        assert "created a KVM VM" in first, first + (proc.stderr.read() if proc.stderr else "")
        (child,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                    and _ppid(p) == proc.pid]  # fmt: skip
        nspid = re.search(r"^NSpid:\s+(.*)$", Path(f"/proc/{child}/status").read_text(), re.M)
        assert nspid and nspid.group(1).split()[-1] == "1", "the script is PID 1 in its namespace"
        started = time.monotonic()
        os.kill(child, signal.SIGTERM)
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rest = proc.stdout.read()
    assert code == 0 and "stopping on SIGTERM" in rest, rest
    assert elapsed < 5, f"took {elapsed:.1f} s to stop"


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


# --- image -----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str, str]]:
    """(INSTRUCTION, arguments, comments just above) with continuation lines joined."""
    out, comments, current = [], [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not current and stripped.startswith("#"):
            comments.append(stripped)
            continue
        if not stripped:
            continue
        current += " " + stripped.rstrip("\\").strip()
        if stripped.endswith("\\"):
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip(), "\n".join(comments)))
        comments, current = [], ""
    return out


def test_dockerfile_shape() -> None:
    steps = dockerfile_instructions()
    froms = [(i, args, notes) for i, (op, args, notes) in enumerate(steps) if op == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    first = froms[0]
    # The base is a build argument (deploy/local-node.sh passes a stand-in) whose default is the pin.
    args = dict(a.split("=", 1) for op, a, _ in steps[: first[0]] if op == "ARG" and "=" in a)
    pinned = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), first[1])
    assert re.match(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*@sha256:[0-9a-f]{64} AS \w+$", pinned)
    notes = first[2] + "\n".join(n for op, _, n in steps[: first[0]] if op == "ARG")
    assert "digest" in notes, "say beside the pin how to move it"
    stages = set()
    for _, args, _ in froms:
        words = args.split()
        if len(words) == 3:
            stages.add(words[2])
    for _, args, _ in froms[1:]:
        assert args.split()[0] in stages, f"later stages build on the pinned one: {args}"
    final = steps[froms[-1][0] :]
    ops = {op: (args, notes) for op, args, notes in final}
    assert json.loads(ops["ENTRYPOINT"][0]) == ["hlplugin"], "exec-form ENTRYPOINT"
    assert ops["HEALTHCHECK"][0] == "NONE" and "probe" in ops["HEALTHCHECK"][1].lower()
    assert re.fullmatch(r"\d+(:\d+)?", ops["USER"][0]) and not ops["USER"][0].startswith("0")
    assert not any(op == "RUN" for op, _, _ in final), "final stage only copies"
    assert any(op == "COPY" and args.startswith("--from=") for op, args, _ in final)
    build = " ".join(args for op, args, _ in steps if op == "RUN")
    assert "compileall" in build and "a+rX" in build, "readable, precompiled for a read-only root"


def test_dockerignore_sends_only_the_sources() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.strip().startswith("#")]
    assert patterns[0] == "*"
    for op, args, _ in dockerfile_instructions():
        if op == "COPY" and not args.startswith("--from="):
            for source in args.split()[:-1]:
                assert f"!{source}" in patterns, f"{source} is copied but ignored"


def test_console_script_serves_both_daemons() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["hlplugin"]
    cli = ROOT / "src/hlplugin/cli.py"
    if cli.exists():
        text = cli.read_text()
        assert '"serve"' in text and '"bootstrap"' in text


def test_hadolint() -> None:
    hadolint = tool("hadolint")
    result = run([hadolint, "--no-color", str(ROOT / "Dockerfile")])
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


# --- workflows -------------------------------------------------------------------------------


def workflow(name: str) -> dict[str, Any]:
    data = yaml.safe_load((GITHUB / "workflows" / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def steps_of(wf: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for job in wf["jobs"].values():
        yield from job.get("steps", [])


def test_workflows_match_the_github_schema() -> None:
    check = tool("check-jsonschema")
    result = run([check, "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)])
    assert result.returncode == 0, result.stdout + result.stderr
    dependabot = GITHUB / "dependabot.yml"
    result = run([check, "--builtin-schema", "vendor.dependabot", str(dependabot)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing() -> None:
    zizmor = tool("zizmor")
    result = run([zizmor, "--offline", "--no-progress", str(GITHUB)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings" in result.stdout + result.stderr


def test_actions_pinned_least_privilege_no_credentials() -> None:
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "e2e.yml", "release.yml"}
    for path in WORKFLOWS:
        wf = workflow(path.name)
        text = path.read_text()
        assert wf.get("permissions") == {}, f"{path.name}: deny by default at the top"
        for job_name, job in wf["jobs"].items():
            assert "permissions" in job, f"{path.name}: {job_name} must say what it needs"
            assert set(job["permissions"].values()) <= {"read", "write", "none"}
        for step in steps_of(wf):
            uses = step.get("uses")
            if uses is None:
                continue
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", uses), f"{path.name}: {uses}"
            assert re.search(re.escape(uses) + r" # v\d", text), f"{uses}: say which version"
            if uses.startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, path.name
    writers = {
        (path.name, job_name)
        for path in WORKFLOWS
        for job_name, job in workflow(path.name)["jobs"].items()
        if "write" in job["permissions"].values()
    }
    assert writers == {("release.yml", "image")}


def test_ci_workflow_runs_the_same_ci_script_with_kvm() -> None:
    wf = workflow("ci.yml")
    assert {job["runs-on"] for job in wf["jobs"].values()} == {"ubuntu-latest"}
    runs = [s.get("run", "") for s in steps_of(wf)]
    assert any(r.strip() == "ruff check ." for r in runs) and "mypy" in runs
    test_runs = [s.get("run", "") for s in wf["jobs"]["test"]["steps"]]
    assert any('KERNEL=="kvm"' in r and "udevadm trigger" in r for r in test_runs)
    assert any(re.search(r"(^|\s)(bash )?\.ci/run\b", r) for r in test_runs)
    assert {"pull_request", "push"} <= set(wf["on"])


def test_e2e_workflow_covers_the_kind_path() -> None:
    wf = workflow("e2e.yml")
    (job,) = wf["jobs"].values()
    steps = job["steps"]
    script = "\n".join(s.get("run", "") for s in steps)
    for needle in (
        'KERNEL=="kvm"',
        "docker build",
        "kind create cluster --config deploy/overlays/kind/kind-config.yaml",
        "kind load docker-image",
        "deploy/label-nodes.sh",
        "kubectl apply -k deploy/overlays/kind",
        f"rollout status daemonset/{BOOTSTRAP}",
        f"rollout status daemonset/{MAIN}",
        r"allocatable.hyperlight\.dev/hypervisor",
        "kubectl apply -k deploy/overlays/kind/examples",
        f"as uid={WORKLOAD_UID}",
        "get events",
        "logs",
    ):
        assert needle in script, needle
    assert any(s.get("if") == "failure()" and "get events" in s.get("run", "") for s in steps)
    assert steps[-1].get("if") == "always()" and "kind delete cluster" in steps[-1]["run"]


def test_release_workflow_pushes_on_tags() -> None:
    wf = workflow("release.yml")
    assert set(wf["on"]) == {"push"} and wf["on"]["push"]["tags"]
    uses = [s.get("uses", "") for s in steps_of(wf)]
    assert any(u.startswith("docker/build-push-action@") for u in uses)
    build = next(s for s in steps_of(wf) if s.get("uses", "").startswith("docker/build-push"))
    assert build["with"]["push"] is True and build["with"]["context"] == "."
    assert "cache-from" not in build["with"], "no shared cache in a release"


def test_workflow_run_steps_pass_shellcheck(tmp_path: Path) -> None:
    shellcheck = tool("shellcheck")
    files = []
    for path in WORKFLOWS:
        for i, step in enumerate(steps_of(workflow(path.name))):
            if "run" in step:
                assert "${{" not in step["run"], f"{path.name}: pass expressions through env"
                script = tmp_path / f"{path.stem}-{i}.sh"
                script.write_text("#!/usr/bin/env bash\nset -eo pipefail\n" + step["run"])
                files.append(str(script))
    result = run([shellcheck, "--format=gcc", *files])
    assert result.returncode == 0, result.stdout + result.stderr


# --- linters over everything -----------------------------------------------------------------


def test_yamllint() -> None:
    yamllint = tool("yamllint")
    targets = [str(DEPLOY), str(GITHUB), str(ROOT / ".yamllint")]
    result = run([yamllint, "--strict", "-c", str(ROOT / ".yamllint"), *targets])
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_every_shell_script() -> None:
    shellcheck = tool("shellcheck")
    scripts = shell_scripts()
    assert DEPLOY / "label-nodes.sh" in scripts
    for script in scripts:
        dialect = [] if script.read_bytes().startswith(b"#!") else ["--shell=bash"]
        result = run([shellcheck, "--format=gcc", *dialect, str(script)])
        assert result.returncode == 0, result.stdout + result.stderr


def test_label_nodes_script(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    fake = tmp_path / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(fake)}
    script = str(DEPLOY / "label-nodes.sh")

    def calls(*args: str, status: int = 0) -> list[str]:
        log.write_text("")
        result = run(["bash", script, *args], env=env)
        assert result.returncode == status, result.stderr
        return log.read_text().splitlines()

    labels = "hyperlight.dev/enabled=true hyperlight.dev/hypervisor"
    assert calls("--hypervisor", "kvm", "n1", "n2") == [f"label nodes n1 n2 {labels}=kvm --overwrite"]
    assert calls("--hypervisor=mshv", "--selector", "pool=hl", "--dry-run") == [
        f"label nodes --selector pool=hl {labels}=mshv --overwrite --dry-run=client"
    ]
    assert calls("--remove", "n1") == [
        "label nodes n1 hyperlight.dev/enabled- hyperlight.dev/hypervisor- --overwrite"
    ]
    assert calls("--hypervisor", "xen", "n1", status=2) == []
    assert calls("--hypervisor", "kvm", status=2) == []
    assert calls("--hypervisor", "kvm", "-l", "a=b", "n1", status=2) == []


# --- checkov, once -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_reports(rendered: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    checkov = tool("checkov")
    root = tmp_path_factory.mktemp("checkov")
    for name, text in rendered.items():
        (root / "rendered").mkdir(exist_ok=True)
        (root / "rendered" / (name.replace("/", "-") + ".yaml")).write_text(text)
    shutil.copy(ROOT / "Dockerfile", root / "Dockerfile")
    shutil.copytree(GITHUB / "workflows", root / ".github" / "workflows")
    result = run(
        [checkov, "--directory", str(root), "--framework", "kubernetes,dockerfile,github_actions",
         "--skip-download", "--output", "json", "--compact"],
        env={**os.environ, **CHECKOV_ENV},
        timeout=110,
    )  # fmt: skip
    assert result.stdout.strip(), result.stderr
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


@pytest.mark.parametrize("framework", ["kubernetes", "dockerfile", "github_actions"])
def test_checkov_finds_nothing(checkov_reports: list[dict[str, Any]], framework: str) -> None:
    (report,) = [r for r in checkov_reports if r["check_type"] == framework]
    summary = report["summary"]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']})" for c in report["results"]["failed_checks"]
    ]
    assert summary["failed"] == 0, "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 0
    for skipped in report["results"]["skipped_checks"]:
        reason = skipped["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20 and reason != "No comment provided", skipped["check_id"]
        if framework == "kubernetes" and skipped["check_id"] in ("CKV_K8S_23", "CKV_K8S_40"):
            assert skipped["resource"].startswith(f"DaemonSet.{NAMESPACE}."), skipped["resource"]
            assert "root-owned" in reason


# --- docs and packaging ------------------------------------------------------------------------


def test_docs_cover_the_operators_questions() -> None:
    docs = ROOT / "docs"
    architecture = (docs / "architecture.md").read_text()
    operations = (docs / "operations.md").read_text()
    security = (docs / "security.md").read_text()
    for needle in (BOOTSTRAP, MAIN, "Allocate", "CDI", "repair"):
        assert needle in architecture, needle
    for needle in (
        "kubectl apply -k deploy/overlays/",
        "label-nodes.sh",
        "Upgrade",
        "Rollback",
        "/readyz",
        "DEVICE_COUNT",
        "## Monitoring",
        "## Probes and restarts",
        *METRICS,
    ):
        assert needle in operations, needle
    for needle in (
        "hyperlight.dev/device-access",
        "ValidatingAdmissionPolicy",
        "ResourceQuota",
        "every capability dropped",
        "root-owned",
    ):
        assert needle in security, needle


def test_requirements_are_pinned() -> None:
    lines = (ROOT / "requirements-deploy-checks.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", p) for p in pins), pins
