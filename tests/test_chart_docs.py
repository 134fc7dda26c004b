"""The docs of the chart tell the truth: the README leads with the image and `helm install`, the
recipes use a venv, and the namespace, reboot and uninstall are described as they work."""

from __future__ import annotations

import re

import pytest
from support.chart import APP_VERSION, README, ROOT, daemon_default, render, section
from support.deploy import NAMESPACE

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS

pytestmark = pytest.mark.deploy


# --- the docs: where the image comes from, Helm first, the recipes --------------------------------


def test_readme_deploy_leads_with_the_image_and_helm_install() -> None:
    deploy = section((ROOT / "README.md").read_text(), "## Deploy\n")
    image, helm_install, kustomize_apply = (deploy.index("ghcr.io/hyperlight-dev/hlplugin"),
                                            deploy.index("helm install"), deploy.index("kubectl apply -k"))
    assert image < helm_install < kustomize_apply, "the image, then helm install, kustomize beside it"
    assert deploy.index("```") > image, "the image story comes before any command"
    for needle in ("oci://ghcr.io/hyperlight-dev/charts/hlplugin", "--create-namespace",
                   "deploy/local-node.sh build", "podman push", "--set image.repository=",
                   "--set image.tag=", "newName:", f"--version {APP_VERSION}"):
        assert needle in deploy, needle


def test_local_node_recipe_uses_a_venv() -> None:
    recipe = section((ROOT / "README.md").read_text(), "## Run the whole node locally")
    commands = re.search(r"```sh\n(.*?)```", recipe, re.S)
    assert commands
    lines = [line.split("#")[0].strip() for line in commands.group(1).splitlines()]
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'" in lines
    assert not [line for line in lines if re.match(r"(sudo )?pip3? ", line)], "no pip into the system Python"
    assert "sudo deploy/local-node.sh test" in lines
    script = (ROOT / "deploy/local-node.sh").read_text()
    assert '"$repo/.venv/bin/python"' in script and "${PYTHON:-}" in script


def test_operations_names_paths_device_plugins_not_root_dir() -> None:
    operations = (ROOT / "docs/operations.md").read_text()
    assert "paths.devicePlugins" in operations
    assert not re.search(r"non-default `--root-dir` needs", operations)
    assert "?ref=<commit SHA>" in operations and "helm install" in operations


# --- the docs of the namespace, helm test, reboot and uninstall -----------------------------------


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_readme_gives_the_namespace_ways_that_work() -> None:
    """The chart's README no longer says to install with namespace.create=true and without
    --create-namespace (helm writes its release record into the namespace first: that fails); it
    gives both ways that work, with commands Helm accepts, and says what helm uninstall does to
    the namespace in each. The rendering agrees: the chart's Namespace is the release namespace
    and carries no keep policy, so helm uninstall deletes it."""
    text = section(README.read_text(), "## The namespace\n")
    prose = " ".join(text.split())
    assert "(then without `--create-namespace`)" not in " ".join(README.read_text().split())
    assert 'namespaces "hyperlight-system" not found' in prose
    commands = [" ".join(line.split("#")[0].replace("\\", " ").split())
                for block in sh_blocks(text) for line in re.sub(r"\\\n", " ", block).splitlines()]
    installs = [c for c in commands if c.startswith("helm install")]
    plain = [c for c in installs if "namespace.create=true" not in c]
    owned = [c for c in installs if "namespace.create=true" in c]
    assert any("--create-namespace" in c for c in plain), installs
    assert any("--create-namespace" in c for c in owned), "Helm 4's way"
    assert any("--take-ownership" in c for c in owned), "an existing namespace, adopted"
    assert all(f"-n {NAMESPACE}" in c for c in installs), installs
    # Helm's ownership metadata by hand: the keys and values Helm checks for this release.
    assert f"kubectl create namespace {NAMESPACE}" in commands
    assert f"kubectl label namespace {NAMESPACE} app.kubernetes.io/managed-by=Helm" in commands
    assert (f"kubectl annotate namespace {NAMESPACE} meta.helm.sh/release-name=hlplugin "
            f"meta.helm.sh/release-namespace={NAMESPACE}") in commands
    assert "pod-security.kubernetes.io/enforce=privileged" in " ".join(commands)
    assert "`helm uninstall` leaves it" in prose and "`helm uninstall` deletes it" in prose
    (namespace,) = [o for o in render({"namespace": {"create": True}}) if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NAMESPACE
    assert "helm.sh/resource-policy" not in namespace["metadata"].get("annotations", {})
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_operations_says_what_stays_after_a_reboot_and_after_uninstall() -> None:
    """The cleanup of workload pods that failed admission after a reboot deletes exactly those:
    phase Failed, the reason the same section quotes; after helm uninstall, the capacity kubectl
    shows for the kubelet's grace, then 0, and the CDI spec left on the node."""
    operations = (ROOT / "docs/operations.md").read_text()
    reboot = section(operations, "## After a node reboot")
    prose = " ".join(reboot.split())
    (cleanup,) = [b for b in sh_blocks(reboot) if "delete pod" in b]
    assert "--field-selector=status.phase=Failed" in cleanup
    (reason,) = re.findall(r'@\.status\.reason=="(\w+)"', cleanup)
    assert f"status `{reason}`" in prose and reason == "UnexpectedAdmissionError"
    assert "ReplicaSet" in prose and "spec.nodeName=<node>" in prose
    uninstall = operations[operations.index("To uninstall"):]
    uninstall = " ".join(uninstall[: uninstall.index("\n## ")].split())
    count = daemon_default("device_count")
    for needle in (f"`hyperlight.dev/hypervisor: {count // 1000}k`",
                   f"`hyperlight.dev/device-access: {ACCESS_SLOTS}`", "5 minutes", "show 0 for good",
                   "`/var/run/cdi/hyperlight.json` stays", "`namespace.create=true`"):
        assert needle in uninstall, needle
