"""Offline checks of the deployment path (issue 7): manifests, image, workflows. No cluster, no
network: kustomize renders every kustomization, which is validated against the Kubernetes schemas
and walked for the issue's security properties; the static analysers run on all they cover. Python
tools come from requirements-deploy-checks.txt, on PATH or in $DEPLOY_CHECKS_BIN (a venv's bin);
kubectl and shellcheck from the system. A missing tool skips its test and says which one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
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
from harness import documents, kustomize, metric_families, mknod_char, needs_kvm, tool

from hlplugin import config

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GITHUB = ROOT / ".github"
WORKFLOWS = sorted((GITHUB / "workflows").glob("*.yml"))
PLUGIN_KUSTOMIZATIONS = ("base", "overlays/kind", "overlays/aks")
EXAMPLE_KUSTOMIZATIONS = ("examples", "overlays/kind/examples")
# Not rendered here: an overlay with deploy/components/monitoring on top, which
# tests/test_monitoring.py renders as exactly the overlay's objects plus two Prometheus Operator
# CRDs that kubernetes-validate has no schema for (and checks them with promtool).
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


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each kustomization's output, in one directory."""
    out = tmp_path_factory.mktemp("rendered")
    sources = {name: DEPLOY / name for name in (*PLUGIN_KUSTOMIZATIONS, *EXAMPLE_KUSTOMIZATIONS)}
    for name, source in sources.items():
        (out / (name.replace("/", "-") + ".yaml")).write_text(kustomize(source))
    return {name: out / (name.replace("/", "-") + ".yaml") for name in sources}


@pytest.fixture(scope="module")
def objects(rendered: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    return {name: documents(path.read_text()) for name, path in rendered.items()}


def test_no_mount_over_dev_and_only_the_plugin_runs_as_root(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        for obj, spec in pod_specs(objs):
            for m in (m for c in containers(spec) for m in c.get("volumeMounts", [])):
                path = m["mountPath"].rstrip("/")
                assert path != "/dev" and not path.startswith("/dev/"), (name, obj, m)
            if restricted_violations(spec):
                assert obj["kind"] == "DaemonSet" and obj["metadata"]["name"] in SUBCOMMAND, name
                assert obj["metadata"]["namespace"] == NAMESPACE, name


def test_rendered_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, Path], objects: dict[str, list[dict[str, Any]]]
) -> None:
    validate = tool("kubernetes-validate")
    result = run([validate, "-k", K8S_VERSION, "--strict", *map(str, rendered.values())])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("passed for resource") == sum(map(len, objects.values())), output


PLUGIN_MOUNTS = {  # name: {mountPath: (hostPath, type, readOnly)}
    BOOTSTRAP: {KUBELET_DIR: (KUBELET_DIR, "Directory", False), "/host-dev": ("/dev", "Directory", True)},
    MAIN: {KUBELET_DIR: (KUBELET_DIR, "Directory", False), "/host-dev": ("/dev", "Directory", True),
           "/var/run/cdi": ("/var/run/cdi", "DirectoryOrCreate", False)},
}
SCRAPERS = {"namespaceSelector": {"matchLabels": {"hyperlight.dev/metrics-scraper": "true"}}}


@pytest.mark.parametrize("kustomization", PLUGIN_KUSTOMIZATIONS)
def test_plugin_daemonsets(objects: dict[str, list[dict[str, Any]]], kustomization: str) -> None:
    objs = objects[kustomization]
    # The namespace (both DaemonSets are found below) holds everything but the cluster-scoped
    # admission policy, which the overlays add.
    find(objs, "Namespace", NAMESPACE)
    if kustomization != "base":
        assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= {o["kind"] for o in objs}
    check_plugin_daemonsets(objs, kustomization)


def check_plugin_daemonsets(objs: list[dict[str, Any]], kustomization: str) -> None:
    """The DaemonSets' properties (shared with tests/test_chart.py, which checks the chart's)."""
    for obj in objs:
        if obj["kind"] != "Namespace" and not obj["kind"].startswith("ValidatingAdm"):
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]
    operations = (ROOT / "docs/operations.md").read_text()
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
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


