"""`helm test` (issue 19): a pod that proves a node serves Hyperlight, locked down, asking one slot,
admitted by the chart's own admission policy, and whose command passes on a working device and
fails without one; the docs name what it runs. helm comes from .ci/run; without it these skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import tool
from support.chart import (
    CHART,
    MAIN,
    README,
    ROOT,
    TEST_POD,
    TOGGLES,
    container,
    daemonsets,
    env,
    hook_pod,
    hooks,
    pod,
    render,
    section,
)
from support.deploy import NAMESPACE, env_of, mib, millicores, restricted_violations

from hlplugin import config

pytestmark = pytest.mark.deploy


# Peak RSS of `hlplugin doctor --device-only` (VmHWM, this machine's venv, KVM, guest run): MiB.
MEASURED_TEST_PEAK_MIB = 38


def test_helm_test_pod_is_a_locked_down_workload_asking_one_slot() -> None:
    """What `helm test` runs is a workload like any other: one hyperlight.dev/hypervisor, no
    device-access, the Restricted Pod Security Standard (non-root, no capability, read-only root,
    RuntimeDefault seccomp), bounded resources, no network, deleted once it passed and before
    the next run; on the DaemonSets' nodes, with their image and pull policy."""
    values = {"image": {"tag": "i29", "pullPolicy": "Always"}, "imagePullSecrets": [{"name": "regcred"}],
              "config": {"hypervisor": "kvm", "probeTimeout": "500ms"}}
    for objs in (render(), render(values), render(TOGGLES)):
        hook = hook_pod(objs)
        meta, spec = hook["metadata"], hook["spec"]
        assert meta["name"] == TEST_POD and meta["namespace"] == NAMESPACE
        assert meta["annotations"]["helm.sh/hook"] == "test"
        assert set(meta["annotations"]["helm.sh/hook-delete-policy"].split(",")) == {
            "hook-succeeded", "before-hook-creation"}
        assert restricted_violations(spec) == []
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault"
        res = c["resources"]
        for kind in ("requests", "limits"):
            assert res[kind]["hyperlight.dev/hypervisor"] == "1"
            assert "hyperlight.dev/device-access" not in res[kind]
            assert {"cpu", "memory"} <= set(res[kind])
        assert millicores(res["requests"]["cpu"]) <= millicores(res["limits"]["cpu"])
        assert MEASURED_TEST_PEAK_MIB <= mib(res["requests"]["memory"]) <= mib(res["limits"]["memory"])
        assert mib(res["limits"]["memory"]) >= 1.5 * MEASURED_TEST_PEAK_MIB
        plugin = daemonsets(objs)[MAIN]
        for key in ("image", "imagePullPolicy"):
            assert c[key] == container(plugin)[key], key
        for key in ("nodeSelector", "tolerations", "imagePullSecrets", "affinity"):
            assert spec.get(key) == pod(plugin).get(key), key
        # The daemons' settings that shape the verdict, as the main daemon has them.
        for var, text in env_of(c).items():
            assert env(plugin)[var] == text, var
        # No network: the policy created with it (first, by weight) selects it and allows nothing.
        (policy,) = [o for o in hooks(objs) if o["kind"] == "NetworkPolicy"]
        assert int(policy["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
            meta["annotations"].get("helm.sh/hook-weight", "0"))
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= meta["labels"].items()
        assert policy["spec"]["ingress"] == policy["spec"]["egress"] == []
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert hook_pod(render(values))["spec"]["containers"][0]["imagePullPolicy"] == "Always"


def test_helm_test_pod_is_admitted_by_the_chart_s_admission_policy() -> None:
    from support.admission import admit, defaulted

    objs = render()
    (policy,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    assert admit(policy, defaulted(hook_pod(objs))) is True  # it applies, and admits


def hook_command(tmp: Path, dev: Path) -> tuple[list[str], dict[str, str]]:
    """The hook container's command line and environment, run here: the image's entrypoint is
    the console script; only the device directory differs (the container's /dev is the node's)."""
    c = hook_pod(render())["spec"]["containers"][0]
    environ = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp),
               **env_of(c), config.OPTIONS["dev_dir"].env or "": str(dev)}
    return [sys.executable, "-m", "hlplugin", *c["args"]], environ


@pytest.mark.skipif(not (os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)),
                    reason="needs a usable /dev/kvm")
def test_helm_test_command_passes_on_a_working_device_and_fails_without_one(tmp_path: Path) -> None:
    """The hook's own command and settings give the verdict: exit 0 with a VM created and a guest
    run through a device node as the CDI spec makes it, exit 1 (saying why) where the container
    got no device, as a pod admitted without the slot would."""
    dev = tmp_path / "dev"
    dev.mkdir()
    if os.geteuid() == 0:  # the node as the runtime creates it: mode 0666, owned by DEVICE_UID
        from harness import mknod_char

        kvm = mknod_char(dev / "kvm", os.stat("/dev/kvm").st_rdev)
        os.chmod(kvm, 0o666)
    else:
        (dev / "kvm").symlink_to("/dev/kvm")
    argv, environ = hook_command(tmp_path, dev)
    ok = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "VM creation      OK" in ok.stdout and "guest run        OK" in ok.stdout, ok.stdout
    assert "verdict: OK" in ok.stdout
    (dev / "kvm").unlink()
    bad = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and "verdict: FAIL" in bad.stdout, bad.stdout + bad.stderr


def test_docs_of_helm_test_name_what_the_hook_runs() -> None:
    hook = hook_pod(render())
    (c,) = hook["spec"]["containers"]
    command = " ".join(["hlplugin", *c["args"]])
    readme, operations = README.read_text(), (ROOT / "docs/operations.md").read_text()
    for text in (" ".join(section(readme, "## Test\n").split()), " ".join(operations.split())):
        assert "helm test hlplugin -n hyperlight-system --logs" in text
        assert f"`{hook['metadata']['name']}`" in text and f"`{command}`" in text
        assert f"UID {hook['spec']['securityContext']['runAsUser']}" in text
    assert "helm test hlplugin -n hyperlight-system --logs" in section((ROOT / "README.md").read_text(),
                                                                      "## Deploy\n")
    # What helm install prints after installing (NOTES.txt) says it too, for the release's name.
    dry = subprocess.run([tool("helm"), "install", "--dry-run=client", "my-hl", str(CHART), "-n", NAMESPACE],
                         capture_output=True, text=True, timeout=100, check=False)
    assert dry.returncode == 0, dry.stderr
    notes = dry.stdout[dry.stdout.index("NOTES:"):]
    assert f"helm test my-hl -n {NAMESPACE} --logs" in notes, notes
