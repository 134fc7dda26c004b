"""A killed test run leaves nothing behind: no process, mount, cgroup, namespace or iptables rule.

Each test starts a second cluster of its own (beside the session's: the namespaces keep them
apart, /var/lib/kubelet included) from a stand-in for pytest, with a pod running so that there are
containers, veths, overlay and tmpfs mounts and pod cgroups, then kills it. Run last (marker
``cluster_last``): each costs a cluster start, about 15 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.cluster import ROOT, Cluster
from support.clusterd import PREFIX, hierarchies

pytestmark = [pytest.mark.cluster, pytest.mark.cluster_last, pytest.mark.slow, pytest.mark.timeout(300)]

# The stand-in for a test run: a cluster with one pod running, its identities printed, then it
# waits to be killed.
STAND_IN = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT / "tests")!r})
from pathlib import Path
from support.cluster import Cluster, PAUSE_IMAGE
c = Cluster(Path(sys.argv[1]))
c.start()
c.apply({{"apiVersion": "v1", "kind": "Pod", "metadata": {{"name": "held", "namespace": "default"}},
          "spec": {{"containers": [{{"name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}}]}}}})
c.until(lambda: c.get("pod", "held", "-n", "default")["status"].get("phase") == "Running", 120, "held")
print(json.dumps({{"launcher": c.launcher.pid, "inner": c.pid}}), flush=True)
time.sleep(3600)
"""


@dataclass
class Trace:
    """What a cluster owns on the host, to look for after it is gone."""

    run: Path
    launcher: int
    inner: int
    namespaces: dict[str, str]

    @property
    def cgroup(self) -> str:
        return f"{PREFIX}{self.launcher}"


def host_state() -> dict[str, object]:
    """What must be the same before a cluster starts and after it is killed."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    return {"nat rules": sorted(line for line in rules.splitlines() if line.startswith("-A")),
            "mounts": len(Path("/proc/self/mountinfo").read_text().splitlines()),
            "paths": {p: os.path.lexists(p) for p in ("/var/lib/kubelet", "/etc/cdi", "/run/cdi",
                                                      "/run/containerd", "/var/log/pods")}}


def namespaces_in_use() -> set[str]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for kind in ("pid", "net", "mnt"):
            with contextlib.suppress(OSError):  # the process ended meanwhile
                found.add(os.readlink(f"/proc/{pid}/ns/{kind}"))
    return found


def leftovers(trace: Trace) -> list[str]:
    """Everything of the cluster still on the host; empty when it is all gone."""
    left = []
    for pid in (trace.launcher, trace.inner):
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            left.append(f"process {pid}")
    run = str(trace.run)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if run in cmdline and int(entry) != os.getpid():
            left.append(f"process {entry}: {cmdline[:120]!r}")
    left += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if run in line]
    left += [f"cgroup {h / trace.cgroup}" for h in hierarchies() if (h / trace.cgroup).exists()]
    left += [f"namespace {ns}" for ns in set(trace.namespaces.values()) & namespaces_in_use()]
    return left


@pytest.fixture
def stand_in(tmp_path: Path, cluster: Cluster) -> Iterator[tuple[subprocess.Popen[str], Trace]]:
    """A second cluster in a process of its own; ``cluster`` only makes sure one can start here."""
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(run)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the stand-in exited ({proc.wait()}) before its cluster ran a pod"
        ids = json.loads(line)
        namespaces = {kind: os.readlink(f"/proc/{ids['inner']}/ns/{kind}") for kind in ("pid", "net", "mnt")}
        yield proc, Trace(run, ids["launcher"], ids["inner"], namespaces)
    finally:
        proc.kill()
        proc.wait()


def test_a_sigkilled_test_run_leaves_nothing_behind(
        cluster: Cluster, stand_in: tuple[subprocess.Popen[str], Trace]) -> None:
    """Budget 40 s. SIGKILL the test run: the launcher sees its stdin end, kills the namespace's
    processes and removes its cgroups; the namespaces, mounts, veths and rules go with them."""
    proc, trace = stand_in
    before = host_state()
    assert leftovers(trace), "the cluster is visible on the host while it runs"
    assert any((h / trace.cgroup / "kubepods").exists() for h in hierarchies()), "the pod cgroups exist"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cluster.until(lambda: not leftovers(trace), 60, f"nothing of the killed cluster left: {leftovers(trace)}")
    assert host_state() == before


def test_a_sigkilled_launcher_leaves_cgroups_that_the_next_start_sweeps(
        cluster: Cluster, stand_in: tuple[subprocess.Popen[str], Trace], tmp_path: Path) -> None:
    """Budget 40 s. SIGKILL the launcher's PID 1 too (no cleanup runs): the kernel ends every
    process of the PID namespace, and the namespaces go, but v1 cgroups are not namespaced and
    stay. The next launcher to start removes those whose launcher is dead."""
    proc, trace = stand_in
    for pid in (trace.inner, trace.launcher, proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    cluster.until(lambda: leftovers(trace) == [f"cgroup {h / trace.cgroup}" for h in hierarchies()],
                  60, f"only the cgroups left: {leftovers(trace)}")
    plan = tmp_path / "empty-plan.json"  # a launcher with nothing to start: it sweeps and ends
    plan.write_text(json.dumps({
        "run": str(tmp_path / "sweeper"), "logs": str(tmp_path), "containerd_root": str(tmp_path / "c"),
        "binds": {}, "network": {"bridge": "cni0", "address": "10.244.0.1/24", "service_ip": "10.96.0.1",
                                 "service_port": 443, "apiserver": "10.244.0.1:6443"},
        "components": []}))
    swept = subprocess.run([sys.executable, str(ROOT / "tests/support/clusterd.py"), str(plan)],
                           input="", capture_output=True, text=True, timeout=60, check=False)
    assert swept.returncode == 0, swept.stderr
    assert "removed stale cgroups" in swept.stderr and trace.cgroup in swept.stderr, swept.stderr
    assert leftovers(trace) == []
