"""The podman node the node tests share (tests/test_node.py, tests/test_node_workload.py): the
image, the DaemonSets and examples as operators install them, the emulated kubelet's loop, and
the marks that skip where podman, root or /dev/kvm is missing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from harness import helm_template, kustomize, wait_until
from podnode import (
    Container,
    Node,
    Prober,
    is_socket,
    tool_missing,
)

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.tools.emulator import KubeletEmulator

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
# The chart (its defaults render what deploy/base with reserve-device-access renders:
# tests/test_chart.py), or a kustomization such as deploy/overlays/kind.
OVERLAY = ROOT / os.environ.get("HLPLUGIN_NODE_OVERLAY", "deploy/chart/hlplugin")
IS_CHART = (OVERLAY / "Chart.yaml").exists()
EXAMPLES = OVERLAY / "examples" if (OVERLAY / "examples").is_dir() else ROOT / "deploy/examples"
SCRIPT = ROOT / "deploy/local-node.sh"
ACCESS = "hyperlight.dev/device-access"
HYPERVISOR = "hyperlight.dev/hypervisor"
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
CDI_DIR = "/var/run/cdi"
KVM = Path("/dev/kvm")
BUILD_TOOLS = () if os.environ.get("HLPLUGIN_IMAGE_BUILT") else ("mmdebstrap",)
MISSING = tool_missing("podman", "runc", "unshare", "kubectl", *BUILD_TOOLS, *(("helm",) if IS_CHART else ()))

# Every node test module's pytestmark.
NODE_MARKS = [
    pytest.mark.node,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="podman with host devices and mounts needs root"),
    pytest.mark.skipif(not KVM.exists(), reason="no /dev/kvm on this machine"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} on PATH (apt-get install "
                       "podman runc mmdebstrap; kubectl renders the kustomizations, helm the chart: "
                       "bash .ci/run installs it)"),
]


def pod_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod a controller creates from a DaemonSet or Deployment; a Pod as it is."""
    return doc["spec"]["template"] if doc["kind"] in ("DaemonSet", "Deployment") else doc


def one(docs: list[dict[str, Any]], kind: str, resource: str) -> dict[str, Any]:
    """The one document of ``kind`` whose container requests ``resource``, or serves it."""
    found = [d for d in docs if d["kind"] == kind
             and any(resource in c.get("resources", {}).get("limits", {}) or
                     c.get("args", [None])[0] == resource
                     for c in pod_of(d)["spec"]["containers"])]
    assert len(found) == 1, f"expected one {kind} for {resource}, found {len(found)}"
    return found[0]


class Loop:
    """An asyncio loop in a thread: the kubelet emulator lives across the module's tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop, then close it: a stopped loop still holds its self-pipe (two sockets)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Cluster:
    """The node under test: podman, the kubelet emulator, and the rendered pods."""

    node: Node
    loop: Loop
    kubelet: KubeletEmulator
    plugin_dir: Path
    cdi_dir: Path
    bootstrap_pod: dict[str, Any]
    main_pod: dict[str, Any]
    workloads: list[tuple[str, dict[str, Any]]]
    bootstrap: Container | None = None
    main: Container | None = None

    def admit(self, resource: str, count: int) -> pb.ContainerAllocateResponse:
        """The device manager's part of pod admission: Allocate for one container."""
        response = self.loop.call(self.kubelet.admit(resource, per_container=count))
        (container,) = response.container_responses
        return container

    def wait(self, predicate: Any, what: str, timeout: float = 60) -> None:
        try:
            self.loop.call(self.kubelet.wait_for(predicate, timeout), timeout + 5)
        except TimeoutError:
            raise AssertionError(f"the kubelet emulator did not see: {what} within {timeout}s; "
                                 f"{self.explain()}") from None

    def until(self, predicate: Any, what: str, timeout: float) -> None:
        """harness.wait_until on the emulator's loop; a timeout fails with explain()."""
        try:
            self.loop.call(wait_until(predicate, timeout, what), timeout + 5)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; {self.explain()}") from None

    def explain(self) -> str:
        """What a person needs first: each daemon's readiness answer, then its state and logs."""
        running = [c for c in (self.main, self.bootstrap) if c is not None]
        out = []
        for c in running:
            state = c.state()
            readyz = Prober(c).run_once("readiness").detail.strip() if state["Running"] else "-"
            out.append(f"{c.spec['name']}: {state.get('Status')} (exit {state.get('ExitCode')}), "
                       f"its readiness probe says {readyz}")
        for c in running:
            out.append(f"{c.spec['name']} last logs:\n  " + "\n  ".join(c.logs().splitlines()[-12:]))
        return "\n".join(out)

    def start(self, container: Container) -> None:
        self.node.start(container)

    def _serving(self, resource: str, socket: str, count: int | None = None) -> bool:
        """Registered with healthy devices and its socket there: running, without asking podman
        (a container stopped by a test has removed its socket; a killed one is restarted there)."""
        allocatable = self.kubelet.allocatable(resource)
        return (allocatable == count if count else allocatable > 0) and is_socket(self.plugin_dir / socket)

    def ensure_bootstrap(self) -> Container:
        """The bootstrap container, made if no test made it yet, running and registered."""
        if self.bootstrap is None:
            self.bootstrap = self.node.create(self.bootstrap_pod, "device-access", self.admit)
        if not self._serving(ACCESS, "hyperlight-device-access.sock", ACCESS_SLOTS) \
                and not self.bootstrap.state()["Running"]:  # not started yet, or stopped by a test
            self.start(self.bootstrap)
        self.wait(lambda: self.kubelet.allocatable(ACCESS) == ACCESS_SLOTS,
                  f"{ACCESS} registered by the bootstrap container with its healthy devices")
        return self.bootstrap

    def ensure_main(self) -> Container:
        """The main container (after the bootstrap's, whose device it is allocated), made if no
        test made it yet, running and registered with healthy devices."""
        self.ensure_bootstrap()
        if self.main is None:
            self.main = self.node.create(self.main_pod, "device-plugin", self.admit)
        if not self._serving(HYPERVISOR, "hyperlight.sock") and not self.main.state()["Running"]:
            self.start(self.main)
        self.wait(lambda: self.kubelet.allocatable(HYPERVISOR) > 0,
                  f"{HYPERVISOR} registered by the main container with healthy devices",
                  Prober(self.main).budget())
        return self.main


@pytest.fixture(scope="module")
def image() -> str:
    name = os.environ.get("HLPLUGIN_IMAGE", "localhost/hlplugin:node-test")
    if os.environ.get("HLPLUGIN_IMAGE_BUILT"):
        return name
    result = subprocess.run([str(SCRIPT), "build"], env={**os.environ, "HLPLUGIN_IMAGE": name},
                            capture_output=True, text=True, timeout=900, check=False)
    if result.returncode != 0:
        pytest.fail(f"building the image from the Dockerfile failed:\n{result.stderr[-3000:]}")
    return name


def render_plugins() -> str:
    """The DaemonSets' manifests: `helm template` of the chart into hyperlight-system, as
    `helm install -n hyperlight-system` renders it, or `kubectl kustomize` of an overlay."""
    if not IS_CHART:
        return kustomize(OVERLAY)
    result = helm_template(OVERLAY, "hyperlight-system")
    assert result.returncode == 0, f"helm template {OVERLAY}:\n{result.stderr}"
    return result.stdout
