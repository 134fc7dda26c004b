"""The tools (emulator, process driver, demo, doctor) sit beside the daemons, never under them:
no daemon module imports ``hlplugin.tools``; only the CLI reaches it, lazily, per subcommand.
The Kubernetes API client (``hlplugin.kubeapi``) is a wing beside the kubelet protocols: the
kubelet side never imports it, and it imports nothing of ours but itself."""

from __future__ import annotations

import ast
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
            "deviceplugin/kubelet/deviceplugin/lifecycle.py"} <= names, sorted(names)
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
    (wing / "sample.py").write_text("from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import X\n"
                                    "from hlplugin.api import deviceplugin_pb2\n")
    assert process_wing_offenders(tmp_path) == [
        "deviceplugin/process/sample.py: hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle",
        "deviceplugin/process/sample.py: hlplugin.api"]


KUBELET = "hlplugin.deviceplugin.kubelet"
# Each kubelet protocol's wing, and the generated API modules only it may import.
PROTOCOL_WINGS = {
    "deviceplugin": ("hlplugin.api.deviceplugin_pb2", "hlplugin.api.deviceplugin_pb2_grpc"),
    "dra": ("hlplugin.api.dra_", "hlplugin.api.pluginregistration_"),
}


def api_named(path: Path) -> list[str]:
    """imported_modules, with "from hlplugin.api import x" naming hlplugin.api.x."""
    names = [name for name in imported_modules(path) if name != "hlplugin.api"]
    names += [f"hlplugin.api.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ImportFrom) and node.module == "hlplugin.api"
              for alias in node.names]
    return names


def protocol_offenders(root: Path) -> list[str]:
    """Under ``root`` (a tree shaped as the package): a kubelet protocol's wing importing the
    other's modules or the other's API, or a module shared by both (kubelet/*.py) importing
    either wing or any API (issue 39 item 2)."""
    kubelet = root / "deviceplugin" / "kubelet"
    found = []
    for path in sorted(kubelet.rglob("*.py")):
        wing = path.relative_to(kubelet).parts[0] if path.parent != kubelet else ""
        for name in api_named(path):
            others = [w for w in PROTOCOL_WINGS if w != wing]
            if any(inside(name, f"{KUBELET}.{w}") for w in others) or (
                    inside(name, "hlplugin.api") and not any(
                        name.startswith(api) for api in PROTOCOL_WINGS.get(wing, ()))):
                found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_each_kubelet_protocol_has_its_wing_and_neither_imports_the_other() -> None:
    kubelet = PACKAGE / "deviceplugin" / "kubelet"
    assert {"lifecycle.py", "servicer.py"} <= {p.name for p in (kubelet / "deviceplugin").glob("*.py")}
    assert {"pluginwatcher.py", "draservice.py", "checkpoint.py"} <= {
        p.name for p in (kubelet / "dra").glob("*.py")}
    assert protocol_offenders(PACKAGE) == []


def test_the_protocol_check_sees_each_direction(tmp_path: Path) -> None:
    lines = {"deviceplugin": "from hlplugin.deviceplugin.kubelet.dra.writer import SharedWriter\n"
                             "from hlplugin.api import dra_v1_pb2\n",
             "dra": "from hlplugin.deviceplugin.kubelet.deviceplugin import lifecycle\n",
             "": "from hlplugin.deviceplugin.kubelet.dra import draservice\n"
                 "from hlplugin.api import deviceplugin_pb2\n"}
    for wing, text in lines.items():
        folder = tmp_path / "deviceplugin" / "kubelet" / wing
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sample.py").write_text(text)
    assert protocol_offenders(tmp_path) == [
        "deviceplugin/kubelet/deviceplugin/sample.py: hlplugin.deviceplugin.kubelet.dra.writer",
        "deviceplugin/kubelet/deviceplugin/sample.py: hlplugin.api.dra_v1_pb2",
        "deviceplugin/kubelet/dra/sample.py: hlplugin.deviceplugin.kubelet.deviceplugin",
        "deviceplugin/kubelet/sample.py: hlplugin.deviceplugin.kubelet.dra",
        "deviceplugin/kubelet/sample.py: hlplugin.api.deviceplugin_pb2"]


SERVER_BUILDER = Path("deviceplugin") / "kubelet" / "grpcserver.py"


def server_builders(root: Path) -> list[str]:
    """Modules under ``root`` (but the tools, whose emulator plays the kubelet) that build a gRPC
    server themselves: every server of ours is built by grpcserver.bounded_server, the one place
    its bounds (and any guard in front of them) are set."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in {"tools", "api"} or relative == SERVER_BUILDER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "server" and ast.unparse(node.func.value).endswith("aio")):
                found.append(f"{relative}:{node.lineno}")
    return found


def test_every_grpc_server_of_ours_is_built_in_one_place() -> None:
    assert "grpc.aio.server(" in (PACKAGE / SERVER_BUILDER).read_text()
    assert server_builders(PACKAGE) == []


def test_the_builder_check_sees_a_server_built_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "sample.py").write_text("import grpc\nserver = grpc.aio.server(options=[])\n")
    assert server_builders(tmp_path) == ["sample.py:2"]


PUBLISHER = Path("deviceplugin") / "kubelet" / "endpoint.py"
# Calls that bind a gRPC server to an address, or stop one: endpoint.Endpoint's alone, so that
# --frame-guard puts every server of ours behind a guard, and each stops before its guard closes.
SERVER_CALLS = {"add_insecure_port", "add_secure_port", "stop_server"}


def server_binders(root: Path) -> list[str]:
    """Modules under ``root`` (but the tools, whose emulator plays the kubelet) that bind a gRPC
    server or stop one other than through endpoint.Endpoint (serve(), stop())."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in {"tools", "api"} or relative in (PUBLISHER, SERVER_BUILDER):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = getattr(node, "func", None)
            if getattr(called, "attr", getattr(called, "id", None)) in SERVER_CALLS:
                found.append(f"{relative}:{node.lineno}")
    return found


def test_every_grpc_server_of_ours_is_bound_and_stopped_where_the_frame_guard_is_set() -> None:
    text = (PACKAGE / PUBLISHER).read_text()
    assert "add_insecure_port(address)" in text and "FrameGuard(address)" in text
    assert server_binders(PACKAGE) == []


def test_the_binder_check_sees_a_server_bound_or_stopped_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "sample.py").write_text(
        "server.add_insecure_port('unix:///x')\nawait stop_server(server)\n")
    assert server_binders(tmp_path) == ["sample.py:1", "sample.py:2"]
