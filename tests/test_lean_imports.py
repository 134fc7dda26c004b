"""Each daemon imports only what it needs before it registers (fitness tests, in a fresh
interpreter each): the bootstrap has no prober, CDI or device-health code; neither daemon loads
the tooling (emulator, demo, doctor) or prometheus_client's exposition code before a scrape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TOOLING = ("tools", "emulator", "demo", "doctor")
# prometheus_client's exposition module and what it alone pulls in.
EXPOSITION = ("prometheus_client.exposition", "http.server", "wsgiref")
MAIN_ONLY = ("hlplugin.probe", "hlplugin.cdi", "hlplugin.cdi_spec", "hlplugin.health")


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
