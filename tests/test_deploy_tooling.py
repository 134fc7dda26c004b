"""The deployment path's tooling (issue 7), offline: the workflows, the static analysers and
shellcheck on all they cover, the scripts, the pinned requirements, and the docs' answers to an
operator's questions. A missing tool skips its test and says which one."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from harness import metric_families, tool
from support.deploy import (
    BOOTSTRAP,
    DEPLOY,
    GITHUB,
    MAIN,
    ROOT,
    WORKFLOWS,
    run,
    steps_of,
    workflow,
)

pytestmark = pytest.mark.deploy


def test_workflows() -> None:
    # Every action pinned to a commit with its version beside it, permissions denied by default
    # and granted per job, no credentials left in a checkout; only the release's image job writes.
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "e2e.yml", "release.yml"}
    writers = set()
    for path in WORKFLOWS:
        wf = workflow(path.name)
        text = path.read_text()
        assert wf.get("permissions") == {}, f"{path.name}: deny by default at the top"
        for job_name, job in wf["jobs"].items():
            assert "permissions" in job, f"{path.name}: {job_name} must say what it needs"
            assert set(job["permissions"].values()) <= {"read", "write", "none"}
            if "write" in job["permissions"].values():
                writers.add((path.name, job_name))
        for step in (s for s in steps_of(wf) if "uses" in s):
            uses = step["uses"]
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", uses), f"{path.name}: {uses}"
            assert re.search(re.escape(uses) + r" # v\d", text), f"{uses}: say which version"
            if uses.startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, path.name
    assert writers == {("release.yml", "image")}

    # ci.yml lints, and runs the README's test command (.ci/run) with KVM.
    ci = workflow("ci.yml")
    assert {job["runs-on"] for job in ci["jobs"].values()} == {"ubuntu-latest"}
    runs = [s.get("run", "") for s in steps_of(ci)]
    assert any(r.strip() == "ruff check ." for r in runs) and "mypy" in runs
    test_runs = [s.get("run", "") for s in ci["jobs"]["test"]["steps"]]
    assert any('KERNEL=="kvm"' in r and "udevadm trigger" in r for r in test_runs)
    assert any(re.search(r"(^|\s)(bash )?\.ci/run\b", r) for r in test_runs)
    assert {"pull_request", "push"} <= set(ci["on"])

    # release.yml pushes on tags, from no shared cache, for amd64 only (the DaemonSets' node
    # selector says so: test_plugin_daemonsets).
    release = workflow("release.yml")
    assert set(release["on"]) == {"push"} and release["on"]["push"]["tags"]
    build = next(s for s in steps_of(release) if s.get("uses", "").startswith("docker/build-push-action@"))
    assert build["with"]["push"] is True and build["with"]["context"] == "."
    assert "cache-from" not in build["with"], "no shared cache in a release"
    assert build["with"].get("platforms", "linux/amd64") == "linux/amd64", (
        "a multi-arch release: widen the kubernetes.io/arch node selector")


# (command run in the repository root, a pattern its stdout must contain: each finds nothing)
ANALYSERS = {
    "hadolint": (["hadolint", "--no-color", "Dockerfile"], r"\A\s*\Z"),
    "workflow-schema": (["check-jsonschema", "--builtin-schema", "vendor.github-workflows",
                         *(str(p.relative_to(ROOT)) for p in WORKFLOWS)], ""),
    "dependabot-schema": (["check-jsonschema", "--builtin-schema", "vendor.dependabot",
                           ".github/dependabot.yml"], ""),
    "zizmor": (["zizmor", "--offline", "--no-progress", ".github"], "No findings"),
    "yamllint": (["yamllint", "--strict", "-c", ".yamllint", "deploy", ".github", ".yamllint"], ""),
}  # fmt: skip


@pytest.mark.parametrize("analyser", ANALYSERS)
def test_static_analyser_finds_nothing(analyser: str) -> None:
    command, stdout = ANALYSERS[analyser]
    result = run([tool(command[0]), *command[1:]], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(stdout, result.stdout), result.stdout + result.stderr


def test_shellcheck_every_shell_script_and_workflow_step(tmp_path: Path) -> None:
    """Every shell script this repository ships or runs, and every workflow `run:` step as bash runs it."""
    shellcheck = tool("shellcheck")
    scripts = {*(ROOT / ".ci").iterdir(), *DEPLOY.rglob("*.sh"), *GITHUB.rglob("*.sh")}
    for path in DEPLOY.rglob("*"):
        first = path.read_bytes()[:128].split(b"\n", 1)[0] if path.is_file() else b""
        if first.startswith(b"#!") and first.endswith((b"/sh", b" sh", b"bash")):
            scripts.add(path)
    assert DEPLOY / "label-nodes.sh" in scripts
    for path in WORKFLOWS:
        for i, step in enumerate(steps_of(workflow(path.name))):
            if "run" in step:
                assert "${{" not in step["run"], f"{path.name}: pass expressions through env"
                script = tmp_path / f"{path.stem}-{i}.sh"
                script.write_text("#!/usr/bin/env bash\nset -eo pipefail\n" + step["run"])
                scripts.add(script)
    # No --shell: a script without a shebang fails (SC2148) rather than being guessed at.
    result = run([shellcheck, "--format=gcc", *map(str, sorted(scripts))])
    assert result.returncode == 0, result.stdout + result.stderr


def test_label_nodes_script(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    fake = tmp_path / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(fake)}
    labels = "hyperlight.dev/enabled=true hyperlight.dev/hypervisor"
    for args, status, calls in [
        ("--hypervisor kvm n1 n2", 0, [f"label nodes n1 n2 {labels}=kvm --overwrite"]),
        ("--hypervisor=mshv --selector pool=hl --dry-run", 0,
         [f"label nodes --selector pool=hl {labels}=mshv --overwrite --dry-run=client"]),
        ("--remove n1", 0, ["label nodes n1 hyperlight.dev/enabled- hyperlight.dev/hypervisor- --overwrite"]),
        ("--hypervisor xen n1", 2, []),
        ("--hypervisor kvm", 2, []),
        ("--hypervisor kvm -l a=b n1", 2, []),
    ]:
        log.write_text("")
        result = run(["bash", str(DEPLOY / "label-nodes.sh"), *args.split()], env=env)
        assert result.returncode == status, f"{args}: {result.stderr}"
        assert log.read_text().splitlines() == calls, args


# A kubectl for deploy/move-node.sh: logs its arguments and answers its reads as a cluster where
# every step has already happened (the driver's pod Ready, the slice there, allocatable 0).
FAKE_KUBECTL = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$*" in
    "get pods -A "*) printf '%b' "${FAKE_PODS:-}" ;;
    *"-o jsonpath={range .items[*]}{.status.conditions"*) echo True ;;
    *"get resourceslices"*) echo resourceslice.resource.k8s.io/n1-hyperlight.dev-abcde ;;
    *".status.allocatable."*) printf '%s' "${FAKE_ALLOCATABLE:-0}" ;;
esac
"""


