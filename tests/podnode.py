"""A node in podman, driven the way the kubelet drives it, for tests/test_node.py.

podman 4.3.1's `kube play` cannot run these pods as the kubelet would: it has no way to be handed
what the kubelet's device manager injects (the DeviceSpecs and CDI device names that Allocate
returned), and it turns the liveness probe on the named port `http` into a healthcheck
`curl -f http://localhost:0/healthz` (port unresolved, curl absent from the image, run by systemd
timers this machine lacks). So every container setting is translated here, mechanically, from the
rendered pod spec; any field this module does not know fails the translation with its name, so a
new manifest field is never silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlplugin.api import deviceplugin_pb2 as pb

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", "--events-backend=file"]
# This machine's restricted rlimits (see /work/shared/notes/machine-facts.md); not from a manifest.
MACHINE = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
CDI_MOUNTPOINT = Path("/var/run/cdi")

POD_FIELDS = {"automountServiceAccountToken", "containers", "enableServiceLinks", "hostIPC",
              "hostNetwork", "hostPID", "nodeSelector", "priorityClassName", "restartPolicy",
              "securityContext", "serviceAccountName", "terminationGracePeriodSeconds",
              "tolerations", "volumes"}
CONTAINER_FIELDS = {"args", "command", "env", "image", "imagePullPolicy", "livenessProbe", "name",
                    "ports", "readinessProbe", "resources", "securityContext", "startupProbe",
                    "terminationMessagePath", "terminationMessagePolicy", "volumeMounts"}
SECURITY_FIELDS = {"allowPrivilegeEscalation", "capabilities", "privileged", "readOnlyRootFilesystem",
                   "runAsGroup", "runAsNonRoot", "runAsUser", "seccompProfile"}
NATIVE_RESOURCES = {"cpu", "memory", "ephemeral-storage"}


class NotTranslated(Exception):
    """A manifest field this translation does not know: extend it rather than drop the field."""


def quantity(value: str | int) -> float:
    """A Kubernetes resource quantity as a number (bytes, cores)."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or (match.group(2) and match.group(2) not in units):
        raise NotTranslated(f"quantity {text!r}")
    return float(match.group(1)) * units.get(match.group(2), 1)


def podman(*args: str, check: bool = True, timeout: float = 120,
           cdi_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """One podman command; with ``cdi_dir``, in a private mount namespace where that directory is
    /var/run/cdi (podman 4.3 reads CDI specs only there and in /etc/cdi), so the machine's own
    CDI directory is never read or written."""
    argv = [*PODMAN, *args]
    if cdi_dir is not None:
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                str(cdi_dir), str(CDI_MOUNTPOINT), *argv]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        shown = " ".join(a for a in args if not a.startswith("-"))[:200]
        raise AssertionError(f"podman {shown} failed ({result.returncode}): "
                             f"{result.stderr.strip()}")
    return result


Allocator = Callable[[str, int], pb.ContainerAllocateResponse]


@dataclass
class Container:
    """One container of a pod, created in podman from its rendered spec."""

    name: str  # podman container name
    pod: dict[str, Any]  # the pod spec
    spec: dict[str, Any]  # the container spec
    allocations: dict[str, pb.ContainerAllocateResponse] = field(default_factory=dict)
    created_args: list[str] = field(default_factory=list)
    cdi: bool = False  # has CDI devices: created and started in the CDI mount namespace

    def inspect(self) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(podman("inspect", self.name).stdout)
        return data[0]

    @property
    def ip(self) -> str:
        settings = self.inspect()["NetworkSettings"]
        addresses = [settings.get("IPAddress")] + [n.get("IPAddress") for n in
                                                    (settings.get("Networks") or {}).values()]
        found = [a for a in addresses if a]
        assert found, f"{self.name} has no IP address: {settings}"
        return str(found[0])

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.inspect()["State"]
        return state

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for entry in self.spec.get("ports", []):
            if entry.get("name") == port:
                return int(entry["containerPort"])
        raise AssertionError(f"container {self.spec['name']} has no port named {port!r}")

    @property
    def grace(self) -> int:
        return int(self.pod.get("terminationGracePeriodSeconds", 30))

    def memory(self) -> dict[str, int]:
        """The container cgroup's memory, in bytes: ``working_set`` is what the kubelet and
        metrics-server report (usage minus inactive file pages), ``usage`` what the limit is
        enforced on, ``peak`` the cgroup's high-water mark of usage (0 where the kernel has none)."""
        path = self.inspect()["State"].get("CgroupPath", "").lstrip("/")
        v2 = Path("/sys/fs/cgroup", path)
        if (v2 / "memory.current").exists():
            files, inactive = ("memory.current", "memory.peak"), "inactive_file"
            base = v2
        else:
            files, inactive = ("memory.usage_in_bytes", "memory.max_usage_in_bytes"), "total_inactive_file"
            base = Path("/sys/fs/cgroup/memory", path)
        usage = int((base / files[0]).read_text())
        peak = int((base / files[1]).read_text()) if (base / files[1]).exists() else 0
        stats = {k: int(v) for k, v in
                 (line.split() for line in (base / "memory.stat").read_text().splitlines())}
        anon = stats.get("anon", stats.get("total_rss", 0))
        return {"working_set": usage - stats.get(inactive, 0), "usage": usage, "peak": peak,
                "anon": anon}

    def working_set(self) -> int:
        return self.memory()["working_set"]


