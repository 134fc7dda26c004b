"""Each daemon imports only what it needs before it registers (fitness tests, in a fresh
interpreter each): the bootstrap has no prober, CDI or device-health code; neither daemon loads
the tooling (emulator, demo, doctor) or prometheus_client's exposition code before a scrape."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from harness import short_dir

TOOLING = ("tools", "emulator", "demo", "doctor")
# prometheus_client's exposition module and what it alone pulls in.
EXPOSITION = ("prometheus_client.exposition", "http.server", "wsgiref")
MAIN_ONLY = ("hlplugin.probe", "hlplugin.cdi", "hlplugin.cdi_spec", "hlplugin.health")
# What neither daemon uses before it registers: h11 parses the first HTTP request (the package is
# there, its code not run: its submodules load with it); the rest serve a subcommand or an error
# path (difflib: `hlplugin cdi --check`'s difference), or were stand-ins for a call of os.
LATER = ("h11._connection", "h11._events", "difflib", "secrets", "hashlib", "platform",
         "prometheus_client.platform_collector")
# What only the main daemon uses before it registers, beyond MAIN_ONLY: the CDI file's writer.
MAIN_BEFORE_REGISTER = ("hlplugin.deviceplugin.ownedfile",)


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(result.stdout.splitlines()[-1]))


def offenders(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """Modules that are one of ``names`` or inside one, or an hlplugin module named like one."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names)
                  or (m.startswith("hlplugin.") and set(m.split(".")) & set(TOOLING)))


def test_the_bootstrap_loads_no_prober_cdi_health_tooling_or_exposition() -> None:
    modules = loaded_after("import hlplugin.bootstrap")
    assert "hlplugin.bootstrap" in modules and "prometheus_client.metrics" in modules
    assert not offenders(modules, MAIN_ONLY + EXPOSITION)


def test_the_main_daemon_loads_no_tooling_or_exposition() -> None:
    modules = loaded_after("import hlplugin.plugin")
    assert {"hlplugin.plugin", *MAIN_ONLY} <= modules, sorted(set(MAIN_ONLY) - modules)
    assert not offenders(modules, EXPOSITION)


@pytest.mark.parametrize("daemon", ["bootstrap", "plugin"])
def test_a_daemon_start_loads_nothing_it_uses_later(daemon: str) -> None:
    """What the command line and either daemon import before Register (the start, as
    `hlplugin serve|bootstrap` runs it); the bootstrap not even the CDI writer."""
    modules = loaded_after(f"import hlplugin.cli, hlplugin.{daemon}")
    assert "h11" in modules  # there for the HTTP server, waiting for its first use
    later = LATER + (MAIN_ONLY + MAIN_BEFORE_REGISTER if daemon == "bootstrap" else ())
    assert not offenders(modules, later)


def test_the_api_client_loads_only_itself_h11_and_the_standard_library() -> None:
    """What `import hlplugin.kubeapi` costs a node (docs/dra.md, "Client") holds only while it
    pulls in no third-party package but h11 and none of the daemons' modules (beyond the
    package's own start, which every daemon pays)."""
    modules = loaded_after("import hlplugin.kubeapi") - loaded_after("import hlplugin")
    third_party = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"hlplugin"}
    assert third_party == {"h11"}, sorted(third_party)
    ours = {m for m in modules if m.startswith("hlplugin.")}
    assert "hlplugin.kubeapi.client" in ours
    assert all(m.startswith("hlplugin.kubeapi") for m in ours), sorted(ours)