def test_base_manifests_explain_root() -> None:
    for path in sorted((DEPLOY / "base").glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*runAsUser:\s*0\s*$", line):
                context = " ".join(lines[max(0, i - 4) : i + 1])
                assert "root-owned" in context and "#" in context, f"{path.name}:{i + 1}"


def test_kind_path_is_whole() -> None:
    """`kubectl apply -k deploy/overlays/kind` alone pulls an image no registry has: the README, the
    overlay and the e2e workflow give every step, with the overlay's image tag and the cluster's names."""
    cluster = yaml.safe_load((DEPLOY / "overlays/kind/kind-config.yaml").read_text())
    e2e = (GITHUB / "workflows/e2e.yml").read_text()
    # The cluster config is a KIND config beside the overlay, not one of its resources.
    assert cluster["kind"] == "Cluster" and cluster["apiVersion"].startswith("kind.x-k8s.io/")
    (node,) = cluster["nodes"]
    assert re.fullmatch(r"kindest/node:v1\.\d+\.\d+@sha256:[0-9a-f]{64}", node["image"])
    assert {"hostPath": "/dev/kvm", "containerPath": "/dev/kvm"} in node["extraMounts"]
    overlay = yaml.safe_load((DEPLOY / "overlays/kind/kustomization.yaml").read_text())
    assert "kind-config.yaml" not in overlay.get("resources", [])
    assert f"CLUSTER: {cluster['name']}" in e2e and f"NODE: {cluster['name']}-control-plane" in e2e

    # The README and the overlay's header give the recipe, each step after the one before.
    (image,) = overlay["images"]
    tag = f"{image['newName']}:{image['newTag']}"
    steps = [
        "kind create cluster --config deploy/overlays/kind/kind-config.yaml", f"docker build -t {tag} .",
        f"kind load docker-image {tag} --name {cluster['name']}",
        f"deploy/label-nodes.sh --hypervisor kvm {cluster['name']}-control-plane",
        "kubectl apply -k deploy/overlays/kind", f"rollout status daemonset/{MAIN}",
        "kubectl apply -k deploy/overlays/kind/examples", "logs pod/hyperlight-vm-check",
    ]  # fmt: skip
    readme = (ROOT / "README.md").read_text()
    deploy_section = readme[readme.index("## Deploy") :]
    deploy_section = deploy_section[: deploy_section.index("\n## ", 1)]
    header = (DEPLOY / "overlays/kind/kustomization.yaml").read_text().split("apiVersion:")[0]
    for text, where in ((deploy_section, "README.md, Deploy"), (header, "deploy/overlays/kind")):
        at = 0
        for step in steps:
            found = text.find(step, at)
            assert found >= 0, f"{where} lacks {step!r} (after the steps before it)"
            at = found + len(step)

    # The e2e workflow runs that path, dumps events on failure, and always deletes the cluster.
    (job,) = workflow("e2e.yml")["jobs"].values()
    script = "\n".join(s.get("run", "") for s in job["steps"])
    for needle in (
        'KERNEL=="kvm"', "docker build", "kind create cluster --config deploy/overlays/kind/kind-config.yaml",
        "kind load docker-image", "deploy/label-nodes.sh", "kubectl apply -k deploy/overlays/kind",
        f"rollout status daemonset/{BOOTSTRAP}", f"rollout status daemonset/{MAIN}",
        r"allocatable.hyperlight\.dev/hypervisor", "kubectl apply -k deploy/overlays/kind/examples",
        f"as uid={WORKLOAD_UID}", "get events", "logs",
    ):  # fmt: skip
        assert needle in script, needle
    assert any(s.get("if") == "failure()" and "get events" in s.get("run", "") for s in job["steps"])
    assert job["steps"][-1].get("if") == "always()" and "kind delete cluster" in job["steps"][-1]["run"]


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


@pytest.mark.parametrize("kustomization", EXAMPLE_KUSTOMIZATIONS)
def test_examples_are_restricted_workloads_for_the_dedicated_pool(
    objects: dict[str, list[dict[str, Any]]], kustomization: str
) -> None:
    objs = objects[kustomization]
    (ns,) = [o for o in objs if o["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = list(pod_specs(objs))
    assert {o["kind"] for o, _ in workloads} == {"Pod", "Deployment"}
    operations = (ROOT / "docs/operations.md").read_text()
    taints = re.findall(r"--node-taints ([\w./-]+)=([\w.-]+):(\w+)", operations)
    assert taints, "docs/operations.md suggests a taint for dedicated pools"
    for obj, spec in workloads:
        where = f"{kustomization}: {obj['kind']}/{obj['metadata']['name']}"
        assert restricted_violations(spec) == [], where
        assert spec["automountServiceAccountToken"] is False, where
        for key, value, effect in taints:
            assert any(
                t["key"] == key and t.get("effect", effect) == effect
                and (t["operator"] == "Exists" or t.get("value") == value)
                for t in spec.get("tolerations", [])
            ), f"{where} does not tolerate {key}"
        for c in containers(spec):
            sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
            assert sc["runAsUser"] == WORKLOAD_UID and sc["runAsGroup"] == WORKLOAD_UID, where
            assert sc["readOnlyRootFilesystem"] is True, where
            for key in ("requests", "limits"):
                assert c["resources"][key]["hyperlight.dev/hypervisor"] == "1", where
                assert "hyperlight.dev/device-access" not in c["resources"][key], where


def _python_for(uid: int) -> str | None:
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        with contextlib.suppress(OSError):  # not there, or not executable by that user
            if run([python, "-c", "pass"], user=uid, group=uid, extra_groups=[], timeout=30).returncode == 0:
                return python
    return None


@pytest.fixture
def workload_dir() -> Iterator[Path]:
    """A world-readable directory (pytest's tmp_path is under one the workload's UID cannot enter)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)


@needs_kvm
def test_example_check_runs_as_the_workload_and_stops_on_sigterm_as_pid_1(workload_dir: Path) -> None:
    """The example workloads' script against a CDI-style node, as the kubelet makes it: as root,
    a dev/kvm owned by the workload's UID (else dev is /dev)."""
    shutil.copy(DEPLOY / "examples/vm_check.py", workload_dir)
    cmd = [str(workload_dir / "vm_check.py"), "--dev-dir", str(workload_dir / "dev")]
    python = sys.executable
    as_workload: dict[str, Any] = {}
    if os.geteuid() != 0:
        (workload_dir / "dev").symlink_to("/dev")
    else:
        (workload_dir / "dev").mkdir(mode=0o755)
        kvm = mknod_char(workload_dir / "dev/kvm", os.stat("/dev/kvm").st_rdev)
        os.chown(kvm, WORKLOAD_UID, WORKLOAD_UID)
        as_root = run([sys.executable, *cmd])
        assert as_root.returncode == 1 and "running as root" in as_root.stderr
        python = _python_for(WORKLOAD_UID) or pytest.skip(f"no Python that UID {WORKLOAD_UID} may run")
        as_workload = {"user": WORKLOAD_UID, "group": WORKLOAD_UID, "extra_groups": []}
    result = run([python, *cmd], **as_workload)
    assert result.returncode == 0, result.stderr
    assert re.search(r"created a KVM VM as uid=(\d+) ", result.stdout), result.stdout
    assert "uid=0 " not in result.stdout

    # In a container the script is PID 1, which the kernel gives no default action for SIGTERM:
    # it must handle the signal itself, or every stop of the worker waits out the grace period
    # and ends in SIGKILL. Run as the workload would be: PID 1 of its own PID namespace, UID 65534.
    if os.geteuid() != 0:
        pytest.skip("needs root: a PID namespace and a device node owned by the workload's UID")
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None:
        pytest.skip("needs unshare and setpriv (util-linux)")
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", setpriv, f"--reuid={WORKLOAD_UID}",
         f"--regid={WORKLOAD_UID}", "--clear-groups", python, *cmd, "--interval", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one check done: it now sleeps for 60 s
        assert "created a KVM VM" in first, first + (proc.stderr.read() if proc.stderr else "")
        (child,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        nspid = re.search(r"^NSpid:\s+(.*)$", Path(f"/proc/{child}/status").read_text(), re.M)
        assert nspid and nspid.group(1).split()[-1] == "1", "the script is PID 1 in its namespace"
        started = time.monotonic()
        os.kill(child, signal.SIGTERM)
        code = proc.wait(timeout=10)
        elapsed = time.monotonic() - started
    finally:  # unshare and the script in its namespace: a failed test leaves neither behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rest = proc.stdout.read()
    assert code == 0 and "stopping on SIGTERM" in rest, rest
    assert elapsed < 5, f"took {elapsed:.1f} s to stop"


def test_image_is_pinned_small_and_runs_the_console_script() -> None:
    # (INSTRUCTION, arguments, the comments since the one before) with continuation lines joined.
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    found = re.findall(r"((?:^[ \t]*(?:#.*)?\n)*)^[ \t]*(\w+)[ \t]+(.*)$", text, re.M)
    steps = [(op.upper(), args.strip(), "\n".join(re.findall("#.*", notes))) for notes, op, args in found]
    froms = [(i, args, notes) for i, (op, args, notes) in enumerate(steps) if op == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    first = froms[0]
    # The base is a build argument (deploy/local-node.sh passes a stand-in) whose default is the pin.
    args = dict(a.split("=", 1) for op, a, _ in steps[: first[0]] if op == "ARG" and "=" in a)
    pinned = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), first[1])
    assert re.match(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*@sha256:[0-9a-f]{64} AS \w+$", pinned)
    notes = first[2] + "\n".join(n for op, _, n in steps[: first[0]] if op == "ARG")
    assert "digest" in notes, "say beside the pin how to move it"
    stages = {args.split()[2] for _, args, _ in froms if len(args.split()) == 3}
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
    # The build context holds only what the Dockerfile copies.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.strip().startswith("#")]
    assert patterns[0] == "*"
    for op, args, _ in steps:
        if op == "COPY" and not args.startswith("--from="):
            for source in args.split()[:-1]:
                assert f"!{source}" in patterns, f"{source} is copied but ignored"
    # The ENTRYPOINT is the console script, and it serves both daemons.
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hlplugin"]
    cli = (ROOT / "src/hlplugin/cli.py").read_text()
    assert '"serve"' in cli and '"bootstrap"' in cli


def test_workflows() -> None:
    # Every action pinned to a commit with its version beside it, permissions denied by default
    # and granted per job, no credentials left in a checkout; only the release's image job writes.
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "e2e.yml", "release.yml"}
    writers = set()
    for path in WORKFLOWS:
        wf = workflow(path.name)
        text = path.read_text()
        assert wf.get("permissions") == {}, f"{path.name}: deny by default at the top"
        for job_name, job in wf["jobs"].items():
            assert "permissions" in job, f"{path.name}: {job_name} must say what it needs"
            assert set(job["permissions"].values()) <= {"read", "write", "none"}
            if "write" in job["permissions"].values():
                writers.add((path.name, job_name))
        for step in (s for s in steps_of(wf) if "uses" in s):
            uses = step["uses"]
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", uses), f"{path.name}: {uses}"
            assert re.search(re.escape(uses) + r" # v\d", text), f"{uses}: say which version"
            if uses.startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, path.name
    assert writers == {("release.yml", "image")}

    # ci.yml lints, and runs the README's test command (.ci/run) with KVM.
    ci = workflow("ci.yml")
    assert {job["runs-on"] for job in ci["jobs"].values()} == {"ubuntu-latest"}
    runs = [s.get("run", "") for s in steps_of(ci)]
    assert any(r.strip() == "ruff check ." for r in runs) and "mypy" in runs
    test_runs = [s.get("run", "") for s in ci["jobs"]["test"]["steps"]]
    assert any('KERNEL=="kvm"' in r and "udevadm trigger" in r for r in test_runs)
    assert any(re.search(r"(^|\s)(bash )?\.ci/run\b", r) for r in test_runs)
    assert {"pull_request", "push"} <= set(ci["on"])

    # release.yml pushes on tags, from no shared cache, for amd64 only (the DaemonSets' node
    # selector says so: test_plugin_daemonsets).
    release = workflow("release.yml")
    assert set(release["on"]) == {"push"} and release["on"]["push"]["tags"]
    build = next(s for s in steps_of(release) if s.get("uses", "").startswith("docker/build-push-action@"))
    assert build["with"]["push"] is True and build["with"]["context"] == "."
    assert "cache-from" not in build["with"], "no shared cache in a release"
    assert build["with"].get("platforms", "linux/amd64") == "linux/amd64", (
        "a multi-arch release: widen the kubernetes.io/arch node selector")


# (command run in the repository root, a pattern its stdout must contain: each finds nothing)
ANALYSERS = {
    "hadolint": (["hadolint", "--no-color", "Dockerfile"], r"\A\s*\Z"),
    "workflow-schema": (["check-jsonschema", "--builtin-schema", "vendor.github-workflows",
                         *(str(p.relative_to(ROOT)) for p in WORKFLOWS)], ""),
    "dependabot-schema": (["check-jsonschema", "--builtin-schema", "vendor.dependabot",
                           ".github/dependabot.yml"], ""),
    "zizmor": (["zizmor", "--offline", "--no-progress", ".github"], "No findings"),
    "yamllint": (["yamllint", "--strict", "-c", ".yamllint", "deploy", ".github", ".yamllint"], ""),
}  # fmt: skip


@pytest.mark.parametrize("analyser", ANALYSERS)
def test_static_analyser_finds_nothing(analyser: str) -> None:
    command, stdout = ANALYSERS[analyser]
    result = run([tool(command[0]), *command[1:]], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(stdout, result.stdout), result.stdout + result.stderr


def test_shellcheck_every_shell_script_and_workflow_step(tmp_path: Path) -> None:
    """Every shell script this repository ships or runs, and every workflow `run:` step as bash runs it."""
    shellcheck = tool("shellcheck")
    scripts = {*(ROOT / ".ci").iterdir(), *DEPLOY.rglob("*.sh"), *GITHUB.rglob("*.sh")}
    for path in DEPLOY.rglob("*"):
        first = path.read_bytes()[:128].split(b"\n", 1)[0] if path.is_file() else b""
        if first.startswith(b"#!") and first.endswith((b"/sh", b" sh", b"bash")):
            scripts.add(path)
    assert DEPLOY / "label-nodes.sh" in scripts
    for path in WORKFLOWS:
        for i, step in enumerate(steps_of(workflow(path.name))):
            if "run" in step:
                assert "${{" not in step["run"], f"{path.name}: pass expressions through env"
                script = tmp_path / f"{path.stem}-{i}.sh"
                script.write_text("#!/usr/bin/env bash\nset -eo pipefail\n" + step["run"])
                scripts.add(script)
    # No --shell: a script without a shebang fails (SC2148) rather than being guessed at.
    result = run([shellcheck, "--format=gcc", *map(str, sorted(scripts))])
    assert result.returncode == 0, result.stdout + result.stderr


def test_label_nodes_script(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    fake = tmp_path / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(fake)}
    labels = "hyperlight.dev/enabled=true hyperlight.dev/hypervisor"
    for args, status, calls in [
        ("--hypervisor kvm n1 n2", 0, [f"label nodes n1 n2 {labels}=kvm --overwrite"]),
        ("--hypervisor=mshv --selector pool=hl --dry-run", 0,
         [f"label nodes --selector pool=hl {labels}=mshv --overwrite --dry-run=client"]),
        ("--remove n1", 0, ["label nodes n1 hyperlight.dev/enabled- hyperlight.dev/hypervisor- --overwrite"]),
        ("--hypervisor xen n1", 2, []),
        ("--hypervisor kvm", 2, []),
        ("--hypervisor kvm -l a=b n1", 2, []),
    ]:
        log.write_text("")
        result = run(["bash", str(DEPLOY / "label-nodes.sh"), *args.split()], env=env)
        assert result.returncode == status, f"{args}: {result.stderr}"
        assert log.read_text().splitlines() == calls, args


@pytest.mark.parametrize("script", ["label-nodes.sh", "local-node.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_script_s_help_exits_0_on_stdout(script: str, flag: str) -> None:
    """Asked for, help is an answer (stdout, exit 0); a usage error stays exit 2 on stderr."""
    result = run(["bash", str(DEPLOY / script), flag])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and not result.stderr
    assert f"deploy/{script}" in result.stdout
    wrong = run(["bash", str(DEPLOY / script), "--no-such-option"])
    assert wrong.returncode == 2 and f"deploy/{script}" in wrong.stderr and not wrong.stdout


def test_checkov_finds_nothing(rendered: dict[str, Path], tmp_path: Path) -> None:
    """One checkov run over the rendered manifests, the Dockerfile and the workflows; every
    check it skips says why, beside the setting."""
    checkov = tool("checkov")
    shutil.copytree(next(iter(rendered.values())).parent, tmp_path / "rendered")
    shutil.copy(ROOT / "Dockerfile", tmp_path / "Dockerfile")
    shutil.copytree(GITHUB / "workflows", tmp_path / ".github" / "workflows")
    frameworks = ("kubernetes", "dockerfile", "github_actions")
    result = run([checkov, "--directory", str(tmp_path), "--framework", ",".join(frameworks),
                  "--skip-download", "--output", "json", "--compact"],
                 env={**os.environ, **CHECKOV_ENV}, timeout=110)
    assert result.stdout.strip(), result.stderr
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    for framework in frameworks:
        (report,) = [r for r in reports if r["check_type"] == framework]
        summary, results = report["summary"], report["results"]
        failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})" for c in results["failed_checks"]]
        assert summary["failed"] == 0, f"{framework}:\n" + "\n".join(failed)
        assert summary["parsing_errors"] == 0, framework
        assert summary["passed"] > 0, framework
        for skipped in results["skipped_checks"]:
            reason = skipped["check_result"].get("suppress_comment") or ""
            assert len(reason) > 20 and reason != "No comment provided", skipped["check_id"]
            if framework == "kubernetes" and skipped["check_id"] in ("CKV_K8S_23", "CKV_K8S_40"):
                assert skipped["resource"].startswith(f"DaemonSet.{NAMESPACE}."), skipped["resource"]
                assert "root-owned" in reason


OPERATOR_QUESTIONS = {
    "architecture.md": (BOOTSTRAP, MAIN, "Allocate", "CDI", "repair"),
    "operations.md": ("kubectl apply -k deploy/overlays/", "label-nodes.sh", "Upgrade", "Rollback", "/readyz",
                      "DEVICE_COUNT", "## Monitoring", "## Probes and restarts", *metric_families()),
    "security.md": ("hyperlight.dev/device-access", "ValidatingAdmissionPolicy", "ResourceQuota",
                    "every capability dropped", "root-owned"),
}


def test_docs_cover_the_operators_questions() -> None:
    for doc, needles in OPERATOR_QUESTIONS.items():
        text = (ROOT / "docs" / doc).read_text()
        for needle in needles:
            assert needle in text, f"docs/{doc}: {needle}"


def test_requirements_are_pinned() -> None:
    lines = (ROOT / "requirements-deploy-checks.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", p) for p in pins), pins
