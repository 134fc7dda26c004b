"""The session's one real cluster (tests/support/cluster.py) as pytest fixtures, re-exported by
tests/conftest.py: nothing here starts unless a test asks for ``cluster`` or ``installed``.

``installed`` is the chart installed as the README says (label the node, ``helm install`` with the
defaults, wait for both rollouts). A test that uninstalls, upgrades or reboots puts it back the way
it found it (``Installed.ensure``), so the cluster tests run in any order; the destructive ones
still run last (marker ``cluster_last``), where a failure to restore harms no other test.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from support.cluster import Cluster, Result

ROOT = Path(__file__).resolve().parents[2]
RELEASE, NAMESPACE = "hlplugin", "hyperlight-system"
DAEMONSETS = ("hyperlight-device-access", "hyperlight-device-plugin")
HYPERVISOR, ACCESS = "hyperlight.dev/hypervisor", "hyperlight.dev/device-access"


def build_image() -> str:
    """The project's image, built as tests/test_node.py builds it (deploy/local-node.sh), or the
    one HLPLUGIN_IMAGE names when HLPLUGIN_IMAGE_BUILT is set. The default tag is this clone's
    own, so two clones' sessions on one machine never import each other's build."""
    clone = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
    name = os.environ.get("HLPLUGIN_IMAGE", f"localhost/hlplugin:cluster-{clone}")
    if os.environ.get("HLPLUGIN_IMAGE_BUILT"):
        return name
    result = subprocess.run([str(ROOT / "deploy/local-node.sh"), "build"], capture_output=True,
                            text=True, timeout=900, env={**os.environ, "HLPLUGIN_IMAGE": name},
                            check=False)
    if result.returncode != 0:
        pytest.fail(f"building the image failed:\n{result.stderr[-3000:]}")
    return name


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from support.cluster import Cluster, missing

    reasons = missing()
    if reasons:
        pytest.skip("no real cluster: " + "; ".join(reasons))
    image = build_image()
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        c.import_image(image, c.chart_image())
        yield c
    finally:
        c.stop()


@dataclass
class Installed:
    """The release as the README installs it, and what its commands printed."""

    cluster: Cluster
    commands: list[Result] = field(default_factory=list)

    def install(self) -> None:
        """The README's commands, with the repository's chart (its second way) and our node."""
        from support.cluster import NODE

        c = self.cluster
        self.commands = [
            c.inside(["deploy/label-nodes.sh", "--hypervisor", "kvm", NODE]),
            c.helm("install", RELEASE, "deploy/chart/hlplugin", "-n", NAMESPACE, "--create-namespace"),
        ]
        self.commands += [c.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{name}",
                                    "--timeout", "180s", timeout=200) for name in DAEMONSETS]

    def present(self) -> bool:
        listed = self.cluster.helm("list", "-n", NAMESPACE, "-q", check=False)
        return RELEASE in listed.stdout.split()

    def ensure(self) -> None:
        """Installed with the defaults and both DaemonSets rolled out, whatever a test did."""
        c = self.cluster
        if not self.present():
            self.install()
        revision = c.helm("history", RELEASE, "-n", NAMESPACE, "-o", "json").json()[-1]
        if revision.get("status") != "deployed" or c.helm("get", "values", RELEASE, "-n", NAMESPACE,
                                                          "-o", "json").stdout.strip() not in ("{}", "null"):
            c.helm("upgrade", RELEASE, "deploy/chart/hlplugin", "-n", NAMESPACE, "--reset-values")
        for name in DAEMONSETS:
            c.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{name}", "--timeout", "180s",
                      timeout=200)
        # A kubelet started a moment ago (a test that restarted it) has neither probed every pod
        # yet nor reported its device manager's state: a rollout then meets a probe the daemon
        # could not foresee, or a node status from before the restart (two CI runs failed so).
        c.until(lambda: settled(c), 60, "the kubelet settled since its last start")
        # The kubelet's next node-status update (up to 10 s) publishes the plugins' capacity: all
        # of it healthy (how many device-access slots is the tests' business, not the fixture's).

        def published() -> bool:
            allocatable, capacity = c.allocatable(), c.capacity()
            return allocatable.get(HYPERVISOR) == "2k" and allocatable.get(ACCESS, "0") != "0" \
                and allocatable.get(ACCESS) == capacity.get(ACCESS)

        c.until(published, 60, "allocatable 2k slots and every device-access")


# The manifests' readiness period and a second: by then the kubelet has probed each ready pod.
SETTLE = 6.0


def settled(c: Cluster) -> bool:
    """The node's lease was renewed SETTLE seconds or more after the kubelet's latest start
    (tests/support/clusterd.py marks each start in the kubelet's log, in the same clock)."""
    from support.cluster import NODE

    starts = re.findall(r"==== clusterd: start kubelet at ([0-9.]+)", c.log("kubelet"))
    lease = c.get("lease", "-n", "kube-node-lease", NODE)
    renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00")).timestamp()
    return not starts or renewed >= float(starts[-1]) + SETTLE


@pytest.fixture(scope="session")
def installed(cluster: Cluster) -> Installed:
    release = Installed(cluster)
    release.install()
    return release


@pytest.fixture
def release(installed: Installed) -> Iterator[Installed]:
    """The installed release, restored after the test."""
    installed.ensure()
    yield installed
    installed.ensure()


def workload(name: str, slots: int = 1) -> dict[str, Any]:
    """A Deployment of one pod holding ``slots`` slots, that stops at once when asked."""
    from support.cluster import Cluster  # at use: the conftest imports this module for its fixtures
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "c", "image": Cluster.chart_image(),
                                         "imagePullPolicy": "IfNotPresent",
                                         "command": ["sleep", "infinity"],
                                         "resources": {"limits": {HYPERVISOR: str(slots)}}}]}}}}


def running_workload(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods("default", f"app={name}") if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]
