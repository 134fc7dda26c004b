"""Flags, environment twins and defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlplugin import config
from hlplugin.cli import build_parser


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


@pytest.mark.parametrize(("name", "value"), [
    ("DEVICE_COUNT", "abc"), ("DEVICE_COUNT", "-1"), ("DEVICE_COUNT", "0"),
    ("DEVICE_UID", "-1"), ("DEVICE_UID", "4294967296"), ("DEVICE_UID", "x"),
    ("DEVICE_GID", "-5"), ("DEVICE_GID", "99999999999"),
])
def test_invalid_env_falls_back_to_default_with_warning(name: str, value: str) -> None:
    settings, warnings = resolve([], {name: value})
    field = name.lower()
    assert getattr(settings, field) == config.OPTIONS[field].default
    assert len(warnings) == 1 and name in warnings[0] and "default" in warnings[0]


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
