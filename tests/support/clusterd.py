"""The launcher of the test cluster (tests/support/cluster.py): run as ``python clusterd.py PLAN``.

It makes a new PID, mount and network namespace and becomes PID 1 of it, so whatever happens to
the test run, nothing outlives it: the processes die with the PID namespace, the mounts with the
mount namespace, the bridge, veths and iptables rules with the network namespace. Only cgroups
(v1) are not namespaced: the kubelet's ``cgroupRoot`` is ``/hlcluster-<launcher pid>`` in every
hierarchy, removed here on the way out, and swept at the next start when its launcher is dead.

Inside: a private tmpfs on /run (containerd's sockets and state, /var/run/cdi, netns files),
overlays on /etc and /var so nothing is written to the host's, and /var/lib/kubelet (the
device-plugin socket directory is a constant), /etc/cdi and /var/run/cdi bound from the run
directory, so tests read them from the host. ``lo`` and a bridge are up, and one DNAT rule
carries the ``kubernetes`` Service IP to the API server on the bridge address.

The PLAN (JSON, written by cluster.py) names the components and their command lines. Commands on
stdin, one a line, each answered on stdout (``ok ...`` or ``err ...``): ``start NAME``,
``stop NAME``, ``kill NAME``, ``restart NAME``, ``reboot`` (the node's processes killed, its
runtime state wiped, containerd and the kubelet started again), ``status``. End of stdin (the
test run ended, however it ended) or SIGTERM: everything is killed and the cgroups removed.
Standard library only: it runs before anything else of the test suite is importable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
CGROUP_FS = Path("/sys/fs/cgroup")
PREFIX = "hlcluster-"
NODE_COMPONENTS = ("containerd", "kubelet")  # what a node reboot restarts
STOP_GRACE = 10.0  # seconds a component has after SIGTERM before SIGKILL

libc = ctypes.CDLL(None, use_errno=True)


def log(message: str) -> None:
    print(f"clusterd: {message}", file=sys.stderr, flush=True)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy: on v1 each controller's, name=systemd's and the unified
    one beside them; on v2 the one unified hierarchy mounted at /sys/fs/cgroup itself."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS]
    if not CGROUP_FS.is_dir():
        return []
    return sorted(p for p in CGROUP_FS.iterdir() if (p / "cgroup.procs").exists())


def remove_tree(path: Path) -> bool:
    """rmdir a cgroup and its children, deepest first; False while a process is still in one."""
    done = True
    for child in [p for p in path.iterdir() if p.is_dir()] if path.is_dir() else []:
        done = remove_tree(child) and done
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return done


def remove_cgroups(name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all([remove_tree(h / name) for h in hierarchies()]):
        if time.monotonic() > deadline:
            log(f"cgroups {name} still busy after {timeout:g}s")
            return
        time.sleep(0.05)  # tasks leave a cgroup shortly after they are reaped


def launcher_alive(pid: int) -> bool:
    try:
        return "clusterd" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def sweep_stale() -> list[str]:
    """Remove the cgroups of launchers that died without removing them (SIGKILLed)."""
    stale = sorted({p.name for h in hierarchies() for p in h.glob(PREFIX + "*")
                    if p.name[len(PREFIX):].isdigit() and not launcher_alive(int(p.name[len(PREFIX):]))})
    for name in stale:
        remove_cgroups(name, timeout=2.0)
    return stale


def make_cgroups(name: str) -> None:
    for h in hierarchies():
        path = h / name
        path.mkdir(exist_ok=True)
        if h.name == "cpuset":  # a v1 cpuset starts empty: give it its parent's
            for key in ("cpuset.cpus", "cpuset.mems"):
                (path / key).write_text((h / key).read_text())


class Supervisor:
    """PID 1 of the namespace: starts components, reaps every process, obeys commands."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.components = {c["name"]: c for c in plan["components"]}
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.exited: dict[str, int] = {}
        self.exited_at: dict[str, float] = {}  # monotonic time of each exit reaped
        self.stopped: set[str] = set()  # stopped or killed by a command: never restarted here
        self.logs = Path(plan["logs"])

    def start(self, name: str) -> None:
        spec = self.components[name]
        if name in self.running:
            raise RuntimeError(f"{name} is running")
        log_file = (self.logs / f"{name}.log").open("ab")
        log_file.write(f"==== clusterd: start {name} at {time.time():.3f}\n".encode())
        log_file.flush()
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **spec.get("env", {})}
        argv = [a.replace("@CGROUP@", "/" + self.plan["cgroup"]) for a in spec["argv"]]
        self.running[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                              stderr=subprocess.STDOUT, env=env)
        log_file.close()
        self.exited.pop(name, None)
        self.stopped.discard(name)
        wait_for = spec.get("wait_for")
        if wait_for:
            deadline = time.monotonic() + 30
            while not os.path.exists(wait_for):
                self.reap()
                if name not in self.running or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not create {wait_for}")
                time.sleep(0.02)  # a socket file to appear: no event to wait on here

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.running.get(name)
        self.stopped.add(name)
        if proc is None:
            return
        proc.send_signal(sig)
        deadline = time.monotonic() + STOP_GRACE
        while name in self.running:
            self.reap()
            if time.monotonic() > deadline:
                proc.kill()
                deadline = time.monotonic() + STOP_GRACE
            time.sleep(0.01)

    def reap(self) -> None:
        """Reap every dead child: components and orphans reparented to PID 1 (shims, containers).
        A component that Popen reaped itself (send_signal() polls first, so one that died just as
        it was stopped) is recorded from its returncode: its pid never comes back here."""
        for name, proc in list(self.running.items()):
            if proc.returncode is not None:
                self.exited[name] = proc.returncode
                self.exited_at[name] = time.monotonic()
                del self.running[name]
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for name, proc in list(self.running.items()):
                if proc.pid == pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    self.exited[name] = proc.returncode
                    self.exited_at[name] = time.monotonic()
                    del self.running[name]

    def restart_exited(self) -> None:
        """Start again, ``restart_after`` seconds after it exited on its own, a component whose
        spec has that key, as systemd restarts a node's kubelet (kubeadm's unit: Restart=always):
        a kubelet started while containerd's CRI is still initializing exits at once ("server is
        not initialized yet"), which after a reboot on a loaded machine left the node down for
        every later test. A component a command stopped or killed stays down."""
        for name, code in list(self.exited.items()):
            after = self.components[name].get("restart_after")
            if after is None or name in self.stopped or name in self.running:
                continue
            if time.monotonic() - self.exited_at.get(name, 0.0) >= after:
                log(f"{name} exited ({code}) on its own: starting it again")
                self.start(name)

    def kill_others(self, keep: set[int]) -> None:
        """SIGKILL every process of the namespace but PID 1 and ``keep``, and reap them."""
        deadline = time.monotonic() + 20
        while True:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in keep | {1}]
            alive = [p for p in pids if Path(f"/proc/{p}/stat").exists()
                     and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.reap()
            if not alive or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def reboot(self) -> None:
        """A node reboot: its processes die at once, /run (a tmpfs) comes back empty, the disk
        (/var/lib/kubelet, containerd's root) stays; then containerd and the kubelet start."""
        for name in NODE_COMPONENTS:
            self.stop(name, signal.SIGKILL)
        keep = {p.pid for p in self.running.values()}
        self.kill_others(keep)
        volatile = ("/run/", "/var/lib/kubelet/pods/", self.plan["containerd_root"] + "/")
        targets = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for target in sorted((t for t in targets if t.startswith(volatile)), key=len, reverse=True):
            subprocess.run(["umount", "-l", target], check=False, stderr=subprocess.DEVNULL)
        for entry in Path("/run").iterdir():
            if entry.name == "cdi":  # a mount point from the run directory: empty it
                for spec in entry.iterdir():
                    shutil.rmtree(spec) if spec.is_dir() else spec.unlink()
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink()
        for h in hierarchies():  # the pods' cgroups; the root the kubelet needs stays
            for child in (h / self.plan["cgroup"]).glob("*"):
                if child.is_dir():
                    remove_tree(child)
        for name in NODE_COMPONENTS:
            self.start(name)

    def command(self, line: str) -> str:
        words = line.split()
        if not words:
            return "err empty command"
        verb, args = words[0], words[1:]
        if verb == "status":
            return "ok " + json.dumps({"running": {n: p.pid for n, p in self.running.items()},
                                       "exited": self.exited})
        if verb == "reboot":
            self.reboot()
            return "ok reboot"
        if verb in ("start", "stop", "kill", "restart") and len(args) == 1 and args[0] in self.components:
            name = args[0]
            if verb in ("stop", "restart"):
                self.stop(name)
            if verb == "kill":
                self.stop(name, signal.SIGKILL)
            if verb in ("start", "restart"):
                self.start(name)
            return f"ok {verb} {name}"
        return f"err unknown command: {line.strip()}"

    def serve(self) -> None:
        for component in self.plan["components"]:
            if component.get("autostart", True):
                self.start(component["name"])
        print("ok started", flush=True)
        buffered = b""
        while True:
            readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.2)
            self.reap()
            try:
                self.restart_exited()
            except Exception as exc:  # its next turn tries again
                log(f"restart failed: {exc}")
            if not readable:
                continue
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                return  # the test run is gone
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                try:
                    answer = self.command(line.decode())
                except Exception as exc:  # a failed command is an answer, not the end
                    answer = f"err {exc}"
                print(answer, flush=True)


