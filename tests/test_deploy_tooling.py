"""The deployment path's tooling (issue 7), offline: the workflows, the static analysers and
shellcheck on all they cover, the scripts, the pinned requirements, and the docs' answers to an
operator's questions. A missing tool skips its test and says which one."""

from __future__ import annotations

import os
import re
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


@pytest.mark.parametrize("script", ["label-nodes.sh", "local-node.sh"])
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