def test_move_node_script(tmp_path: Path) -> None:
    """deploy/move-node.sh: its arguments, the pods that stop it (held the way the node leaves),
    what a dry run changes (nothing: it only reads), and a whole move against a kubectl that
    answers as a cluster where each wait is already met."""
    log, fake = tmp_path / "calls", tmp_path / "kubectl"
    fake.write_text(FAKE_KUBECTL)
    fake.chmod(0o755)

    def move(args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        log.write_text("")
        result = run(["bash", str(DEPLOY / "move-node.sh"), *args.split()],
                     env={**os.environ, "KUBECTL": str(fake), "FAKE_LOG": str(log), **env})
        return result, [" ".join(c.split()[:2]) for c in log.read_text().splitlines()]

    for args in ("--to dra", "--to xen n1", "n1", "--to dra n1 n2", "--to dra --timeout 5m n1",
                 "--to dra --bogus n1", "--to"):
        result, calls = move(args)
        assert result.returncode == 2 and "deploy/move-node.sh" in result.stderr, args
        assert calls == [], args

    result, calls = move("--to dra n1 --dry-run")
    assert result.returncode == 0, result.stderr
    assert set(calls) == {"get node", "get pods"}, calls  # reads only
    for change in ("cordon n1", "label node n1 hyperlight.dev/dra=moving --overwrite",
                   "label node n1 hyperlight.dev/dra=true --overwrite", "uncordon n1"):
        assert f"would run: {fake} {change}" in result.stdout, change
    result, _ = move("--to device-plugin n1 --dry-run")
    assert f"would run: {fake} label node n1 hyperlight.dev/dra-" in result.stdout

    # app/vm-1 asks the resource with no claim: the device plugin's; app/vm-2 has the scheduler's
    # claim: the driver's; the chart's own pods never count. To the driver, the device plugin's
    # pods are listed and kept (they keep their device, and the driver's pods are admitted beside
    # them: tests/test_cluster_migrate.py); back, the driver's stop the move unless --keep-pods
    # (ended without the driver, each stays Terminating).
    pods = r"app/vm-1|1| \napp/vm-2|2|vm-2-extended-resources-x \nhyperlight-system/hyperlight-dra-1||a \n"
    result, _ = move("--to dra n1 --dry-run", FAKE_PODS=pods)
    assert result.returncode == 0 and "app/vm-1" in result.stdout and "app/vm-2" not in result.stdout
    assert "would run: " + f"{fake} uncordon n1" in result.stdout
    result, _ = move("--to device-plugin n1 --dry-run", FAKE_PODS=pods)
    assert result.returncode == 1 and "app/vm-2" in result.stderr and "app/vm-1" not in result.stderr
    assert "hyperlight-dra-1" not in result.stderr
    result, _ = move("--to device-plugin n1 --dry-run --keep-pods", FAKE_PODS=pods)
    assert result.returncode == 0 and "app/vm-2" in result.stdout and "stays Terminating" in result.stdout
    assert "capacity" not in result.stdout, "no wait for the kubelet's 5 minutes"

    result, calls = move("--to dra n1 --timeout 1")
    assert result.returncode == 0, result.stdout + result.stderr
    # No pod starting, none held; labelled moving, the device plugin's pod gone, labelled for the
    # driver, its pod Ready, its slice, allocatable 0.
    daemons = "-n hyperlight-system"
    assert calls == ["get node", "cordon n1", "get pods", "get pods", "label node", daemons, "label node",
                     daemons, "get resourceslices", "get node", "uncordon n1"], calls
    # Back to the device plugin, where allocatable never rises: the move stops, the node cordoned.
    result, calls = move("--to device-plugin n1 --timeout 1")
    assert result.returncode == 1 and "n1 is left cordoned" in result.stderr, result.stderr
    assert "uncordon n1" not in calls


@pytest.mark.parametrize("script", ["label-nodes.sh", "local-node.sh", "move-node.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_script_s_help_exits_0_on_stdout(script: str, flag: str) -> None:
    """Asked for, help is an answer (stdout, exit 0); a usage error stays exit 2 on stderr."""
    result = run(["bash", str(DEPLOY / script), flag])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and not result.stderr
    assert f"deploy/{script}" in result.stdout
    wrong = run(["bash", str(DEPLOY / script), "--no-such-option"])
    assert wrong.returncode == 2 and f"deploy/{script}" in wrong.stderr and not wrong.stdout


OPERATOR_QUESTIONS = {
    "architecture.md": (BOOTSTRAP, MAIN, "Allocate", "CDI", "repair"),
    "operations.md": ("kubectl apply -k deploy/overlays/", "label-nodes.sh", "Upgrade", "Rollback", "/readyz",
                      "DEVICE_COUNT", "## Monitoring", "## Probes and restarts", *metric_families()),
    "security.md": ("hyperlight.dev/device-access", "ValidatingAdmissionPolicy", "ResourceQuota",
                    "every capability dropped", "root-owned"),
}


def test_docs_cover_the_operators_questions() -> None:
    for doc, needles in OPERATOR_QUESTIONS.items():
        text = (ROOT / "docs" / doc).read_text()
        for needle in needles:
            assert needle in text, f"docs/{doc}: {needle}"


def test_requirements_are_pinned() -> None:
    lines = (ROOT / "requirements-deploy-checks.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", p) for p in pins), pins