class Node:
    """Host paths replaced by test directories, podman as the container runtime."""

    def __init__(self, root: Path, prefix: str, image: str, host_paths: dict[str, Path],
                 cdi_dir: Path, configmaps: Sequence[dict[str, Any]] = ()) -> None:
        self.root = root
        self.prefix = prefix
        self.image = image
        self.host_paths = host_paths
        self.cdi_dir = cdi_dir
        self.configmaps = {c["metadata"]["name"]: c for c in configmaps}
        self.containers: list[Container] = []

    def host(self, path: str) -> Path:
        """Where a manifest's hostPath is on this test node."""
        for prefix, replacement in self.host_paths.items():
            if path == prefix or path.startswith(prefix + "/"):
                return replacement / os.path.relpath(path, prefix)
        return Path(path)

    def create(self, pod: dict[str, Any], pod_name: str, allocate: Allocator) -> Container:
        """Create the pod's only container as the kubelet would have the runtime create it."""
        spec = pod["spec"]
        unknown = set(spec) - POD_FIELDS
        if unknown:
            raise NotTranslated(f"pod fields {sorted(unknown)}")
        (container,) = spec["containers"]
        name = f"{self.prefix}-{pod_name}"
        podman("rm", "--force", "--ignore", name)
        c = Container(name, spec, container)
        args = self._translate(c, pod_name, allocate)
        c.created_args = args
        podman("create", *args, cdi_dir=self._cdi() if c.cdi else None)
        self.containers.append(c)
        return c

    def _cdi(self) -> Path:
        """podman resolves CDI names at create and at start, from the node's CDI directory; before
        anything made it, from an empty one (never from the machine's own /var/run/cdi)."""
        cdi_dir = self.cdi_dir if self.cdi_dir.is_dir() else self.root / "no-cdi-dir-yet"
        cdi_dir.mkdir(exist_ok=True)
        return cdi_dir

    def start(self, container: Container) -> None:
        podman("start", container.name, cdi_dir=self._cdi() if container.cdi else None)

    def _translate(self, c: Container, pod_name: str, allocate: Allocator) -> list[str]:
        pod, spec = c.pod, c.spec
        unknown = set(spec) - CONTAINER_FIELDS
        if unknown:
            raise NotTranslated(f"container fields {sorted(unknown)}")
        args = ["--name", c.name, "--hostname", pod_name, *MACHINE, "--stop-timeout", str(c.grace)]
        for flag, ns in (("hostNetwork", "--network=host"), ("hostPID", "--pid=host"),
                         ("hostIPC", "--ipc=host")):
            if pod.get(flag):
                args.append(ns)
        # Security context: the container's fields override the pod's.
        pod_sc = dict(pod.get("securityContext", {}))
        sc = {**{k: v for k, v in pod_sc.items() if k in SECURITY_FIELDS},
              **spec.get("securityContext", {})}
        unknown = set(sc) - SECURITY_FIELDS | (set(pod_sc) - SECURITY_FIELDS)
        if unknown:
            raise NotTranslated(f"securityContext fields {sorted(unknown)}")
        if "runAsUser" in sc:
            user = str(sc["runAsUser"]) + (f":{sc['runAsGroup']}" if "runAsGroup" in sc else "")
            args += ["--user", user]
        if sc.get("runAsNonRoot") and int(sc.get("runAsUser", -1)) == 0:
            raise AssertionError(f"{pod_name}: runAsNonRoot with runAsUser 0: the kubelet refuses it")
        caps = sc.get("capabilities", {})
        args += [f"--cap-drop={cap}" for cap in caps.get("drop", [])]
        args += [f"--cap-add={cap}" for cap in caps.get("add", [])]
        if sc.get("privileged"):
            args.append("--privileged")
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        profile = sc.get("seccompProfile", {}).get("type", "RuntimeDefault")
        if profile == "Unconfined":
            args += ["--security-opt", "seccomp=unconfined"]
        elif profile != "RuntimeDefault":
            raise NotTranslated(f"seccompProfile type {profile}")
        if sc.get("readOnlyRootFilesystem"):
            # containerd mounts nothing writable for a read-only root; podman would add tmpfs.
            args += ["--read-only", "--read-only-tmpfs=false"]
        # Command, env.
        if "command" in spec:
            args += ["--entrypoint", json.dumps(spec["command"])]
        for env in spec.get("env", []):
            if set(env) != {"name", "value"}:
                raise NotTranslated(f"env entry {env}")
            args += ["--env", f"{env['name']}={env['value']}"]
        # Resources: memory and CPU as the kubelet sets the cgroup; extended ones from Allocate.
        resources = spec.get("resources", {})
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        if "memory" in limits:
            args += ["--memory", str(int(quantity(limits["memory"])))]
        if "cpu" in limits:
            args += ["--cpus", f"{quantity(limits['cpu']):.3f}"]
        if "cpu" in requests:
            args += ["--cpu-shares", str(max(2, int(quantity(requests["cpu"]) * 1024)))]
        extended = {k: v for k, v in {**requests, **limits}.items() if k not in NATIVE_RESOURCES}
        for resource, count in sorted(extended.items()):
            response = allocate(resource, int(count))
            c.allocations[resource] = response
            args += allocation_args(response)
            c.cdi = c.cdi or bool(response.cdi_devices)
        # A container with CDI devices starts in a private mount namespace (see podman()), where
        # podman would also bind its network namespace, out of reach of the host's podman: such a
        # container (the examples, whose NetworkPolicy denies all traffic) gets no network.
        args += ["--network", "none" if c.cdi else "bridge"]
        # Volumes.
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in spec.get("volumeMounts", []):
            unknown = set(mount) - {"name", "mountPath", "readOnly", "recursiveReadOnly"}
            if unknown:
                raise NotTranslated(f"volumeMount fields {sorted(unknown)}")
            source = self._volume(volumes[mount["name"]], pod_name)
            options = "ro" if mount.get("readOnly") else "rw"
            args += ["--volume", f"{source}:{mount['mountPath']}:{options}"]
        # The kubelet mounts a writable file at terminationMessagePath.
        message_path = spec.get("terminationMessagePath", "/dev/termination-log")
        termination = self.root / f"{pod_name}.termination-log"
        termination.touch()
        args += ["--volume", f"{termination}:{message_path}:rw"]
        args.append(self.image)
        args += [str(a) for a in spec.get("args", [])]
        return args

    def _volume(self, volume: dict[str, Any], pod_name: str) -> Path:
        if "hostPath" in volume:
            path = self.host(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                path.mkdir(mode=0o755, parents=True, exist_ok=True)
            elif kind == "Directory" and not path.is_dir():
                raise AssertionError(f"hostPath type check failed: {path} is not a directory")
            elif kind not in ("", "Directory", "DirectoryOrCreate"):
                raise NotTranslated(f"hostPath type {kind}")
            return path
        if "configMap" in volume:
            data = self.configmaps[volume["configMap"]["name"]]["data"]
            target = self.root / f"{pod_name}.{volume['name']}"
            target.mkdir(exist_ok=True)
            target.chmod(0o755)
            for key, value in data.items():
                (target / key).write_text(value)
                (target / key).chmod(0o644)
            return target
        raise NotTranslated(f"volume {volume}")

    def remove_all(self) -> None:
        for c in self.containers:
            podman("rm", "--force", "--ignore", "--time", "0", c.name, check=False)


def allocation_args(response: pb.ContainerAllocateResponse) -> list[str]:
    """What the kubelet hands the runtime from one ContainerAllocateResponse."""
    args: list[str] = []
    for device in response.devices:
        args += ["--device", f"{device.host_path}:{device.container_path}:{device.permissions}"]
    for mount in response.mounts:
        args += ["--volume", f"{mount.host_path}:{mount.container_path}:"
                             f"{'ro' if mount.read_only else 'rw'}"]
    for key, value in response.envs.items():
        args += ["--env", f"{key}={value}"]
    for device in response.cdi_devices:
        args += ["--device", device.name]
    return args


# --- probes, as the kubelet's prober runs them ---------------------------------------------------


@dataclass
class ProbeResult:
    at: float
    ok: bool
    detail: str


class Prober:
    """The kubelet's prober for one container: liveness and readiness on their own periods, with
    their timeouts and thresholds, in a thread. ``ready`` and ``restart_due`` follow the kubelet's
    rules: failureThreshold consecutive failures flip them, successThreshold successes undo it.
    A startupProbe runs first, alone: the others start only once it succeeded, and its
    failureThreshold consecutive failures are due a restart."""

    def __init__(self, container: Container) -> None:
        self.container = container
        self._ip = ""
        self.started = time.monotonic()
        self.ready = False
        self.ready_at: float | None = None
        self.restart_due = False
        self.results: dict[str, list[ProbeResult]] = {"startup": [], "readiness": [],
                                                      "liveness": []}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._started = threading.Event()
        if "startupProbe" not in container.spec:
            self._started.set()
        self._threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True)
                         for kind in ("startup", "readiness", "liveness")
                         if f"{kind}Probe" in container.spec]

    def __enter__(self) -> Prober:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def spec(self, kind: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.container.spec[f"{kind}Probe"]
        return spec

    def budget(self) -> float:
        """How long the kubelet lets a container become live: past this, liveness restarts it."""
        def allowed(spec: dict[str, Any]) -> float:
            return float(spec.get("initialDelaySeconds", 0)
                         + spec.get("periodSeconds", 10) * spec.get("failureThreshold", 3))

        live = self.container.spec.get("livenessProbe") or self.spec("readiness")
        startup = self.container.spec.get("startupProbe")
        return (allowed(startup) if startup else 0.0) + allowed(live)

    def run_once(self, kind: str) -> ProbeResult:
        spec = self.spec(kind)
        timeout = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            get = spec["httpGet"]
            self._ip = self._ip or self.container.ip
            url = f"http://{self._ip}:{self.container.port(get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    body = r.read().decode(errors="replace")
                    return ProbeResult(time.monotonic(), 200 <= r.status < 400, f"{r.status} {body}")
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")
                return ProbeResult(time.monotonic(), 200 <= exc.code < 400, f"{exc.code} {body}")
            except OSError as exc:
                return ProbeResult(time.monotonic(), False, f"GET {url}: {exc}")
        if "exec" in spec:
            try:
                result = podman("exec", self.container.name, *spec["exec"]["command"],
                                check=False, timeout=timeout)
            except subprocess.TimeoutExpired:
                return ProbeResult(time.monotonic(), False, f"exec timed out after {timeout}s")
            return ProbeResult(time.monotonic(), result.returncode == 0,
                               f"exit {result.returncode}: {result.stdout}{result.stderr}".strip())
        raise NotTranslated(f"{kind} probe {spec}")

    def _loop(self, kind: str) -> None:
        spec = self.spec(kind)
        period = float(spec.get("periodSeconds", 10))
        failures = int(spec.get("failureThreshold", 3))
        successes = int(spec.get("successThreshold", 1))
        if kind != "startup":
            while not self._started.wait(0.1):
                if self._stop.is_set():
                    return
        if self._stop.wait(float(spec.get("initialDelaySeconds", 0))):
            return
        bad = good = 0
        while not self._stop.is_set():
            result = self.run_once(kind)
            with self._cond:
                self.results[kind].append(result)
                bad, good = (0, good + 1) if result.ok else (bad + 1, 0)
                if kind == "startup":
                    if result.ok:
                        self._started.set()
                    elif bad >= failures:
                        self.restart_due = True
                    self._cond.notify_all()
                    if result.ok or self.restart_due:
                        return
                elif kind == "readiness":
                    if good >= successes and not self.ready:
                        self.ready = True
                        self.ready_at = result.at
                    elif bad >= failures:
                        self.ready = False
                elif bad >= failures:
                    self.restart_due = True
                self._cond.notify_all()
            self._stop.wait(period)

    def wait(self, predicate: Callable[[Prober], bool], timeout: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), timeout):
                raise AssertionError(f"{self.container.spec['name']}: {what} not within {timeout:.0f}s; "
                                     f"{self.describe()}")

    def describe(self) -> str:
        lines = []
        for kind, results in self.results.items():
            if results:
                last = results[-1]
                lines.append(f"last {kind} probe {'succeeded' if last.ok else 'failed'}: "
                             f"{last.detail.strip()[:300]}")
        ports = ", ".join(f"{p.get('name', '?')}={p['containerPort']}"
                          for p in self.container.spec.get("ports", []))
        lines.append(f"the container declares ports {ports or 'none'}")
        state = self.container.state()
        lines.append(f"container {state.get('Status')} (exit {state.get('ExitCode')}); logs:\n"
                     + "\n".join(self.container.logs().splitlines()[-15:]))
        return "\n".join(lines)