def test_the_start_freezes_its_imports_and_turns_the_gc_back_on() -> None:
    """The entry point (the `hlplugin` command, `python -m hlplugin`) turns the cyclic GC off for
    a start's imports; when the daemon begins to run, their objects are frozen (out of every
    later collection) and the GC is on again."""
    (command,) = entry_points(group="console_scripts", name="hlplugin")
    assert command.value == "hlplugin.__main__:run"
    code = f"""
import gc, sys
import hlplugin.cli as cli

def instead(coroutine, signals):  # where the daemon would begin to run
    coroutine.close()
    print(gc.isenabled(), gc.get_freeze_count(), "hlplugin.bootstrap" in sys.modules)
    return 0

cli._run = instead
sys.argv = ["hlplugin", "bootstrap", "--plugin-dir", {str(short_dir())!r}, "--hypervisor", "kvm",
            "--http-address", "127.0.0.1:0"]
from hlplugin.__main__ import run
run()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    enabled, frozen, imported = result.stdout.split()
    assert enabled == "True" and imported == "True"
    assert int(frozen) > 10_000  # the start's objects (some 45,000)


def test_serving_http_on_an_ip_address_loads_no_idna_codec() -> None:
    """The bind's address lookup takes the (numeric) host as bytes: a str would be IDNA-encoded,
    which loads that codec and its tables."""
    modules = loaded_after(
        "import asyncio\nfrom hlplugin.deviceplugin.process.http import HttpServer\n"
        "from prometheus_client.registry import CollectorRegistry\n"
        "async def serve():\n"
        "    http = HttpServer(dict, lambda: (True, ''), CollectorRegistry())\n"
        "    await http.start(('127.0.0.1', 0))\n"
        "    await http.stop()\n"
        "asyncio.run(serve())")
    assert "hlplugin.deviceplugin.process.http" in modules and "encodings.idna" not in modules


def test_the_first_inotify_watch_runs_no_ldconfig() -> None:
    """inotify_simple would find libc with ctypes.util.find_library, which runs `ldconfig -p`
    in a subprocess (on the event loop, before Register); the watch module hands it the libc
    the process has loaded, and inotify works through it."""
    code = """
import subprocess, tempfile
spawned = []
class Spy(subprocess.Popen):
    def __init__(self, args, *rest, **options):
        spawned.append(args)
        super().__init__(args, *rest, **options)
subprocess.Popen = Spy
import hlplugin.deviceplugin.health.watch, inotify_simple
with tempfile.TemporaryDirectory() as directory, inotify_simple.INotify() as inotify:
    inotify.add_watch(directory, inotify_simple.flags.CREATE)
    open(directory + "/new", "w").close()
    names = [event.name for event in inotify.read(timeout=10000)]
print(spawned, names)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.split() == ["[]", "['new']"]


def test_h11_loads_at_its_first_use() -> None:
    modules = loaded_after("import hlplugin.bootstrap, h11\nh11.Connection(h11.SERVER)")
    assert "h11._connection" in modules


@pytest.mark.parametrize("spelling", [
    "from prometheus_client import generate_latest",
    "import prometheus_client; prometheus_client.generate_latest",
])
def test_prometheus_client_is_whole_for_whoever_asks_after_us(spelling: str) -> None:
    """The deferred package completes itself on first use of a name from its __init__."""
    modules = loaded_after(f"import hlplugin.bootstrap\n{spelling}")
    assert "prometheus_client.exposition" in modules


def test_the_check_sees_tooling_by_name() -> None:
    """The name check above cannot pass by missing a tool moved into a subpackage."""
    assert offenders({"hlplugin.tools.emulator", "hlplugin.demo", "hlplugin.config"}, ()) == [
        "hlplugin.demo", "hlplugin.tools.emulator"]


def test_the_driver_loads_no_tooling_or_exposition_before_it_serves() -> None:
    modules = loaded_after("import hlplugin.cli, hlplugin.dra.driver")
    assert {"hlplugin.dra.driver", "hlplugin.cdi", "hlplugin.health", "hlplugin.api.dra_v1_pb2"} <= modules
    assert not offenders(modules, EXPOSITION)


def test_the_driver_loads_no_api_client_or_slice_controller_before_it_knows_it_is_in_a_cluster(
        ) -> None:
    """Outside a cluster (run by hand, a test) the driver pays nothing for its control-plane side:
    hlplugin.dra imports the client and the controller only once cluster_api finds a pod's
    service account (tests/test_dra_slices.py runs both sides)."""
    modules = loaded_after("import hlplugin.cli, hlplugin.dra.driver")
    control_plane = ("hlplugin.kubeapi", "hlplugin.dra.slices", "hlplugin.dra.controlplane",
                     "hlplugin.nodefacts")
    assert "hlplugin.dra.driver" in modules and not offenders(modules, control_plane)
