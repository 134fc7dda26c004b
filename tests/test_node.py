"""The whole node, as operators install it: the image built from the Dockerfile, both DaemonSets from
the Helm chart's default rendering (`helm template`; HLPLUGIN_NODE_OVERLAY names a kustomization to
run instead) and the example workload from `kubectl kustomize` output, run in podman, with the
kubelet emulator in the kubelet's place (device manager and prober). The kubelet is the only thing
emulated.

The tests share one node; each makes, starts or restarts the containers it needs (the `running`
fixture), so any one runs alone and in any order. In file order: bootstrap, main daemon, workload,
probes, faults, memory, termination. deploy/local-node.sh builds the image (or HLPLUGIN_IMAGE
names a built one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import documents, kustomize
from podnode import (
    Node,
    Prober,
    cdi_mountpoint,
    comparable,
    is_socket,
    kube_play_config,
    podman,
    quantity,
)
from support.node import (
    ACCESS,
    CDI_DIR,
    EXAMPLES,
    HYPERVISOR,
    IS_CHART,
    NODE_MARKS,
    PLUGIN_DIR,
    ROOT,
    SCRIPT,
    Cluster,
    Loop,
    one,
    pod_of,
    render_plugins,
)
from support.node import image as image  # a fixture

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.cdi_spec import check_file, render_spec
from hlplugin.tools.emulator import KubeletEmulator

pytestmark = NODE_MARKS


@pytest.fixture(scope="module")
def cluster(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    rendered = documents(render_plugins())
    examples = documents(kustomize(EXAMPLES))
    root = tmp_path_factory.mktemp("node")
    # Short: unix socket paths are limited to 107 bytes.
    plugin_dir = Path(tempfile.mkdtemp(prefix="hln-", dir="/tmp"))
    cdi_dir = root / "cdi"
    node = Node(root, f"hlnode-{os.getpid()}", image,
                {PLUGIN_DIR: plugin_dir, CDI_DIR: cdi_dir}, cdi_dir,
                [d for d in examples if d["kind"] == "ConfigMap"])
    loop = Loop()
    kubelet = KubeletEmulator(plugin_dir)
    loop.call(kubelet.start())
    workloads = [(f"{d['kind'].lower()}-{d['metadata']['name']}", pod_of(d)) for d in examples
                 if d["kind"] in ("Pod", "Deployment")
                 and any(HYPERVISOR in c.get("resources", {}).get("limits", {})
                         for c in pod_of(d)["spec"]["containers"])]
    c = Cluster(node, loop, kubelet, plugin_dir, cdi_dir,
                pod_of(one(rendered, "DaemonSet", "bootstrap")),
                pod_of(one(rendered, "DaemonSet", ACCESS)), workloads)
    try:
        with cdi_mountpoint():
            yield c
    finally:
        node.remove_all()
        loop.call(kubelet.stop())
        loop.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)


@pytest.fixture
def running(cluster: Cluster) -> Cluster:
    """The node with both daemons' containers running and registered, whatever ran before."""
    cluster.ensure_main()
    return cluster


def mib(size: float) -> float:
    return round(size / 2**20, 1)


def obstruct(spec: Path) -> None:
    """Make the CDI spec path a directory, racing the daemon that rewrites the file at once."""
    for _ in range(100):
        spec.unlink(missing_ok=True)
        try:
            spec.mkdir()
            return
        except FileExistsError:
            continue
    raise AssertionError(f"could not obstruct {spec}: the daemon rewrote it 100 times in a row")


def probers(c: Cluster) -> tuple[Prober, Prober]:
    """The readiness and liveness probers of both containers (the ``running`` fixture's)."""
    assert c.bootstrap is not None and c.main is not None, "use the running fixture"
    return Prober(c.bootstrap), Prober(c.main)


# --- 1. the image ---------------------------------------------------------------------------------


def test_build_fails_when_the_context_lacks_a_file(image: str, tmp_path: Path) -> None:
    """The build uses only what the Dockerfile names: a context without README.md fails."""
    context = tmp_path / "context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml"):
        shutil.copy(ROOT / name, context / name)
    shutil.copytree(ROOT / "src", context / "src")
    result = subprocess.run([str(SCRIPT), "build"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "CONTEXT": str(context),
                                 "HLPLUGIN_IMAGE": "localhost/hlplugin:node-test-broken"},
                            check=False)
    assert result.returncode != 0, "the build succeeded without README.md"
    assert "README.md" in result.stderr, result.stderr[-2000:]