@contextlib.contextmanager
def cdi_mountpoint() -> Iterator[None]:
    """/var/run/cdi must exist to be bound over; made empty (on /run) if missing, never written."""
    created = not CDI_MOUNTPOINT.exists()
    if created:
        CDI_MOUNTPOINT.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        yield
    finally:
        if created:
            with contextlib.suppress(OSError):
                CDI_MOUNTPOINT.rmdir()


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def tool_missing(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


# --- podman's own reading of the manifest, to check the translation against -------------------


def kube_play_config(node: Node, pod: dict[str, Any], pod_name: str) -> dict[str, Any]:
    """How `podman kube play` configures the pod's container (created, never started), with the
    same substitutions the kubelet's side makes: this node's host paths and the built image."""
    spec = json.loads(json.dumps(pod["spec"]))
    for container in spec["containers"]:
        container["image"] = node.image
        container["imagePullPolicy"] = "Never"  # the image is the local build; no registry here
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            volume["hostPath"]["path"] = str(node.host(volume["hostPath"]["path"]))
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": f"{node.prefix}-kp-{pod_name}"},
                                   "spec": spec}]
    docs += [c for c in node.configmaps.values()
             if any(v.get("configMap", {}).get("name") == c["metadata"]["name"]
                    for v in spec.get("volumes", []))]
    manifest = node.root / f"kube-play-{pod_name}.yaml"
    manifest.write_text(json.dumps(docs[0]) + "".join("\n---\n" + json.dumps(d) for d in docs[1:]))
    podman("kube", "play", "--start=false", str(manifest))
    try:
        (container,) = spec["containers"]
        data: list[dict[str, Any]] = json.loads(
            podman("inspect", f"{node.prefix}-kp-{pod_name}-{container['name']}").stdout)
        return data[0]
    finally:
        podman("kube", "down", str(manifest), check=False)


