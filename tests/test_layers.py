"""The tools (emulator, process driver, demo, doctor) sit beside the daemons, never under them:
no daemon module imports ``hlplugin.tools``; only the CLI reaches it, lazily, per subcommand."""

from __future__ import annotations

from pathlib import Path

from support.imports import imported_modules

import hlplugin

PACKAGE = Path(hlplugin.__file__).parent
TOOLS = "hlplugin.tools"


def daemon_modules() -> list[Path]:
    """Every module of the package but the tools and the CLI that dispatches to them."""
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if PACKAGE / "tools" not in p.parents and p.name not in {"cli.py", "__main__.py"})


def test_no_daemon_module_imports_the_tools() -> None:
    modules = daemon_modules()
    names = {p.relative_to(PACKAGE).as_posix() for p in modules}
    assert {"plugin.py", "bootstrap.py", "cdi.py", "health.py", "probe.py",
            "deviceplugin/kubelet/lifecycle.py"} <= names, sorted(names)
    offenders = {f"{p.relative_to(PACKAGE)}: {name}" for p in modules for name in imported_modules(p)
                 if name == TOOLS or name.startswith(TOOLS + ".")}
    assert not offenders, sorted(offenders)


def test_the_tools_are_where_the_architecture_map_says() -> None:
    tools = {p.stem for p in (PACKAGE / "tools").glob("*.py")} - {"__init__"}
    assert {"emulator", "process", "demo", "doctor"} <= tools, tools
    assert not [p for p in PACKAGE.glob("*.py") if p.stem in tools], "a tool left at the top level"
    architecture = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    for tool in sorted(tools):
        assert f"tools/{tool}.py" in architecture, tool


def test_the_check_sees_an_import_of_the_tools(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from hlplugin.tools.emulator import KubeletEmulator\nfrom hlplugin import tools\n")
    assert {"hlplugin.tools.emulator", "hlplugin.tools"} <= set(imported_modules(sample))


MAX_LINES = 400


def test_no_hand_written_module_is_over_400_lines() -> None:
    """New functionality goes into a module of its own (the generated gRPC code is exempt)."""
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if PACKAGE / "api" not in p.parents
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/support (or the harness), so each test module runs alone
    and a move of one test never breaks another module's imports."""
    tests = Path(__file__).parent
    modules = {p.stem for p in tests.glob("test_*.py")}
    offenders = {p.name: sorted(set(imported_modules(p)) & modules) for p in tests.rglob("*.py")}
    assert {name: found for name, found in offenders.items() if found} == {}