# --- 2, 3. both DaemonSets and the workload, with the kubelet's device manager --------------------


def test_bootstrap_container_registers_device_access(cluster: Cluster) -> None:
    cluster.ensure_bootstrap()  # made, started, and registered with 1 healthy device


def test_main_container_gets_kvm_only_from_allocate_and_registers(cluster: Cluster) -> None:
    c = cluster
    main = c.ensure_main()  # made with what Allocate of the bootstrap's device gave, registered
    (response,) = main.allocations.values()
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/kvm", "/dev/kvm", "rw")], response
    assert main.created_args.count("--device") == 1, "nothing but Allocate gives it a device"
    env = {e["name"]: e["value"] for e in c.main_pod["spec"]["containers"][0]["env"]}
    assert c.kubelet.capacity(HYPERVISOR) == int(env["DEVICE_COUNT"])
    spec = c.cdi_dir / "hyperlight.json"
    assert check_file(spec, render_spec("kvm", int(env["DEVICE_UID"]), int(env["DEVICE_GID"]))) == \
        (True, ""), f"the main container's CDI spec did not reach the CDI hostPath {CDI_DIR}"


def test_example_workloads_create_a_vm_through_cdi_as_65534(running: Cluster) -> None:
    c = running
    assert c.workloads, f"no example workload requests {HYPERVISOR} in {EXAMPLES}"
    for pod_name, pod in c.workloads:
        workload = c.node.create(pod, pod_name, c.admit)
        (response,) = workload.allocations.values()
        assert [d.name for d in response.cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
        c.start(workload)
        if pod.get("spec", {}).get("restartPolicy") == "Never":
            code = podman("wait", workload.name, timeout=120).stdout.strip()
            logs = workload.logs()
            assert code == "0", f"{pod_name} exited {code}: {logs}"
            assert "created a KVM VM as uid=65534 gid=65534" in logs, logs
            continue
        with Prober(workload) as prober:
            prober.wait(lambda p: p.ready, prober.budget(), f"{pod_name} Ready")
            prober.wait(lambda p: any(r.ok for r in p.results["liveness"]), prober.budget(),
                        f"{pod_name}: a successful liveness probe")
        # Past creating a VM: a guest runs to its halt, as UID 65534 with no capabilities.
        guest = podman("exec", workload.name, "python3", "-c",
                       "import os, pathlib; from hlplugin.probe import probe_kvm; "
                       "probe_kvm(pathlib.Path('/dev/kvm'), guest=True); "
                       "print('guest ran as', os.getuid(), open('/proc/self/status').read()"
                       ".split('CapEff:')[1].split()[0])", check=False)
        assert guest.returncode == 0, f"{pod_name}: the guest did not run: {guest.stderr}"
        assert guest.stdout.split() == ["guest", "ran", "as", "65534", "0000000000000000"], guest.stdout
        podman("rm", "--force", "--time", "0", workload.name)


@pytest.mark.skipif(not IS_CHART, reason="`helm test`'s pod is the chart's; an overlay has none")
def test_the_helm_test_pod_passes_on_a_node_that_serves_hyperlight(running: Cluster) -> None:
    """What `helm test` runs (templates/tests/vm-check.yaml), as the kubelet would run it: admitted
    with its one hyperlight.dev/hypervisor (the CDI device, nothing else), as UID 65534 with no
    capability and a read-only root, it exits 0 with the doctor's VM and guest run and verdict OK.
    The same pod without the slot's device fails, so its verdict is the device's."""
    c = running
    (hook,) = [d for d in documents(render_plugins()) if d["kind"] == "Pod"
               and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    test = c.node.create(hook, "helm-test", c.admit)
    (response,) = test.allocations.values()
    assert [d.name for d in response.cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
    assert not response.devices, "only the CDI device: no DeviceSpec, no mount"
    c.start(test)
    code = podman("wait", test.name, timeout=120).stdout.strip()
    logs = test.logs()
    assert code == "0", f"the helm test pod exited {code}: {logs}"
    for row in ("VM creation      OK", "guest run        OK", "CDI device       OK", "verdict: OK"):
        assert row in logs, logs
    assert "owner 65534:65534" in logs, "the node the runtime made for the workload's UID"

    def nothing(resource: str, count: int) -> pb.ContainerAllocateResponse:
        return pb.ContainerAllocateResponse()  # admitted without the device

    bare = c.node.create(hook, "helm-test-bare", nothing)
    c.start(bare)
    code = podman("wait", bare.name, timeout=120).stdout.strip()
    assert code == "1" and "verdict: FAIL" in bare.logs(), f"exit {code}: {bare.logs()}"


def test_translation_agrees_with_podman_kube_play(cluster: Cluster) -> None:
    """podman's own reading of each pod spec (`kube play`, not started) and ours give the same
    user, root, capabilities, limits, env, command and volumes."""
    if shutil.which("catatonit") is None:
        pytest.skip("podman kube play needs catatonit for its infra container (apt-get install catatonit)")
    c = cluster
    for container, pod in ((c.ensure_bootstrap(), c.bootstrap_pod), (c.ensure_main(), c.main_pod)):
        env = [e["name"] for e in container.spec.get("env", [])]
        theirs = comparable(kube_play_config(c.node, pod, container.spec["name"]), env)
        ours = comparable(container.inspect(), env)
        for key in ours:
            assert ours[key] == theirs[key], (f"{container.spec['name']}: {key}: our translation "
                                              f"gives {ours[key]!r}, podman kube play {theirs[key]!r}")


# --- 4. probes ----------------------------------------------------------------------------------


def test_both_daemons_ready_within_the_probes_budget(running: Cluster) -> None:
    boot, main = probers(running)
    with boot, main:
        for prober in (boot, main):
            prober.wait(lambda p: p.ready, prober.budget(), "Ready under the readiness probe")
            assert prober.ready_at is not None
            assert not prober.restart_due, prober.describe()
        # Liveness answers too (a probe on a wrong port or path would never be Ready or live).
        for prober in (boot, main):
            prober.wait(lambda p: any(r.ok for r in p.results["liveness"]), prober.budget(),
                        "a successful liveness probe")


def test_readiness_reports_an_obstructed_cdi_path_and_recovers_without_restart(running: Cluster) -> None:
    c = running
    assert c.main is not None
    started = c.main.state()["StartedAt"]
    spec = c.cdi_dir / "hyperlight.json"
    _, main = probers(c)
    with main:
        main.wait(lambda p: p.ready, main.budget(), "Ready before the obstruction")
        obstruct(spec)
        try:
            readiness = main.spec("readiness")
            budget = readiness["periodSeconds"] * (readiness.get("failureThreshold", 3) + 2)
            main.wait(lambda p: not p.ready, budget, "NotReady while hyperlight.json is a directory")
            last = main.results["readiness"][-1].detail
            assert last.startswith("503") and "hyperlight.json" in last, last
        finally:
            spec.rmdir()
        main.wait(lambda p: p.ready, main.budget(), "Ready again once the path is clear")
        assert not main.restart_due, main.describe()
    assert c.main.state()["StartedAt"] == started, "the container was restarted"


# --- 5. faults through the runtime --------------------------------------------------------------


def test_sigkill_of_the_main_container_then_restart_re_registers(running: Cluster) -> None:
    c = running
    assert c.main is not None
    spec = c.cdi_dir / "hyperlight.json"
    before = spec.read_bytes()
    registered_at = c.kubelet.resources[HYPERVISOR].registered_at
    podman("kill", "--signal", "KILL", c.main.name)
    c.wait(lambda: not c.kubelet.registered(HYPERVISOR), "the ListAndWatch stream end after SIGKILL")
    assert c.kubelet.allocatable(HYPERVISOR) == 0
    c.start(c.main)  # restartPolicy Always: the kubelet starts the same container again
    c.wait(lambda: c.kubelet.allocatable(HYPERVISOR) > 0
           and c.kubelet.resources[HYPERVISOR].registered_at > registered_at,
           "the restarted main container registered again")
    assert spec.read_bytes() == before, "the CDI spec changed across the restart"


def test_kubelet_restart_both_containers_register_again(running: Cluster) -> None:
    c = running
    calls = c.kubelet.register_calls
    c.loop.call(c.kubelet.restart())  # deletes every socket in the plugin directory
    c.wait(lambda: c.kubelet.allocatable(ACCESS) == ACCESS_SLOTS and c.kubelet.allocatable(HYPERVISOR) > 0,
           "both containers registered with the restarted kubelet")
    assert c.kubelet.register_calls >= calls + 2
    for socket in ("hyperlight.sock", "hyperlight-device-access.sock"):
        assert is_socket(c.plugin_dir / socket), f"{socket} was not recreated"


def test_a_tampered_cdi_spec_is_repaired_by_the_container(running: Cluster) -> None:
    c = running
    spec = c.cdi_dir / "hyperlight.json"
    good = spec.read_bytes()
    spec.write_text('{"cdiVersion": "0.5.0", "kind": "evil.example/x", "devices": []}')
    c.until(lambda: spec.read_bytes() == good, "the daemon's inotify watch to repair the spec", 30)


# --- 6. memory as the kubelet sees it -----------------------------------------------------------


def test_working_set_idle_and_after_load_within_limits(running: Cluster) -> None:
    c = running
    assert c.bootstrap is not None and c.main is not None
    containers = {"device-access": c.bootstrap, "device-plugin": c.main}
    idle = {n: x.working_set() for n, x in containers.items()}
    device_ids = sorted(c.kubelet.resources[HYPERVISOR].devices)

    async def allocates() -> None:
        for i in range(1000):
            await c.kubelet.allocate(HYPERVISOR, [[device_ids[i % len(device_ids)]]])
        for _ in range(100):
            await c.kubelet.allocate(ACCESS, [["device-access-kvm"]])

    c.loop.call(allocates(), 300)
    spec = c.cdi_dir / "hyperlight.json"
    peak = {n: x.working_set() for n, x in containers.items()}
    for _ in range(100):  # 200 health transitions, each seen by the kubelet
        obstruct(spec)
        c.wait(lambda: c.kubelet.allocatable(HYPERVISOR) == 0, "devices Unhealthy (obstructed CDI)")
        spec.rmdir()
        c.wait(lambda: c.kubelet.allocatable(HYPERVISOR) > 0, "devices Healthy again")
        for n, x in containers.items():
            peak[n] = max(peak[n], x.working_set())
    after = {n: x.working_set() for n, x in containers.items()}
    report = {}
    for n, x in containers.items():
        resources = x.spec["resources"]
        request = quantity(resources["requests"]["memory"])
        limit = quantity(resources["limits"]["memory"])
        cgroup = x.memory()
        report[n] = {"working_set_idle_mib": mib(idle[n]), "working_set_after_mib": mib(after[n]),
                     "working_set_peak_mib": mib(peak[n]), "usage_peak_mib": mib(cgroup["peak"]),
                     "anon_after_mib": mib(cgroup["anon"]),
                     "request_mib": mib(request), "limit_mib": mib(limit),
                     "limit_over_peak": round(limit / max(peak[n], cgroup["peak"]), 2)}
        assert x.state()["Status"] == "running", f"{n} is not running (OOM-killed?)"
        assert max(peak[n], cgroup["peak"]) < limit, f"{n}: memory {report[n]} reached its limit"
    print("\nnode working sets:", json.dumps(report, indent=1))
    if os.environ.get("HLPLUGIN_NODE_REPORT"):
        Path(os.environ["HLPLUGIN_NODE_REPORT"]).write_text(json.dumps(report, indent=1))


# --- termination --------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["main", "bootstrap"])
def test_podman_stop_exits_0_within_the_grace_period_and_leaves_no_socket(cluster: Cluster,
                                                                        which: str) -> None:
    c = cluster
    container = c.ensure_main() if which == "main" else c.ensure_bootstrap()
    socket = c.plugin_dir / ("hyperlight.sock" if which == "main" else "hyperlight-device-access.sock")
    assert is_socket(socket)
    began = time.monotonic()
    podman("stop", "--time", str(container.grace), container.name, timeout=container.grace + 30)
    took = time.monotonic() - began
    state = container.state()
    assert state["ExitCode"] == 0, f"exit {state['ExitCode']}: {container.logs()[-2000:]}"
    assert took < container.grace, f"SIGTERM took {took:.1f}s, grace is {container.grace}s"
    assert not socket.exists(), f"{socket} left behind"
