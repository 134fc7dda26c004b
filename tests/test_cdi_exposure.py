"""A CDI directory others can write (issue 30 #5): the main daemon says so (a warning at start and on
change, /readyz ``warnings`` without failing, ``hyperlight_cdi_dir_exposed``) and ``hlplugin
doctor`` names the fix, for the directory, its parent, and /etc/cdi."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Node, needs_kvm, needs_root, on_kubelet, scrape, value, wait_until

from hlplugin import cdi
from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import render_spec
from hlplugin.cli import main
from hlplugin.deviceplugin.health.producer import Trigger
from hlplugin.dirs import exposure
from hlplugin.metrics import Metrics
from hlplugin.names import HYPERVISOR_RESOURCE
from hlplugin.settings import CdiSettings

OTHER_UID = 4242


def test_group_or_others_writing_or_another_owner_is_exposure_with_its_fix(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    assert exposure(cdi_dir, os.geteuid()) == {cdi_dir: "", tmp_path: ""}
    os.chmod(cdi_dir, 0o777)
    found = exposure(cdi_dir, os.geteuid())
    assert found[cdi_dir] == (
        f"{cdi_dir}, the CDI directory, is writable by group and others (mode 0777): others could "
        f"add a spec that injects devices into containers, or replace ours (fix: chmod 755 {cdi_dir})")
    assert found[tmp_path] == ""
    # The parent: writable by its group; with the sticky bit others cannot replace what is not theirs.
    os.chmod(cdi_dir, 0o755)
    os.chmod(tmp_path, 0o775)
    assert exposure(cdi_dir, os.geteuid())[tmp_path] == (
        f"{tmp_path}, the CDI directory's parent, is writable by group (mode 0775): others could "
        f"replace the CDI directory (fix: chmod 755 {tmp_path})")
    os.chmod(tmp_path, 0o1777)
    assert exposure(cdi_dir, os.geteuid())[tmp_path] == ""
    # Symlinks resolved: the directory a runtime reads is the one judged (/var/run is /run).
    os.chmod(tmp_path, 0o755)
    os.chmod(cdi_dir, 0o757)
    link = tmp_path / "link"
    link.symlink_to(cdi_dir)
    assert "writable by others (mode 0757)" in exposure(link, os.geteuid())[cdi_dir]
    # Missing: nothing to judge but its parent (the daemon creates it 0755).
    assert exposure(tmp_path / "none", os.geteuid()) == {tmp_path: ""}
    os.chmod(tmp_path, 0o700)


@needs_root
def test_a_directory_owned_by_another_user_than_root_is_exposure(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir(mode=0o755)
    os.chown(cdi_dir, OTHER_UID, -1)
    problem = exposure(cdi_dir)[cdi_dir]
    assert f"is owned by uid {OTHER_UID}, not root" in problem and f"chown root {cdi_dir}" in problem
    os.chmod(cdi_dir, 0o775)
    assert exposure(cdi_dir)[cdi_dir].endswith(f"(fix: chmod 755 {cdi_dir}, chown root {cdi_dir})")


@pytest.fixture
def cdi_records() -> Iterator[list[logging.LogRecord]]:
    captured: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = captured.append  # type: ignore[method-assign]
    logger = logging.getLogger(cdi.__name__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)  # setLevel: it clears the loggers' isEnabledFor cache
    try:
        yield captured
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_each_pass_says_how_the_directory_is_exposed_when_that_changes(
        tmp_path: Path, cdi_records: list[logging.LogRecord]) -> None:
    """At the first pass, and at a pass that finds it otherwise: a warning (a line when it ends);
    the gauge and the warnings list at every pass; the spec is kept all along."""
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir(mode=0o777)
    os.chmod(cdi_dir, 0o777)  # whatever the umask
    metrics, warnings = Metrics(), ["stale"]
    rec = CdiReconciler(CdiSettings(cdi_dir, interval=3600), render_spec("kvm", 65534, 65534),
                        metrics=metrics.proofs, warnings=warnings)

    def exposed() -> float | None:
        return metrics.registry.get_sample_value("hyperlight_cdi_dir_exposed",
                                                 {"directory": str(cdi_dir)})

    def lines() -> list[str]:
        return [r.getMessage() for r in cdi_records if "exposed" in r.getMessage()
                or "(mode 0" in r.getMessage()]

    assert (await rec.reconcile(Trigger.START)).ok
    assert exposed() == 1 and len(warnings) == 1 and "writable by group and others" in warnings[0]
    assert lines() == warnings and cdi_records[-1].levelno == logging.WARNING
    assert (await rec.reconcile(Trigger.PERIODIC)).ok  # the same: no new line
    assert len(lines()) == 1
    os.chmod(cdi_dir, 0o755)
    await rec.reconcile(Trigger.PERIODIC)
    assert exposed() == 0 and warnings == []
    assert lines()[-1] == f"{cdi_dir} is no longer exposed to others than root"
    os.chmod(cdi_dir, 0o775)  # a new problem: its own line at once
    await rec.reconcile(Trigger.WATCH)
    assert exposed() == 1 and "writable by group (mode 0775)" in lines()[-1] == warnings[0]
    parent = metrics.registry.get_sample_value("hyperlight_cdi_dir_exposed",
                                               {"directory": str(tmp_path)})
    assert parent == (1 if os.stat(tmp_path).st_mode & 0o022 else 0)


def run_doctor(argv: list[str]) -> dict[str, Any]:
    """`hlplugin doctor --json ARGV` in-process: its checks by name; the root logger put back."""
    out, root = io.StringIO(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out):
            main(["doctor", "--json", *argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return {c["name"]: c for c in json.loads(out.getvalue())["checks"]}


def test_doctor_names_the_exposure_and_its_fix_and_looks_at_etc_cdi(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    node.cdi_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(node.cdi_dir, 0o755)
    argv = node.serve_args()[1:]
    clean = run_doctor(argv)["CDI dir access"]
    etc = Path(os.path.realpath("/etc/cdi"))
    etc_looked = str(etc if etc.is_dir() else etc.parent)
    if any(exposure(Path("/etc/cdi"), os.geteuid()).values()):
        pytest.skip("this machine's /etc/cdi is itself exposed")
    assert clean["status"] == "ok", clean
    assert f"{node.cdi_dir}, {tmp_path}" in clean["detail"] and etc_looked in clean["detail"]
    os.chmod(node.cdi_dir, 0o777)
    exposed = run_doctor(argv)["CDI dir access"]
    assert exposed["status"] == "warn"
    assert f"{node.cdi_dir}, the CDI directory, is writable by group and others (mode 0777)" in \
        exposed["detail"] and f"(fix: chmod 755 {node.cdi_dir})" in exposed["detail"]


@needs_kvm
async def test_the_main_daemon_warns_at_start_and_on_change_and_stays_ready(tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    node.cdi_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(node.cdi_dir, 0o777)
    directory = {"directory": str(node.cdi_dir)}
    async with on_kubelet(node, node.serve_args("--device-count", "2")) as (kubelet, proc):
        await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR_RESOURCE) == 2)
        ready = json.loads(await proc.wait_http("/readyz", 200))  # a note, not a failure
        [warning] = ready["warnings"]
        assert "writable by group and others (mode 0777)" in warning
        assert warning in proc.messages()
        assert value(await scrape(proc), "hyperlight_cdi_dir_exposed", **directory) == 1
        # Fixed: inotify sees the directory's change; the next pass says so.
        os.chmod(node.cdi_dir, 0o755)

        async def cleared() -> bool:
            return json.loads((await proc.get("/readyz"))[1])["warnings"] == []

        await wait_until(cleared, what="the warning gone from /readyz")
        assert value(await scrape(proc), "hyperlight_cdi_dir_exposed", **directory) == 0
        assert f"{node.cdi_dir} is no longer exposed to others than root" in proc.messages()
