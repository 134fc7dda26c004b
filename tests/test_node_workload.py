"""A long-running workload keeps its VM while the node is broken and repaired around it (issue 21
#8, the seed's "continuous guests" row): on the podman node of tests/support/node.py, a workload pod
holds one KVM VM and counts guest runs (tests/data/guest_loop.py) while the main and bootstrap
containers are killed and started again, the CDI spec is garbled and repaired, and the daemons'
device view (/host-dev, the host's /dev) is broken and restored. It never loses its device and its
count rises across every fault. Self-contained: its own node, kubelet emulator and containers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import documents, kustomize
from podnode import Container, Node, cdi_mountpoint, podman
from support.node import (
    ACCESS,
    CDI_DIR,
    EXAMPLES,
    HYPERVISOR,
    KVM,
    NODE_MARKS,
    PLUGIN_DIR,
    Cluster,
    Loop,
    one,
    pod_of,
    render_plugins,
)
from support.node import image as image  # a fixture

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.tools.emulator import KubeletEmulator

pytestmark = NODE_MARKS
GUEST_LOOP = Path(__file__).parent / "data" / "guest_loop.py"
GUARD = 90.0  # seconds: a guard for a busy machine, never a measurement


def workload_pod(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """The example Deployment's pod, running the guest loop instead of its periodic check (and
    without its probes, which would start VMs of their own)."""
    pod = json.loads(json.dumps(pod_of(one(examples, "Deployment", HYPERVISOR))))
    (container,) = pod["spec"]["containers"]
    container["command"] = ["python3", "-c", GUEST_LOOP.read_text()]
    for probe in ("livenessProbe", "readinessProbe"):
        container.pop(probe, None)
    pod["spec"]["volumes"] = []
    container["volumeMounts"] = []
    return pod


def make_kvm_node(path: Path) -> None:
    """/dev/kvm's numbers at ``path``: the host's device node as the daemons' /host-dev shows it."""
    path.unlink(missing_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, os.stat(KVM).st_rdev)


