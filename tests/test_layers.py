"""The tools (emulator, process driver, demo, doctor) sit beside the daemons, never under them:
no daemon module imports ``hlplugin.tools``; only the CLI reaches it, lazily, per subcommand.
The Kubernetes API client (``hlplugin.kubeapi``) is a wing beside the kubelet protocols: the
kubelet side never imports it, and it imports nothing of ours but itself."""

from __future__ import annotations

from pathlib import Path

from support.imports import imported_modules

import hlplugin

PACKAGE = Path(hlplugin.__file__).parent
TOOLS = "hlplugin.tools"
KUBEAPI = "hlplugin.kubeapi"


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


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def api_client_offenders(root: Path) -> list[str]:
    """Imports that break the API client's wing under ``root`` (a tree shaped as the package):
    the kubelet side (deviceplugin/) importing the client, or the client importing any of our
    modules but its own. The kubelet side serves the kubelet while the API server is unreachable
    (issue 41 item 2), so nothing of the client's may be on its path, not even by import."""
    kubelet_side = [(p, name) for p in sorted((root / "deviceplugin").rglob("*.py"))
                    for name in imported_modules(p) if inside(name, KUBEAPI)]
    client_side = [(p, name) for p in sorted((root / "kubeapi").rglob("*.py"))
                   for name in imported_modules(p)
                   if inside(name, "hlplugin") and not inside(name, KUBEAPI)]
    return [f"{p.relative_to(root)}: {name}" for p, name in kubelet_side + client_side]


def test_the_kubelet_side_never_imports_the_api_client() -> None:
    assert len(list((PACKAGE / "kubeapi").glob("*.py"))) >= 5
    assert api_client_offenders(PACKAGE) == []


def test_the_api_client_check_sees_both_directions(tmp_path: Path) -> None:
    for wing, line in (("deviceplugin/kubelet", "from hlplugin.kubeapi import Client\n"),
                       ("kubeapi", "from hlplugin.deviceplugin import files\n")):
        (tmp_path / wing).mkdir(parents=True)
        (tmp_path / wing / "sample.py").write_text(line)
    assert api_client_offenders(tmp_path) == [
        "deviceplugin/kubelet/sample.py: hlplugin.kubeapi",
        "kubeapi/sample.py: hlplugin.deviceplugin"]


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


PROCESS = "hlplugin.deviceplugin.process"
KUBELET_PROTOCOLS = ("hlplugin.deviceplugin.kubelet", "hlplugin.api")


def process_wing_offenders(root: Path) -> list[str]:
    """Imports of a kubelet protocol (the kubelet wing, the generated API) by the process wing
    under ``root`` (a tree shaped as the package): the process serves any daemon, whatever its
    kubelet side speaks, through daemon.KubeletSide (issue 39 item 1)."""
    return [f"{p.relative_to(root)}: {name}"
            for p in sorted((root / "deviceplugin" / "process").rglob("*.py"))
            for name in imported_modules(p) if any(inside(name, k) for k in KUBELET_PROTOCOLS)]


def test_the_process_wing_imports_no_kubelet_protocol() -> None:
    assert len(list((PACKAGE / "deviceplugin" / "process").glob("*.py"))) >= 5
    assert process_wing_offenders(PACKAGE) == []


def test_the_process_wing_check_sees_a_protocol_import(tmp_path: Path) -> None:
    wing = tmp_path / "deviceplugin" / "process"
    wing.mkdir(parents=True)
    (wing / "sample.py").write_text("from hlplugin.deviceplugin.kubelet.lifecycle import X\n"
                                    "from hlplugin.api import deviceplugin_pb2\n")
    assert process_wing_offenders(tmp_path) == [
        "deviceplugin/process/sample.py: hlplugin.deviceplugin.kubelet.lifecycle",
        "deviceplugin/process/sample.py: hlplugin.api"]
