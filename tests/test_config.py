"""Flags, environment twins and defaults; the command line in-process (`hlplugin cdi`, usage
errors, --help and --version), which needs no daemon and so no subprocess."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hlplugin import __version__, cdi, config
from hlplugin.cli import build_parser, main

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    """`hlplugin ARGV` in-process with ``env`` on top of ours: (exit code, stdout, stderr). The
    root logger, which the command configures, is put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def hlplugin(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            code = main(argv)
        except SystemExit as exited:
            code = int(exited.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    yield hlplugin
    root.handlers[:] = handlers
    root.setLevel(level)


def resolve(argv: list[str], env: dict[str, str],
            command: str = "serve") -> tuple[config.Settings, list[str]]:
    args = build_parser().parse_args([command, *argv])
    names = {"serve": config.SERVE_OPTIONS, "bootstrap": config.BOOTSTRAP_OPTIONS}[command]
    return config.resolve(args, names, command, env)


def test_defaults() -> None:
    settings, warnings = resolve([], {})
    assert settings.plugin_dir == Path("/var/lib/kubelet/device-plugins")
    assert settings.cdi_dir == Path("/var/run/cdi")
    assert settings.dev_dir == Path("/dev")
    assert settings.host_dev_dir == Path("/host-dev")
    assert (settings.hypervisor, settings.device_count) == ("auto", 2000)
    assert (settings.device_uid, settings.device_gid) == (65534, 65534)
    assert settings.http_address == ("0.0.0.0", 8080)
    assert (settings.log_format, settings.log_level) == ("text", "info")
    assert settings.cdi_annotations is False
    assert warnings == []
    assert resolve([], {}, "bootstrap")[0].http_address == ("0.0.0.0", 8081)


COUNT_RANGE = f"from 1 to {config.MAX_DEVICE_COUNT}"


@pytest.mark.parametrize(("name", "value", "says"), [
    ("DEVICE_COUNT", "abc", COUNT_RANGE), ("DEVICE_COUNT", "-1", COUNT_RANGE),
    ("DEVICE_COUNT", "0", COUNT_RANGE),
    ("DEVICE_UID", "-1", ""), ("DEVICE_UID", "4294967296", ""), ("DEVICE_UID", "x", ""),
    ("DEVICE_GID", "-5", ""), ("DEVICE_GID", "99999999999", ""),
    # ASCII digits only, and up to the ceiling
    *(("DEVICE_COUNT", value, COUNT_RANGE) for value in (
        "1_000", "\u0661\u0662", "\uff11\uff12", "99999999999999999999", "+5", "5.0", "0x10", "",
        str(config.MAX_DEVICE_COUNT + 1))),
    ("DEVICE_UID", "\u0661", ""), ("DEVICE_GID", "1_0", ""),
    ("HYPERLIGHT_HTTP_ADDRESS", "0.0.0.0:\uff18\uff10", ""),
])
def test_invalid_env_falls_back_to_default_with_warning(name: str, value: str, says: str) -> None:
    settings, warnings = resolve([], {name: value})
    field = {"HYPERLIGHT_HTTP_ADDRESS": "http_address"}.get(name, name.lower())
    assert getattr(settings, field) == config.OPTIONS[field].default
    assert len(warnings) == 1 and name in warnings[0], warnings
    assert "default" in warnings[0] or field == "http_address", warnings
    assert says in warnings[0]


def test_uint32_bounds_are_inclusive() -> None:
    settings, warnings = resolve([], {"DEVICE_UID": "4294967295", "DEVICE_GID": "0"})
    assert (settings.device_uid, settings.device_gid) == (4294967295, 0)
    assert warnings == []


def test_flag_wins_over_twin() -> None:
    settings, _ = resolve(["--device-count", "3", "--hypervisor", "mshv"],
                          {"DEVICE_COUNT": "9", "HYPERLIGHT_HYPERVISOR": "kvm"})
    assert (settings.device_count, settings.hypervisor) == (3, "mshv")


def test_empty_host_dev_dir_turns_identity_off_with_warning() -> None:
    settings, warnings = resolve(["--host-dev-dir", ""], {})
    assert settings.host_dev_dir is None
    assert any("identity" in w for w in warnings)
    from_env, env_warnings = resolve([], {"HYPERLIGHT_HOST_DEV_DIR": ""})
    assert from_env.host_dev_dir is None and any("identity" in w for w in env_warnings)


def test_switch_twin() -> None:
    assert resolve([], {"HYPERLIGHT_CDI_ANNOTATIONS": "true"})[0].cdi_annotations is True
    assert resolve(["--cdi-annotations"], {})[0].cdi_annotations is True


def test_relative_dirs_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings, _ = resolve(["--plugin-dir", "plugins", "--cdi-dir", "cdi"], {"HYPERLIGHT_DEV_DIR": "dev"})
    assert settings.plugin_dir == tmp_path / "plugins"
    assert settings.cdi_dir == tmp_path / "cdi"
    assert settings.dev_dir == tmp_path / "dev"


def test_device_count_ceiling_is_inclusive() -> None:
    settings, warnings = resolve([], {"DEVICE_COUNT": f" {config.MAX_DEVICE_COUNT} "})
    assert (settings.device_count, warnings) == (config.MAX_DEVICE_COUNT, [])
    assert resolve(["--device-count", "1"], {})[0].device_count == 1


def test_device_list_at_the_ceiling_fits_the_kubelet_message_limit_twice_over() -> None:
    """The longest list the ceiling allows (mshv names, all Unhealthy) as the plugin builds it."""
    from hlplugin.deviceplugin.conditions import HealthTracker
    from hlplugin.plugin import HypervisorPlugin

    async def gate() -> Any:
        raise AssertionError("not called")

    plugin = HypervisorPlugin("mshv", config.MAX_DEVICE_COUNT, HealthTracker(required=()), gate)
    message = plugin._lists[False]
    assert len(message.devices) == config.MAX_DEVICE_COUNT
    assert {d.health for d in message.devices} == {"Unhealthy"}
    assert message.ByteSize() * 2 <= config.KUBELET_MAX_MESSAGE
    # ... while twice the ceiling's worth is more than half way to it: the ceiling is not arbitrary.
    bigger = HypervisorPlugin("mshv", 4 * config.MAX_DEVICE_COUNT, HealthTracker(required=()), gate)
    assert bigger._lists[False].ByteSize() > config.KUBELET_MAX_MESSAGE


INTERVALS = ("cdi_interval", "health_interval")
TIMEOUTS = ("probe_timeout", "register_timeout")


@pytest.mark.parametrize("name", INTERVALS + TIMEOUTS)
def test_durations_accept_their_range_inclusive(name: str) -> None:
    low, high = config.INTERVAL_RANGE if name in INTERVALS else config.TIMEOUT_RANGE
    flag = config.OPTIONS[name].flag
    for value in (low, high):
        assert getattr(resolve([flag, f"{value:g}"], {})[0], name) == value
    assert getattr(resolve([flag, f"{low:g}s"], {})[0], name) == low


@pytest.mark.parametrize("name", INTERVALS + TIMEOUTS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e9", "0.000001", "-3", "0", "1_0",
                                   "\u0661", "below", "above"])
def test_durations_out_of_range_name_the_range(name: str, value: str) -> None:
    low, high = config.INTERVAL_RANGE if name in INTERVALS else config.TIMEOUT_RANGE
    value = {"below": f"{low * 0.99:g}", "above": f"{high * 1.01:g}"}.get(value, value)
    option = config.OPTIONS[name]
    assert option.env is not None
    settings, warnings = resolve([], {option.env: value})
    assert getattr(settings, name) == option.default
    assert len(warnings) == 1
    assert f"must be a number of seconds from {low:g} to {high:g}" in warnings[0], warnings


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
    assert len(resolution.warnings) == 1
    assert resolution.describe() == (
        "from flags: hypervisor=kvm; from the environment: log_level=debug; defaults: "
        "plugin_dir=/var/lib/kubelet/device-plugins, dev_dir=/dev, http_address=0.0.0.0:8081, "
        "log_format=text, register_timeout=5.0")


@pytest.mark.parametrize("argv", [
    ["serve", "--device-count", str(config.MAX_DEVICE_COUNT + 1)],
    ["serve", "--cdi-interval", "1e9"],
    ["bootstrap", "--register-timeout", "nan"],
    ["bootstrap", "--plugin-dir", "/" + "p" * 100],
])
def test_argument_errors_print_the_subcommands_usage(argv: list[str], cli: Cli) -> None:
    code, _, err = cli(*argv)
    assert code == 2
    assert err.startswith(f"usage: hlplugin {argv[0]} "), err
    assert f"hlplugin {argv[0]}: error: argument {argv[1]}" in err


def test_unknown_arguments_print_the_subcommands_usage(cli: Cli) -> None:
    code, _, err = cli("doctor", "--no-such-flag", "extra")
    assert code == 2
    assert err.startswith("usage: hlplugin doctor "), err
    assert err.endswith("hlplugin doctor: error: unrecognized arguments: --no-such-flag extra\n")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--device-count", "0"], "--device-count"),
    (["--device-count", "abc"], "--device-count"),
    (["--device-uid", "-1"], "--device-uid"),
    (["--device-gid", "4294967296"], "--device-gid"),
    (["--hypervisor", "xen"], "--hypervisor"),
    (["--http-address", "nonsense"], "--http-address"),
    (["--log-format", "xml"], "--log-format"),
    (["--log-level", "loud"], "--log-level"),
    (["--cdi-interval", "-3"], "--cdi-interval"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--plugin-dir", "/tmp/" + "d" * 100], "too long"),  # no room for a socket path in it
])
def test_invalid_flags_exit_2_naming_the_flag(argv: list[str], flag: str, cli: Cli) -> None:
    code, _, err = cli("serve", *argv)
    assert code == 2
    assert flag in err
    if flag == "too long":
        assert "--plugin-dir" in err


