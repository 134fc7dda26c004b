"""Flags, environment twins and defaults; the command line in-process (`hlplugin cdi`, usage
errors, --help; --version is test_packaging's), which needs no daemon and so no subprocess."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hlplugin import cdi, config
from hlplugin.cli import build_parser, main

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """`hlplugin ARGV` in-process with ``env`` on top of ours: (exit code, stdout, stderr). The
    root logger, which the command configures, is put back afterwards. The daemons' directories
    and port point at a scratch directory: should a regression let a usage error through, the
    daemon it starts touches nothing of the machine's (its kubelet or CDI directories)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    scratch = tmp_path_factory.mktemp("cli")
    for name, value in (("HYPERLIGHT_PLUGIN_DIR", scratch), ("HYPERLIGHT_CDI_DIR", scratch),
                        ("HYPERLIGHT_HTTP_ADDRESS", "127.0.0.1:0")):
        monkeypatch.setenv(name, str(value))

    def hlplugin(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            code = main(argv)
        except SystemExit as exited:
            code = int(exited.code or 0)
        return (code, *capsys.readouterr())

    yield hlplugin
    root.handlers[:] = handlers
    root.setLevel(level)


def resolve(argv: list[str], env: dict[str, str]) -> tuple[config.Settings, list[str]]:
    return config.resolve(build_parser().parse_args(["serve", *argv]), config.SERVE_OPTIONS, "serve", env)


MAX = config.MAX_DEVICE_COUNT
COUNT_RANGE = f"from 1 to {MAX}"
DURATIONS = {name: config.INTERVAL_RANGE for name in ("cdi_interval", "health_interval")} | {
    name: config.TIMEOUT_RANGE for name in ("probe_timeout", "register_timeout")}


@pytest.mark.parametrize(("name", "value", "says"), [
    ("DEVICE_UID", "-1", ""), ("DEVICE_UID", "4294967296", ""), ("DEVICE_UID", "x", ""),
    ("DEVICE_GID", "-5", ""), ("DEVICE_GID", "99999999999", ""),
    ("DEVICE_UID", "\u0661", ""), ("DEVICE_GID", "1_0", ""),
    # ASCII digits only, and up to the ceiling
    *(("DEVICE_COUNT", value, COUNT_RANGE) for value in (
        "abc", "-1", "0", "1_000", "\u0661\u0662", "\uff11\uff12", "99999999999999999999", "+5", "5.0",
        "0x10", "", str(MAX + 1))),
    ("HYPERLIGHT_HTTP_ADDRESS", "0.0.0.0:\uff18\uff10", ""),
    # every duration, each out of its range in every way; the warning names the range
    *((config.OPTIONS[name].env, {"below": f"{low * 0.99:g}", "above": f"{high * 1.01:g}"}.get(value, value),
       f"must be a number of seconds from {low:g} to {high:g}")
      for name, (low, high) in DURATIONS.items()
      for value in ("nan", "inf", "-inf", "1e9", "0.000001", "-3", "0", "1_0", "\u0661", "below", "above")),
])
def test_invalid_env_falls_back_to_default_with_warning(name: str, value: str, says: str) -> None:
    settings, warnings = resolve([], {name: value})
    field = next(field for field, option in config.OPTIONS.items() if option.env == name)
    assert getattr(settings, field) == config.OPTIONS[field].default
    assert len(warnings) == 1 and name in warnings[0], warnings
    assert "default" in warnings[0] or field == "http_address", warnings
    assert says in warnings[0]


@pytest.mark.parametrize(("argv", "env", "want", "warns"), [
    ([], {}, {  # the defaults
        "plugin_dir": Path("/var/lib/kubelet/device-plugins"), "cdi_dir": Path("/var/run/cdi"),
        "dev_dir": Path("/dev"), "host_dev_dir": Path("/host-dev"), "hypervisor": "auto",
        "device_count": 2000, "device_uid": 65534, "device_gid": 65534,
        "http_address": ("0.0.0.0", 8080), "log_format": "text", "log_level": "info",
        "cdi_annotations": False}, ""),
    ([], {"DEVICE_UID": "4294967295", "DEVICE_GID": "0"}, {"device_uid": 4294967295, "device_gid": 0}, ""),
    ([], {"DEVICE_COUNT": f" {MAX} "}, {"device_count": MAX}, ""),  # the ceiling is inclusive
    (["--device-count", "1"], {}, {"device_count": 1}, ""),
    (["--device-count", "3", "--hypervisor", "mshv"], {"DEVICE_COUNT": "9", "HYPERLIGHT_HYPERVISOR": "kvm"},
     {"device_count": 3, "hypervisor": "mshv"}, ""),  # a flag wins over its twin
    ([], {"HYPERLIGHT_CDI_ANNOTATIONS": "true"}, {"cdi_annotations": True}, ""),
    (["--cdi-annotations"], {}, {"cdi_annotations": True}, ""),
    (["--host-dev-dir", ""], {}, {"host_dev_dir": None}, "identity"),  # the identity check is off
    ([], {"HYPERLIGHT_HOST_DEV_DIR": ""}, {"host_dev_dir": None}, "identity"),
    # relative dirs are taken from the working directory (tmp_path below)
    (["--plugin-dir", "plugins", "--cdi-dir", "cdi"], {"HYPERLIGHT_DEV_DIR": "dev"},
     {"plugin_dir": Path("plugins"), "cdi_dir": Path("cdi"), "dev_dir": Path("dev")}, ""),
    # every duration's range is inclusive, and "s" may follow the number
    *(([config.OPTIONS[name].flag, f"{value:g}{unit}"], {}, {name: value}, "")
      for name, (low, high) in DURATIONS.items() for value, unit in ((low, ""), (high, ""), (low, "s"))),
])
def test_valid_values_are_taken(argv: list[str], env: dict[str, str], want: dict[str, Any], warns: str,
                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings, warnings = resolve(argv, env)
    # An absolute path stays itself under tmp_path (``/`` discards what comes before it).
    want = {name: tmp_path / value if isinstance(value, Path) else value for name, value in want.items()}
    assert {name: getattr(settings, name) for name in want} == want
    assert any(warns in w for w in warnings) if warns else warnings == [], warnings


def test_device_list_at_the_ceiling_fits_the_kubelet_message_limit_twice_over() -> None:
    """The longest list the ceiling allows (mshv names, all Unhealthy) as the plugin builds it."""
    from hlplugin.api import deviceplugin_pb2 as pb
    from hlplugin.deviceplugin.conditions import HealthTracker
    from hlplugin.plugin import HypervisorPlugin

    async def gate() -> Any:
        raise AssertionError("not called")

    plugin = HypervisorPlugin("mshv", config.MAX_DEVICE_COUNT, HealthTracker(required=()), gate)
    message = pb.ListAndWatchResponse.FromString(plugin.devices.wire(False))
    assert len(message.devices) == config.MAX_DEVICE_COUNT
    assert {d.health for d in message.devices} == {"Unhealthy"}
    assert message.ByteSize() * 2 <= config.KUBELET_MAX_MESSAGE
    # ... while twice the ceiling's worth is more than half way to it: the ceiling is not arbitrary.
    bigger = HypervisorPlugin("mshv", 4 * config.MAX_DEVICE_COUNT, HealthTracker(required=()), gate)
    assert len(bigger.devices.wire(False)) > config.KUBELET_MAX_MESSAGE


def test_provenance_of_every_setting() -> None:
    args = build_parser().parse_args(["bootstrap", "--hypervisor", "kvm"])
    resolution = config.resolve_sources(
        args, config.BOOTSTRAP_OPTIONS, "bootstrap",
        {"HYPERLIGHT_LOG_LEVEL": "debug", "HYPERLIGHT_REGISTER_TIMEOUT": "nan",
         "HYPERLIGHT_HYPERVISOR": "mshv"})
    assert resolution.sources == {
        "plugin_dir": "default", "dev_dir": "default", "hypervisor": "flag",
        "http_address": "default", "log_format": "default", "log_level": "environment",
        "register_timeout": "default",  # invalid in the environment: the default runs
    }
    assert resolution.settings.log_level == "debug" and resolution.settings.hypervisor == "kvm"
    assert resolution.settings.http_address == ("0.0.0.0", 8081)
    assert len(resolution.warnings) == 1
    assert resolution.describe() == (
        "from flags: hypervisor=kvm; from the environment: log_level=debug; defaults: "
        "plugin_dir=/var/lib/kubelet/device-plugins, dev_dir=/dev, http_address=0.0.0.0:8081, "
        "log_format=text, register_timeout=5.0")


@pytest.mark.parametrize(("argv", "error"), [
    *(([command, flag, value], f"argument {flag}: .*") for command, flag, value in [
        ("serve", "--device-count", str(MAX + 1)), ("serve", "--device-count", "0"),
        ("serve", "--device-count", "abc"), ("serve", "--device-uid", "-1"),
        ("serve", "--device-gid", "4294967296"), ("serve", "--hypervisor", "xen"),
        ("serve", "--http-address", "nonsense"), ("serve", "--log-format", "xml"),
        ("serve", "--log-level", "loud"), ("serve", "--cdi-interval", "-3"),
        ("serve", "--cdi-interval", "1e9"), ("bootstrap", "--register-timeout", "nan")]),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["doctor", "--no-such-flag", "extra"], "unrecognized arguments: --no-such-flag extra"),
    # no room for a socket path in it
    (["serve", "--plugin-dir", "/tmp/" + "d" * 100], r"argument --plugin-dir .* is too long .*"),
    (["bootstrap", "--plugin-dir", "/" + "p" * 100], r"argument --plugin-dir .* is too long .*"),
])
def test_usage_errors_exit_2_with_the_subcommands_usage_naming_the_flag(
        argv: list[str], error: str, cli: Cli) -> None:
    code, _, err = cli(*argv)
    assert code == 2
    assert err.startswith(f"usage: hlplugin {argv[0]} "), err
    assert err.endswith("\n")
    assert re.fullmatch(f"hlplugin {argv[0]}: error: {error}", err.splitlines()[-1]), err


def test_help_names_every_flag_and_its_twin(cli: Cli) -> None:
    for command, names in (("serve", config.SERVE_OPTIONS), ("bootstrap", config.BOOTSTRAP_OPTIONS)):
        code, out, _ = cli(command, "--help")
        assert code == 0
        for option in map(config.OPTIONS.__getitem__, names):
            assert option.flag in out and (option.env is None or option.env in out), option.flag
    assert "0.0.0.0:8081" in out and "--cdi-dir" not in out  # bootstrap's


def test_cdi_prints_the_spec_the_daemon_writes_or_checks_a_file_against_it(cli: Cli, tmp_path: Path) -> None:
    code, out, _ = cli("cdi", "--hypervisor", "kvm", "--device-uid", "1000", "--device-gid", "1001")
    assert code == 0
    assert out.encode() == cdi.render_spec("kvm", 1000, 1001)
    assert json.loads(out)["kind"] == "hyperlight.dev/hypervisor"
    assert json.loads(out)["cdiVersion"] == "0.3.0"
    # It accepts the serve command line.
    code, out, err = cli("cdi", "--plugin-dir", str(tmp_path), "--cdi-dir", str(tmp_path),
                         "--hypervisor", "kvm", "--device-count", "5",
                         "--http-address", "127.0.0.1:0", "--cdi-annotations")
    assert code == 0, err
    assert out.encode() == cdi.render_spec("kvm", 65534, 65534)
    # --check: an exact file exits 0, differences exit 1.
    written = tmp_path / "hyperlight.json"
    written.write_bytes(cdi.render_spec("kvm", 65534, 65534))
    assert cli("cdi", "--hypervisor", "kvm", "--check", str(written))[0] == 0
    written.write_bytes(cdi.render_spec("kvm", 0, 65534))
    code, _, err = cli("cdi", "--hypervisor", "kvm", "--check", str(written))
    assert code == 1
    assert '"uid": 0' in err and '"uid": 65534' in err
    code, _, err = cli("cdi", "--hypervisor", "kvm", "--check", str(tmp_path / "nope.json"))
    assert code == 1 and err.strip()
    code, _, err = cli("cdi", "--dev-dir", str(tmp_path))  # auto, and no device: explains
    assert code == 1
    assert "--hypervisor" in err
    # Environment twins apply (last: they stay set for the rest of the test).
    code, out, _ = cli("cdi", env={"HYPERLIGHT_HYPERVISOR": "mshv", "DEVICE_UID": "7",
                                   "DEVICE_GID": "8"})
    assert out.encode() == cdi.render_spec("mshv", 7, 8)