def bind(target: str, source: Path) -> None:
    """``source`` (in the run directory, so the host reads it) mounted on ``target``."""
    source.mkdir(parents=True, exist_ok=True)
    Path(target).mkdir(parents=True, exist_ok=True)
    sh("mount", "--bind", str(source), target)


def overlay(target: str, work: Path) -> None:
    """Writes under ``target`` go to ``work``: the host's directory is read, never written."""
    name = target.strip("/").replace("/", "-")
    upper, scratch = work / f"{name}-upper", work / f"{name}-work"
    upper.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "overlay", "overlay", "-o",
       f"lowerdir={target},upperdir={upper},workdir={scratch}", target)


def setup_namespace(plan: dict[str, Any]) -> None:
    run = Path(plan["run"])
    sh("mount", "--make-rprivate", "/")
    sh("mount", "-t", "proc", "proc", "/proc")
    for target in ("/etc", "/var"):
        overlay(target, run / "overlays")
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")
    for target, source in plan["binds"].items():
        bind(target, Path(source))
    net = plan["network"]
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", net["bridge"], "type", "bridge")
    sh("ip", "addr", "add", net["address"], "dev", net["bridge"])
    sh("ip", "link", "set", net["bridge"], "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    for chain in ("PREROUTING", "OUTPUT"):
        sh("iptables", "-w", "-t", "nat", "-A", chain, "-d", net["service_ip"] + "/32", "-p", "tcp",
           "--dport", str(net["service_port"]), "-j", "DNAT", "--to-destination", net["apiserver"])


def inner(plan: dict[str, Any]) -> int:
    """PID 1 of the new namespaces."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()  # a ^C at the terminal reaches pytest, never the components: pytest decides
    supervisor = Supervisor(plan)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        setup_namespace(plan)
        make_cgroups(plan["cgroup"])
        supervisor.serve()
    except Exception as exc:
        log(f"failed: {exc}")
        print(f"err {exc}", flush=True)
    finally:
        supervisor.kill_others(set())
        remove_cgroups(plan["cgroup"])
    return 0


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    swept = sweep_stale()
    if swept:
        log(f"removed stale cgroups {', '.join(swept)}")
    plan["cgroup"] = f"{PREFIX}{os.getpid()}"
    if libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        print(f"err unshare: {os.strerror(errno)}", flush=True)
        return 1
    child = os.fork()  # the first child is PID 1 of the new PID namespace
    if child == 0:
        os._exit(inner(plan))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C reaches pytest too: it closes our stdin
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            return os.waitstatus_to_exitcode(status)
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