def test_version_and_help(cli: Cli) -> None:
    code, out, _ = cli("--version")
    assert code == 0 and __version__ in out
    code, help_text, _ = cli("serve", "--help")
    assert code == 0
    for flag, twin in [("--plugin-dir", "HYPERLIGHT_PLUGIN_DIR"), ("--cdi-dir", "HYPERLIGHT_CDI_DIR"),
                       ("--dev-dir", "HYPERLIGHT_DEV_DIR"), ("--host-dev-dir", "HYPERLIGHT_HOST_DEV_DIR"),
                       ("--hypervisor", "HYPERLIGHT_HYPERVISOR"), ("--device-count", "DEVICE_COUNT"),
                       ("--device-uid", "DEVICE_UID"), ("--device-gid", "DEVICE_GID"),
                       ("--http-address", "HYPERLIGHT_HTTP_ADDRESS"),
                       ("--log-format", "HYPERLIGHT_LOG_FORMAT"), ("--log-level", "HYPERLIGHT_LOG_LEVEL"),
                       ("--cdi-annotations", "HYPERLIGHT_CDI_ANNOTATIONS")]:
        assert flag in help_text and twin in help_text, flag
    code, out, _ = cli("bootstrap", "--help")
    assert code == 0 and "0.0.0.0:8081" in out
    for flag in ("--plugin-dir", "--dev-dir", "--hypervisor", "--http-address", "--log-format",
                 "--log-level"):
        assert flag in out
    assert "--cdi-dir" not in out


