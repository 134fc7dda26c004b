"""The generic device-plugin package imports nothing Hyperlight-specific: only itself, the
generated device-plugin API and third-party or standard modules."""

from __future__ import annotations

import re
from pathlib import Path

from support.imports import imported_modules

import hlplugin.deviceplugin

ALLOWED = ("hlplugin.deviceplugin", "hlplugin.api")
GENERIC = Path(hlplugin.deviceplugin.__file__).parent
# The wings, lowest first: each imports only those before it, and the package root's modules.
WINGS = ("health", "kubelet", "process")


def generic_files() -> list[Path]:
    return sorted(GENERIC.rglob("*.py"))


def wing_of(module: str) -> int:
    """-1 for the package root's modules, else the wing's place in WINGS."""
    parts = module.removeprefix("hlplugin.deviceplugin").strip(".").split(".")
    return WINGS.index(parts[0]) if parts[0] in WINGS else -1


def test_generic_package_imports_nothing_hyperlight_specific() -> None:
    files = generic_files()
    assert len(files) >= 8, files
    offenders = {
        f"{path.relative_to(GENERIC)}: {name}"
        for path in files for name in imported_modules(path)
        if (name == "hlplugin" or name.startswith("hlplugin."))
        and not any(name == a or name.startswith(a + ".") for a in ALLOWED)
    }
    assert not offenders, sorted(offenders)


def test_the_check_sees_a_hyperlight_import(tmp_path: Path) -> None:
    """The walk catches both spellings, so the test above cannot pass by missing them."""
    sample = tmp_path / "sample.py"
    sample.write_text("from hlplugin import cdi\nimport hlplugin.probe\n")
    assert set(imported_modules(sample)) >= {"hlplugin.cdi", "hlplugin.probe"}


FORBIDDEN = re.compile(r"hyperlight|hlplugin|\bcdi\b|kvm|mshv", re.IGNORECASE)


def names_outside_imports(path: Path) -> list[str]:
    """Lines of ``path`` (code, strings, comments, docstrings) naming Hyperlight, CDI, KVM or
    this project, import lines aside."""
    return [f"{path.name}:{number}: {line.strip()}"
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if FORBIDDEN.search(line) and not re.match(r"\s*(from \S+ )?import ", line)]


def test_generic_package_names_nothing_hyperlight_specific() -> None:
    files = generic_files()
    offenders = [hit for path in files for hit in names_outside_imports(path)]
    assert not offenders, offenders


def test_the_name_check_sees_a_comment_and_a_string(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from hlplugin.api import x\n# keeps the CDI spec\nNAME = 'hlplugin-probe'\n"
                      "PATH = '/dev/kvm'\n")
    assert len(names_outside_imports(sample)) == 3


def test_generic_package_names_none_of_our_flags(tmp_path: Path) -> None:
    """Operator hints are injected (PluginLifecycle's ``dir_setting``), so the generic package
    names none of our command-line flags, while the daemons' messages still name them."""
    from hlplugin.config import OPTIONS
    from hlplugin.deviceplugin.kubelet.deviceplugin.kubeletsock import dir_problem, kubelet_problem

    flags = re.compile("|".join(re.escape(o.flag) + r"\b" for o in OPTIONS.values()))
    files = generic_files()
    offenders = [f"{path.name}:{n}: {line.strip()}" for path in files
                 for n, line in enumerate(path.read_text().splitlines(), 1) if flags.search(line)]
    assert not offenders, offenders
    missing = tmp_path / "missing"
    assert dir_problem(missing, "--plugin-dir") == (
        f"{missing} does not exist (is --plugin-dir the kubelet's device-plugins directory?)")
    tmp_path.joinpath("dir").mkdir()
    assert kubelet_problem(tmp_path / "dir" / "kubelet.sock", "--plugin-dir") == (
        f"no kubelet.sock at {tmp_path / 'dir' / 'kubelet.sock'} (is the kubelet running, and is "
        "--plugin-dir its device-plugins directory?)")


def test_each_wing_imports_only_the_wings_below_it() -> None:
    """health < kubelet < process, and the root modules import no wing: no arrow points up."""
    files = generic_files()
    assert {p.parent.name for p in files} >= set(WINGS), files
    upward = []
    for path in files:
        here = wing_of(".".join(path.relative_to(GENERIC).with_suffix("").parts))
        for name in imported_modules(path):
            if name.startswith("hlplugin.deviceplugin.") and wing_of(name) > here:
                upward.append(f"{path.relative_to(GENERIC)}: {name}")
    assert not upward, upward


def test_the_wing_check_sees_an_upward_import() -> None:
    assert wing_of("hlplugin.deviceplugin.process.daemon") > wing_of("health.conditions")
    assert wing_of("hlplugin.deviceplugin.files") == -1 < wing_of("hlplugin.deviceplugin.health.watch")
