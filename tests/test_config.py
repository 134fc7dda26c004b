"""Flags, environment twins and defaults; the command line in-process (`hlplugin cdi`, usage
errors, --help; --version is test_packaging's), which needs no daemon and so no subprocess."""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hlplugin import aliases, cdi_spec, config, durations
from hlplugin.cli import build_parser, main
from hlplugin.dirs import not_a_directory
from hlplugin.settings import ServeSettings
from hlplugin.tools.emulator import KUBELET_MAX_MESSAGE

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


class Flat:
    """Settings read by option name (``cdi_interval`` is ``settings.cdi.interval``)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def __getattr__(self, name: str) -> Any:
        return config.value_at(self.settings, config.OPTIONS[name].path)


def resolve(argv: list[str], env: dict[str, str]) -> tuple[Flat, list[str]]:
    resolution = config.resolve_sources(build_parser().parse_args(["serve", *argv]), config.SERVE_OPTIONS,
                                        "serve", env)
    return Flat(resolution.settings), resolution.warnings


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
       f"must be a duration from {durations.show(low)} to {durations.show(high)}")
      for name, (low, high) in DURATIONS.items()
      for value in ("nan", "inf", "-inf", "1e9", "0.000001", "-3", "0", "1_0", "\u0661", "below", "above",
                    "10x", "1.5.0s", ".5", "1e1s", "5 s", "1d", "1M", "10sec", "s", "ms")),
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
    # units: ms, s, m, h, in flags and in the environment (the chart's pattern, exactly)
    ([], {"HYPERLIGHT_CDI_INTERVAL": "1m"}, {"cdi_interval": 60.0}, ""),
    ([], {"HYPERLIGHT_CDI_INTERVAL": "10s"}, {"cdi_interval": 10.0}, ""),
    ([], {"HYPERLIGHT_HEALTH_INTERVAL": "1h"}, {"health_interval": 3600.0}, ""),
    ([], {"HYPERLIGHT_HEALTH_INTERVAL": "1.5m"}, {"health_interval": 90.0}, ""),
    ([], {"HYPERLIGHT_PROBE_TIMEOUT": "500ms"}, {"probe_timeout": 0.5}, ""),
    ([], {"HYPERLIGHT_REGISTER_TIMEOUT": "100ms"}, {"register_timeout": 0.1}, ""),
    (["--cdi-interval", "2m", "--probe-timeout", "250ms"], {},
     {"cdi_interval": 120.0, "probe_timeout": 0.25}, ""),
    (["--register-timeout", "1m"], {}, {"register_timeout": 60.0}, ""),
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
    from hlplugin.deviceplugin.health.conditions import HealthTracker
    from hlplugin.plugin import HypervisorPlugin, slots

    async def gate() -> Any:
        raise AssertionError("not called")

    plugin = HypervisorPlugin("mshv", slots("mshv", config.MAX_DEVICE_COUNT), HealthTracker(()), gate)
    message = pb.ListAndWatchResponse.FromString(plugin.devices.wire(False))
    assert len(message.devices) == config.MAX_DEVICE_COUNT
    assert {d.health for d in message.devices} == {"Unhealthy"}
    assert message.ByteSize() * 2 <= KUBELET_MAX_MESSAGE
    # ... while twice the ceiling's worth is more than half way to it: the ceiling is not arbitrary.
    bigger = slots("mshv", 4 * config.MAX_DEVICE_COUNT)
    assert len(bigger.wire(False)) > KUBELET_MAX_MESSAGE


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
        "frame_guard": "default",
    }
    settings = resolution.settings
    assert settings.logging.level == "debug" and settings.health.hypervisor == "kvm"
    assert settings.http.address == ("0.0.0.0", 8081)
    assert len(resolution.warnings) == 1
    assert resolution.describe() == (
        "from flags: hypervisor=kvm; from the environment: log_level=debug; defaults: "
        "plugin_dir=/var/lib/kubelet/device-plugins, dev_dir=/dev, http_address=0.0.0.0:8081, "
        "log_format=text, register_timeout=5.0, frame_guard=false")


@pytest.mark.parametrize(("argv", "error"), [
    *(([command, flag, value], f"argument {flag}: .*") for command, flag, value in [
        ("serve", "--device-count", str(MAX + 1)), ("serve", "--device-count", "0"),
        ("serve", "--device-count", "abc"), ("serve", "--device-uid", "-1"),
        ("serve", "--device-gid", "4294967296"), ("serve", "--hypervisor", "xen"),
        ("serve", "--http-address", "nonsense"), ("serve", "--log-format", "xml"),
        ("serve", "--log-level", "loud"), ("serve", "--cdi-interval", "-3"),
        ("serve", "--cdi-interval", "1e9"), ("bootstrap", "--register-timeout", "nan"),
        ("serve", "--cdi-interval", "10x"), ("serve", "--health-interval", "500ms"),
        ("dra", "--frame-guard", "maybe")]),
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


def test_each_option_s_help_is_its_settings_field_s_docstring(cli: Cli) -> None:
    """One source: --help says what the attribute docstring under the option's field says (the
    frozen groups of hlplugin.settings and the generic package's), then its range, twin and default."""
    code, out, _ = cli("serve", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for option in map(config.OPTIONS.__getitem__, config.SERVE_OPTIONS):
        group = type(config.value_at(ServeSettings(), option.path[:-1]))
        source = " ".join(inspect.getsource(group).split())
        doc = option.help.split(" Range: ")[0]
        assert re.search(rf'\b{option.path[-1]}: (?:(?!""").)+ """{re.escape(doc)}"""', source), option.flag
        assert f"{option.help} (env {option.env}; default " in flat, option.flag


def test_a_start_reads_no_docstrings() -> None:
    """Only help pays for parsing the settings' source: a start builds its parser and resolves."""
    config.field_docs.cache_clear()
    args = build_parser("serve").parse_args(["serve", "--device-count", "3"])
    config.resolve_sources(args, config.SERVE_OPTIONS, "serve", environ={})
    assert config.field_docs.cache_info().misses == 0


def test_cdi_prints_the_spec_the_daemon_writes_or_checks_a_file_against_it(cli: Cli, tmp_path: Path) -> None:
    code, out, _ = cli("cdi", "--hypervisor", "kvm", "--device-uid", "1000", "--device-gid", "1001")
    assert code == 0
    assert out.encode() == cdi_spec.render_spec("kvm", 1000, 1001)
    assert json.loads(out)["kind"] == "hyperlight.dev/hypervisor"
    assert json.loads(out)["cdiVersion"] == "0.3.0"
    # It accepts the serve command line.
    code, out, err = cli("cdi", "--plugin-dir", str(tmp_path), "--cdi-dir", str(tmp_path),
                         "--hypervisor", "kvm", "--device-count", "5",
                         "--http-address", "127.0.0.1:0", "--cdi-annotations")
    assert code == 0, err
    assert out.encode() == cdi_spec.render_spec("kvm", 65534, 65534)
    # --check: an exact file exits 0, differences exit 1.
    written = tmp_path / "hyperlight.json"
    written.write_bytes(cdi_spec.render_spec("kvm", 65534, 65534))
    assert cli("cdi", "--hypervisor", "kvm", "--check", str(written))[0] == 0
    written.write_bytes(cdi_spec.render_spec("kvm", 0, 65534))
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
    assert out.encode() == cdi_spec.render_spec("mshv", 7, 8)


# --- huge and hostile values ---------------------------------------------------------------------

# As large as the kernel lets one argument or environment string be (128 KiB), starting with what
# would drive a terminal.
HUGE = "\x1b[2J\u202e" + "x" * (128 * 1024)
PATHS = ("plugin_dir", "cdi_dir", "dev_dir", "host_dev_dir")
# The longest path the kernel takes (PATH_MAX - 1 bytes), of components it takes (NAME_MAX).
LONGEST_PATH = ("/" + "/".join(["d" * 255] * 17))[:4095]
LONG_NAME = "/tmp/" + "n" * 256  # one component over NAME_MAX


def bounded(text: str, limit: int) -> None:
    assert len(text) < limit, f"{len(text)} characters: {text[:300]!r}..."
    assert "\x1b" not in text and "\u202e" not in text, text[:300]


@pytest.mark.parametrize("argv", [
    *([command, f"{config.OPTIONS[name].flag}={HUGE}"]
      for command, names in (("serve", config.SERVE_OPTIONS), ("bootstrap", config.BOOTSTRAP_OPTIONS),
                             ("doctor", config.DOCTOR_OPTIONS))
      for name in names),
    ["serve", f"--no-such-flag={HUGE}"], ["serve", "--no-such-flag", HUGE],  # argparse's own
    ["serve", f"--dev={HUGE}"],  # ambiguous: --dev-dir or --device-*
    ["cdi", f"--check={HUGE}"],
], ids=lambda argv: f"{argv[0]} {argv[1].partition('=')[0][:20]}")
def test_a_huge_flag_value_is_a_bounded_usage_error_naming_the_flag(argv: list[str], cli: Cli) -> None:
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    bounded(err, 4096)  # the subcommand's usage (1.3 KiB for serve) and one error line
    flag = argv[1].partition("=")[0]
    last = err.splitlines()[-1]
    assert last.startswith(f"hlplugin {argv[0]}: error: ") and flag in last, last
    bounded(last, 1200)


@pytest.mark.parametrize("name", [name for name in config.SERVE_OPTIONS if config.OPTIONS[name].env])
def test_a_huge_environment_value_is_warned_about_bounded_and_the_default_runs(name: str) -> None:
    option = config.OPTIONS[name]
    settings, warnings = resolve([], {option.env: HUGE})
    assert getattr(settings, name) == option.default
    assert len(warnings) == 1 and option.env in warnings[0], warnings
    bounded(warnings[0], 400)


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize(("path", "says"), [
    (LONG_NAME, "has a component of 256 bytes, 'nnn"), (LONGEST_PATH + "d", "is 4096 bytes long"),
    ("/" + "/".join(["x"] * 2100), "is 4200 bytes long")])
def test_a_path_the_kernel_would_refuse_exits_2_as_a_flag_and_falls_back_from_the_environment(
        name: str, path: str, says: str, cli: Cli) -> None:
    option = config.OPTIONS[name]
    code, _, err = cli("serve", option.flag, path)
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith(f"hlplugin serve: error: argument {option.flag}: {says}"), last
    assert "NAME_MAX" in last if "component" in says else "PATH_MAX" in last
    bounded(last, 400)
    settings, warnings = resolve([], {option.env or "": path})
    assert getattr(settings, name) == option.default
    assert len(warnings) == 1 and option.env in warnings[0] and says in warnings[0], warnings


def test_the_longest_path_the_kernel_takes_is_taken_and_shown_bounded(tmp_path: Path) -> None:
    """The start-up line shows every setting, a path cut after 256 characters."""
    argv = [flag for name in PATHS for flag in (config.OPTIONS[name].flag, LONGEST_PATH)]
    resolution = config.resolve_sources(build_parser().parse_args(["serve", *argv]),
                                        config.SERVE_OPTIONS, "serve", {})
    assert all(getattr(Flat(resolution.settings), name) == Path(LONGEST_PATH) for name in PATHS)
    line = resolution.describe()
    assert line.count("... (4095 bytes)") == 4
    bounded(line, 2000)
    assert config.show(Path(LONGEST_PATH)) == LONGEST_PATH[:256] + "... (4095 bytes)"


def test_a_plugin_dir_too_long_for_a_socket_is_quoted_bounded(cli: Cli) -> None:
    code, _, err = cli("serve", "--plugin-dir", LONGEST_PATH)
    assert code == 2
    last = err.splitlines()[-1]
    assert "is too long for a unix socket path (4125 > 105 bytes" in last, last
    bounded(last, 500)


@pytest.mark.parametrize("command", ["cdi", "doctor"])
def test_no_oserror_from_a_path_setting_escapes(command: str, cli: Cli, tmp_path: Path) -> None:
    """The longest path the kernel takes as --dev-dir: its /dev/mshv is one byte too long
    (ENAMETOOLONG), which `auto` must take as "no device there", not a crash."""
    code, _, err = cli(command, "--dev-dir", LONGEST_PATH, "--plugin-dir", str(tmp_path),
                       "--cdi-dir", str(tmp_path))
    assert code == 1
    assert "no mshv or kvm device under" in err or command == "doctor", err[:500]
    if command == "cdi":
        bounded(err, 700)  # the path cut at 256 characters, and the hint


# --- the upstream plugin's variable names ----------------------------------------------------------

@pytest.mark.parametrize(("env", "argv", "want", "warned"), [
    ({"HOST_DEVICE_DIR": "/upstream"}, [], Path("/upstream"), ""),
    ({"HOST_DEVICE_DIR": "/same", "HYPERLIGHT_HOST_DEV_DIR": "/same/"}, [], Path("/same"), ""),
    ({"HOST_DEVICE_DIR": "/upstream", "HYPERLIGHT_HOST_DEV_DIR": "/ours"}, [], Path("/ours"),
     "HOST_DEVICE_DIR='/upstream' (the upstream plugin's name) disagrees with "
     "HYPERLIGHT_HOST_DEV_DIR='/ours'; using HYPERLIGHT_HOST_DEV_DIR"),
    ({"HOST_DEVICE_DIR": "/upstream", "HYPERLIGHT_HOST_DEV_DIR": ""}, [], None, "disagrees"),
    ({"HOST_DEVICE_DIR": ""}, [], Path("/host-dev"), ""),  # empty is unset, as upstream reads it
    ({"HOST_DEVICE_DIR": "/upstream", "HYPERLIGHT_HOST_DEV_DIR": "/ours"}, ["--host-dev-dir", "/flag"],
     Path("/flag"), ""),  # a flag wins over both, and their quarrel does not matter
])
def test_the_upstream_host_device_dir_is_an_alias_and_ours_wins_saying_so(
        env: dict[str, str], argv: list[str], want: Path | None, warned: str) -> None:
    parser = build_parser()
    for command, names in (("serve", config.SERVE_OPTIONS), ("doctor", config.DOCTOR_OPTIONS)):
        resolution = config.resolve_sources(parser.parse_args([command, *argv]), names, command, env)
        assert resolution.settings.health.host_dev_dir == want
        shown = [w for w in resolution.warnings if "upstream" in w]
        if warned:
            assert len(shown) == 1 and warned in shown[0], shown
        else:
            assert shown == []
        if env.get("HOST_DEVICE_DIR") and "HYPERLIGHT_HOST_DEV_DIR" not in env and not argv:
            assert resolution.sources["host_dev_dir"] == config.ENVIRONMENT


def test_every_upstream_variable_is_read_under_its_own_name_or_an_alias() -> None:
    """DEVICE_COUNT, DEVICE_UID and DEVICE_GID are ours too; HOST_DEVICE_DIR is an alias."""
    ours = {o.env for o in config.OPTIONS.values()}
    for variable in ("DEVICE_COUNT", "DEVICE_UID", "DEVICE_GID"):
        assert variable in ours
    assert set(aliases.UPSTREAM.values()) == {"HOST_DEVICE_DIR"}
    settings, _ = resolve([], {"HOST_DEVICE_DIR": "/x", "DEVICE_COUNT": "7", "DEVICE_UID": "1",
                               "DEVICE_GID": "2"})
    assert (settings.host_dev_dir, settings.device_count, settings.device_uid,
            settings.device_gid) == (Path("/x"), 7, 1, 2)


def test_a_duration_out_of_range_is_refused_for_its_range_not_its_unit() -> None:
    """500ms is understood (its unit is known) but under the intervals' floor of 1s: the warning
    names the range, the default runs; a unit we do not know names the forms we take."""
    settings, warnings = resolve([], {"HYPERLIGHT_CDI_INTERVAL": "500ms"})
    assert settings.cdi_interval == 10.0
    (warning,) = warnings
    assert "HYPERLIGHT_CDI_INTERVAL" in warning and "500ms" in warning, warning
    assert "must be a duration from 1s to 1h" in warning and "default" in warning, warning
    _, warnings = resolve([], {"HYPERLIGHT_CDI_INTERVAL": "10x"})
    assert "500ms, 10s, 1m" in warnings[0] and "'10x'" in warnings[0]


def duration_pattern() -> str:
    """The one pattern the chart's values schema gives every duration value."""
    schema = (Path(__file__).parents[1] / "deploy" / "chart" / "hlplugin" / "values.schema.json")
    found = set(re.findall(r'"pattern": "([^"]*\(ms\|s\|m\|h\)[^"]*)"', schema.read_text()))
    assert len(found) == 1, found
    return str(json.loads(f'"{found.pop()}"'))


@pytest.mark.parametrize("text", ["0", "7", "10s", "500ms", "1.5m", "2h", "0.25s", "3600"])
def test_every_duration_the_charts_schema_takes_parses(text: str) -> None:
    assert re.fullmatch(duration_pattern().strip("^$"), text)
    seconds = durations.parse_seconds(text)
    assert durations.parse_seconds(durations.show(seconds) if seconds else "0") == seconds


def test_help_says_what_a_duration_is(cli: Cli) -> None:
    code, out, _ = cli("serve", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "--cdi-interval DURATION" in flat and "1s-1h" in flat and "default 10s" in flat
    assert "DURATION is a number of seconds or a number with ms, s, m or h" in flat


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_serve_with_a_cdi_dir_that_cannot_be_a_directory_exits_2_naming_the_flag(
        cli: Cli, tmp_path: Path, where: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    cdi_dir = afile if where == "file" else afile / "cdi"
    code, _, err = cli("serve", "--cdi-dir", str(cdi_dir))
    assert code == 2
    assert err.splitlines()[-1].startswith(
        "hlplugin serve: error: argument --cdi-dir (or HYPERLIGHT_CDI_DIR): ")
    assert f"{afile} is not a directory" in err and "EEXIST" not in err
    # One that does not exist yet under a directory is fine: the daemon makes it.
    assert not_a_directory(tmp_path / "new" / "cdi") == ""


def test_cdi_help_lists_only_what_shapes_the_spec(cli: Cli) -> None:
    code, out, _ = cli("cdi", "--help")
    assert code == 0
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", out))
    assert flags == {"--help", "--dev-dir", "--hypervisor", "--device-uid", "--device-gid", "--check"}
    assert "takes the rest of the serve command line" in " ".join(out.split())


def test_serve_help_says_what_it_writes_and_binds_and_how_to_run_it_by_hand(cli: Cli) -> None:
    code, out, _ = cli("serve", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for part in ("writes /var/run/cdi/hyperlight.json", "podman and containerd", "stays after exit",
                 "/var/lib/kubelet/device-plugins", "0.0.0.0:8080",
                 "--plugin-dir /tmp/hl/plugins --cdi-dir /tmp/hl/cdi --http-address 127.0.0.1:0"):
        assert part in flat, part
    # The command it gives parses, and points everything away from the machine's own paths.
    command = re.search(r"hlplugin (serve --plugin-dir \S+ --cdi-dir \S+ --http-address \S+)", flat)
    assert command is not None
    args = build_parser().parse_args(command.group(1).split())
    assert args.plugin_dir == Path("/tmp/hl/plugins") and args.http_address == ("127.0.0.1", 0)