# --- `hlplugin cdi`: print the desired spec, or --check a file against it ----------------------


def test_cdi_prints_the_spec_the_daemon_writes(cli: Cli, tmp_path: Path) -> None:
    code, out, _ = cli("cdi", "--hypervisor", "kvm", "--device-uid", "1000", "--device-gid", "1001")
    assert code == 0
    assert out.encode() == cdi.render_spec("kvm", 1000, 1001)
    spec = json.loads(out)
    assert spec["kind"] == "hyperlight.dev/hypervisor"
    assert spec["cdiVersion"] == "0.3.0"
    # It accepts the serve command line.
    code, out, err = cli("cdi", "--plugin-dir", str(tmp_path), "--cdi-dir", str(tmp_path),
                         "--hypervisor", "kvm", "--device-count", "5",
                         "--http-address", "127.0.0.1:0", "--cdi-annotations")
    assert code == 0, err
    assert out.encode() == cdi.render_spec("kvm", 65534, 65534)
    # Environment twins apply.
    code, out, _ = cli("cdi", env={"HYPERLIGHT_HYPERVISOR": "mshv", "DEVICE_UID": "7",
                                   "DEVICE_GID": "8"})
    assert out.encode() == cdi.render_spec("mshv", 7, 8)


def test_cdi_check_exact_file_exits_0_and_differences_exit_1(cli: Cli, tmp_path: Path) -> None:
    spec = tmp_path / "hyperlight.json"
    spec.write_bytes(cdi.render_spec("kvm", 65534, 65534))
    assert cli("cdi", "--hypervisor", "kvm", "--check", str(spec))[0] == 0
    spec.write_bytes(cdi.render_spec("kvm", 0, 65534))
    code, _, err = cli("cdi", "--hypervisor", "kvm", "--check", str(spec))
    assert code == 1
    assert '"uid": 0' in err and '"uid": 65534' in err
    code, _, err = cli("cdi", "--hypervisor", "kvm", "--check", str(tmp_path / "nope.json"))
    assert code == 1 and err.strip()
    code, _, err = cli("cdi", "--dev-dir", str(tmp_path))  # auto, and no device: explains
    assert code == 1
    assert "--hypervisor" in err