@pytest.fixture
def node(image: str, tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    """A node of its own whose hostPath /dev is a directory holding a kvm node (so the test can
    break the device view without touching the machine's /dev)."""
    rendered = documents(render_plugins())
    examples = documents(kustomize(EXAMPLES))
    plugin_dir = Path(tempfile.mkdtemp(prefix="hlw-", dir="/tmp"))
    cdi_dir = tmp_path / "cdi"
    host_dev = tmp_path / "host-dev"
    host_dev.mkdir()
    make_kvm_node(host_dev / "kvm")
    pods = Node(tmp_path, f"hlwork-{os.getpid()}", image,
                {PLUGIN_DIR: plugin_dir, CDI_DIR: cdi_dir, "/dev": host_dev}, cdi_dir)
    loop = Loop()
    kubelet = KubeletEmulator(plugin_dir)
    loop.call(kubelet.start())
    cluster = Cluster(pods, loop, kubelet, plugin_dir, cdi_dir,
                      pod_of(one(rendered, "DaemonSet", "bootstrap")),
                      pod_of(one(rendered, "DaemonSet", ACCESS)),
                      [("workload", workload_pod(examples))])
    try:
        with cdi_mountpoint():
            yield cluster, host_dev
    finally:
        pods.remove_all()
        loop.call(kubelet.stop())
        loop.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def guest_runs(workload: Container) -> int:
    """The workload's latest count; fails at once when it reported a failure or stopped."""
    logs = workload.logs()
    assert "FAILED" not in logs, f"the workload failed:\n{logs[-2000:]}"
    assert workload.state()["Running"], f"the workload stopped:\n{logs[-2000:]}"
    counts = re.findall(r"^guest runs: (\d+)$", logs, re.M)
    return int(counts[-1]) if counts else 0


def test_a_running_guest_keeps_its_device_across_restarts_and_node_faults(
        node: tuple[Cluster, Path]) -> None:
    c, host_dev = node
    c.bootstrap = c.node.create(c.bootstrap_pod, "device-access", c.admit)
    c.start(c.bootstrap)
    c.wait(lambda: c.kubelet.allocatable(ACCESS) == ACCESS_SLOTS, "the bootstrap registered", GUARD)
    c.main = c.node.create(c.main_pod, "device-plugin", c.admit)
    c.start(c.main)
    c.wait(lambda: c.kubelet.allocatable(HYPERVISOR) > 0, "the main plugin registered", GUARD)
    (name, pod), = c.workloads
    workload = c.node.create(pod, name, c.admit)
    c.start(workload)
    started = workload.state()["StartedAt"]
    c.until(lambda: guest_runs(workload) > 0, "the workload's first guest run", GUARD)
    spec = c.cdi_dir / "hyperlight.json"
    good_spec = spec.read_bytes()
    progress: dict[str, float] = {}

    def rises(what: str) -> None:
        """The count rises from now on (the guest keeps running through ``what``)."""
        before = guest_runs(workload)
        c.until(lambda: guest_runs(workload) > before, f"guest runs rising {what}", GUARD)

    def fault(what: str, breaks: Any, broken: Any, repairs: Any, repaired: Any) -> None:
        began, before = time.monotonic(), guest_runs(workload)
        breaks()
        c.until(broken, f"{what}: the fault seen", GUARD)
        rises(f"while {what}")
        repairs()
        c.until(repaired, f"{what}: repaired", GUARD)
        rises(f"after {what}")
        progress[what] = round((guest_runs(workload) - before) / (time.monotonic() - began), 1)

    registered_at = {r: c.kubelet.resources[r].registered_at for r in (ACCESS, HYPERVISOR)}

    def restart(container: Container | None, resource: str, count: Any) -> None:
        assert container is not None

        def again() -> bool:
            fresh = c.kubelet.resources.get(resource)
            return (fresh is not None and fresh.registered_at > registered_at[resource]
                    and c.kubelet.allocatable(resource) == count())

        fault(f"the {container.spec['name']} container killed and started again",
              lambda: podman("kill", "--signal", "KILL", container.name),
              lambda: not c.kubelet.registered(resource),
              lambda: c.start(container), again)
        registered_at[resource] = c.kubelet.resources[resource].registered_at

    slots = c.kubelet.capacity(HYPERVISOR)
    restart(c.main, HYPERVISOR, lambda: slots)
    restart(c.bootstrap, ACCESS, lambda: ACCESS_SLOTS)
    fault("the CDI spec garbled",
          lambda: spec.write_text('{"cdiVersion": "0.5.0", "kind": "evil.example/x"'),
          lambda: True,  # the write is the fault: the daemon may have repaired it already
          lambda: None,  # the main daemon repairs it itself
          lambda: spec.read_bytes() == good_spec)
    fault("the device view broken (/dev/null's numbers at /host-dev/kvm)",
          lambda: (os.unlink(host_dev / "kvm"),
                   os.mknod(host_dev / "kvm", stat.S_IFCHR | 0o600, os.stat("/dev/null").st_rdev)),
          lambda: c.kubelet.allocatable(HYPERVISOR) == 0,
          lambda: make_kvm_node(host_dev / "kvm"),
          lambda: c.kubelet.allocatable(HYPERVISOR) == slots
          and c.kubelet.allocatable(ACCESS) == ACCESS_SLOTS)

    # The same process, its VM and its device all along; and the node serves a new pod again.
    state = workload.state()
    assert state["Running"] and state["StartedAt"] == started, state
    assert "holding VM fd" in workload.logs()
    held = podman("exec", workload.name, "python3", "-c",
                  "import os, stat; print(stat.S_ISCHR(os.stat('/dev/kvm').st_mode))")
    assert held.stdout.strip() == "True", held.stdout
    c.admit(HYPERVISOR, 1)
    print(f"\nguest runs per second over each fault: {progress}")