DEFAULT_CAPS = {"CAP_AUDIT_WRITE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID",
                "CAP_KILL", "CAP_MKNOD", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SETFCAP",
                "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID", "CAP_SYS_CHROOT"}


def comparable(inspect: dict[str, Any], manifest_env: Sequence[str]) -> dict[str, Any]:
    """The settings both a kubelet and `kube play` derive from a pod spec, from `podman inspect`."""
    config, host = inspect["Config"], inspect["HostConfig"]
    caps = set(host.get("CapAdd") or []) | (DEFAULT_CAPS - set(host.get("CapDrop") or []))
    if "ALL" in (host.get("CapDrop") or []):
        caps = set(host.get("CapAdd") or [])
    binds = {}
    for bind in host.get("Binds") or []:
        source, dest, options = [*bind.split(":"), "rw"][:3]
        if not dest.endswith("termination-log"):  # the kubelet's, not the manifest's
            binds[dest] = (source, "ro" if "ro" in options.split(",") else "rw")
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    entrypoint = config.get("Entrypoint")
    return {"user": config.get("User"), "read-only root": host.get("ReadonlyRootfs"),
            "capabilities": sorted(caps), "memory limit": host.get("Memory"),
            "CPU limit (nanocpus)": host.get("NanoCpus") or (
                host.get("CpuQuota", 0) * 10**9 // max(1, host.get("CpuPeriod") or 100000)),
            "no-new-privileges": "no-new-privileges" in (host.get("SecurityOpt") or []),
            "privileged": host.get("Privileged"),
            "manifest env": {k: env.get(k) for k in manifest_env},
            "command": ([entrypoint] if isinstance(entrypoint, str) else entrypoint or [])
            + (config.get("Cmd") or []),
            "volumes": binds}
