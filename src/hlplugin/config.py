"""The command line's half of the settings: flags and their environment twins, parsed into the
frozen groups of hlplugin.settings (the only parser there is).

Each option is declared once, in OPTIONS, naming the settings field it sets (its default, and
for numbers its range, come from hlplugin.settings). A flag wins over its twin. An invalid flag
exits 2 naming the flag (argparse); an invalid environment value is warned about and replaced by
the default, the upstream contract.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

from hlplugin import aliases, durations, parsers
from hlplugin.deviceplugin import files
from hlplugin.names import LONGEST_SOCKET
from hlplugin.settings import (
    HYPERVISORS,
    INTERVAL_RANGE,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_DEVICE_COUNT,
    MAX_SLOTS,
    TIMEOUT_RANGE,
    UINT32_MAX,
    BootstrapSettings,
    DaemonSettings,
    DraSettings,
    ServeSettings,
    show,
)

__all__ = ["HYPERVISORS", "INTERVAL_RANGE", "MAX_DEVICE_COUNT", "TIMEOUT_RANGE", "UINT32_MAX", "show"]

DURATION = "DURATION"  # the metavar of every duration; --help explains it (DURATION_HELP)
DURATION_HELP = f"DURATION is {durations.SYNTAX}."
_INTERVALS = f"{durations.show(INTERVAL_RANGE[0])}-{durations.show(INTERVAL_RANGE[1])}"
_TIMEOUTS = f"{durations.show(TIMEOUT_RANGE[0])}-{durations.show(TIMEOUT_RANGE[1])}"


_UNSET: Any = object()

# Which settings each command builds: `cdi` and `doctor` read the main daemon's.
SETTINGS_OF: dict[str, type[DaemonSettings]] = {
    "serve": ServeSettings, "bootstrap": BootstrapSettings, "cdi": ServeSettings,
    "doctor": ServeSettings, "demo": ServeSettings, "dra": DraSettings}


def value_at(settings: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        settings = getattr(settings, name)
    return settings


@dataclass(frozen=True)
class Option:
    """One flag and its twin, setting the field at ``at`` (dotted: group.field) of a command's
    settings; its name (``dest``) is the flag's, as argparse spells it, and its help the field's
    attribute docstring (with ``bounds``, the range its parser takes, where it has one)."""

    at: str
    flag: str
    env: str | None
    parse: Callable[[str], Any]
    metavar: str | None = None
    is_switch: bool = False
    bounds: str = ""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.at.split("."))

    def default_for(self, command: str = "serve") -> Any:
        """The field's default in that command's settings (the bootstrap's port is its own)."""
        return value_at(SETTINGS_OF[command](), self.path)

    @property
    def default(self) -> Any:
        """The main daemon's default; for a field only the DRA driver has, the driver's."""
        return self.default_for(self._owner)

    @property
    def _owner(self) -> str:
        """The command whose settings hold this field: the main daemon's, else the driver's."""
        return "serve" if hasattr(ServeSettings(), self.path[0]) else "dra"

    @property
    def help(self) -> str:
        """What the option means: its field's docstring (hlplugin.settings, or the generic
        package's), read when help is shown (never by a start), and the range it takes."""
        group: type = type(value_at(SETTINGS_OF[self._owner](), self.path[:-1]))
        text = field_docs(group)[self.path[-1]]
        return f"{text} Range: {self.bounds}." if self.bounds else text


@functools.cache
def field_docs(group: type) -> dict[str, str]:
    """The attribute docstrings of a settings dataclass (the string under each field), each on
    one line: parsed from its module's source, so only --help and the README's table pay for it."""
    (tree,) = [node for node in _parsed(group.__module__).body
               if isinstance(node, ast.ClassDef) and node.name == group.__qualname__]
    docs = {}
    for field, doc in itertools.pairwise(tree.body):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


@functools.cache
def _parsed(module: str) -> ast.Module:
    return ast.parse(inspect.getsource(sys.modules[module]))


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, with each option's meaning (Option.help) put before its environment twin and
    default at the moment help is printed, so a start does not read the settings' docstrings."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        option = OPTIONS.get(action.dest)
        if option is None or text is None:
            return text
        return f"{option.help.replace('%', '%%')} {text}"


OPTIONS: dict[str, Option] = {o.dest: o for o in (
    Option("kubelet.plugin_dir", "--plugin-dir", "HYPERLIGHT_PLUGIN_DIR", parsers.path, "DIR"),
    Option("cdi.dir", "--cdi-dir", "HYPERLIGHT_CDI_DIR", parsers.path, "DIR"),
    Option("health.dev_dir", "--dev-dir", "HYPERLIGHT_DEV_DIR", parsers.path, "DIR"),
    Option("health.host_dev_dir", "--host-dev-dir", "HYPERLIGHT_HOST_DEV_DIR", parsers.optional_path, "DIR"),
    Option("health.hypervisor", "--hypervisor", "HYPERLIGHT_HYPERVISOR",
           parsers.choice("auto", *HYPERVISORS), "auto|kvm|mshv"),
    Option("device_count", "--device-count", "DEVICE_COUNT", parsers.device_count, "N",
           bounds=f"1-{MAX_DEVICE_COUNT}"),
    Option("cdi.device_uid", "--device-uid", "DEVICE_UID", parsers.uint32, "N"),
    Option("cdi.device_gid", "--device-gid", "DEVICE_GID", parsers.uint32, "N"),
    Option("http.address", "--http-address", "HYPERLIGHT_HTTP_ADDRESS", parsers.address, "HOST:PORT"),
    Option("logging.format", "--log-format", "HYPERLIGHT_LOG_FORMAT", parsers.choice(*LOG_FORMATS),
           "text|json"),
    Option("logging.level", "--log-level", "HYPERLIGHT_LOG_LEVEL", parsers.choice(*LOG_LEVELS),
           "LEVEL"),
    Option("cdi.annotations", "--cdi-annotations", "HYPERLIGHT_CDI_ANNOTATIONS", parsers.boolean,
           is_switch=True),
    Option("cdi.interval", "--cdi-interval", "HYPERLIGHT_CDI_INTERVAL", parsers.interval, DURATION,
           bounds=_INTERVALS),
    Option("health.interval", "--health-interval", "HYPERLIGHT_HEALTH_INTERVAL", parsers.interval,
           DURATION, bounds=_INTERVALS),
    Option("health.probe_timeout", "--probe-timeout", "HYPERLIGHT_PROBE_TIMEOUT", parsers.timeout,
           DURATION, bounds=_TIMEOUTS),
    Option("health.guest_check", "--guest-check", "HYPERLIGHT_GUEST_CHECK", parsers.boolean, "true|false"),
    Option("kubelet.register_timeout", "--register-timeout", "HYPERLIGHT_REGISTER_TIMEOUT",
           parsers.timeout, DURATION, bounds=_TIMEOUTS),
    Option("dra.registry_dir", "--registry-dir", "HYPERLIGHT_REGISTRY_DIR", parsers.path, "DIR"),
    Option("dra.plugin_dir", "--dra-dir", "HYPERLIGHT_DRA_DIR", parsers.path, "DIR"),
    Option("dra.pod_uid", "--pod-uid", "HYPERLIGHT_POD_UID", parsers.pod_uid, "UID"),
    Option("dra.node_name", "--node-name", "HYPERLIGHT_NODE_NAME", parsers.node_name, "NAME"),
    Option("dra.slots", "--slots", "HYPERLIGHT_SLOTS", parsers.slots, "N", bounds=f"1-{MAX_SLOTS}"),
    Option("frame_guard", "--frame-guard", "HYPERLIGHT_FRAME_GUARD", parsers.boolean, "true|false"),
)}

SERVE_OPTIONS = ("plugin_dir", "cdi_dir", "dev_dir", "host_dev_dir", "hypervisor", "device_count",
                 "device_uid", "device_gid", "http_address", "log_format", "log_level",
                 "cdi_annotations", "cdi_interval", "health_interval", "probe_timeout",
                 "guest_check", "register_timeout", "frame_guard")
BOOTSTRAP_OPTIONS = ("plugin_dir", "dev_dir", "hypervisor", "http_address", "log_format",
                     "log_level", "register_timeout", "frame_guard")
DRA_OPTIONS = ("registry_dir", "dra_dir", "pod_uid", "node_name", "slots", "cdi_dir", "dev_dir",
               "host_dev_dir", "hypervisor", "device_uid", "device_gid", "http_address",
               "log_format", "log_level", "cdi_interval", "health_interval", "probe_timeout",
               "guest_check", "frame_guard")
# `hlplugin cdi` takes the serve command line as it is, so an operator can paste it; only the
# hypervisor, uid and gid shape the spec.
CDI_OPTIONS = SERVE_OPTIONS
DOCTOR_OPTIONS = ("plugin_dir", "cdi_dir", "dev_dir", "host_dev_dir", "hypervisor", "device_uid",
                  "device_gid", "probe_timeout", "log_format", "log_level")


def socket_path_problem(plugin_dir: Path) -> str:
    """Why our sockets cannot live in ``plugin_dir``, or "" when they can."""
    return files.socket_path_problem(plugin_dir, LONGEST_SOCKET)


def _flag_type(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = option.dest
    return parse


def add_options(parser: argparse.ArgumentParser, names: Sequence[str], command: str) -> None:
    for name in names:
        option = OPTIONS[name]
        default = option.default_for(command)
        shown = default
        if isinstance(default, tuple):
            shown = f"{default[0]}:{default[1]}"
        elif isinstance(default, bool):
            shown = str(default).lower()
        elif option.metavar == DURATION:
            shown = durations.show(default)
        elif default == "":
            shown = "(empty)"
        help_text = f"(env {option.env}; default {shown})"  # the meaning: HelpFormatter
        if option.is_switch:
            parser.add_argument(option.flag, dest=name, action="store_const", const=True,
                                default=_UNSET, help=help_text)
        else:
            parser.add_argument(option.flag, dest=name, type=_flag_type(option), default=_UNSET,
                                metavar=option.metavar, help=help_text)


FLAG, ENVIRONMENT, DEFAULT = "flag", "environment", "default"


@dataclass(frozen=True)
class Resolution:
    """Settings, the warnings to log, and where each setting came from (FLAG, ENVIRONMENT or
    DEFAULT; an invalid environment value counts as DEFAULT, since the default is what runs);
    ``ignored`` names the settings whose environment value was invalid (the daemons export them)."""

    settings: Any  # the command's (SETTINGS_OF)
    warnings: list[str]
    sources: dict[str, str]
    ignored: tuple[str, ...] = ()

    def describe(self) -> str:
        """The effective settings grouped by source, for the one start-up line."""
        groups = []
        for source, title in ((FLAG, "from flags"), (ENVIRONMENT, "from the environment"),
                              (DEFAULT, "defaults")):
            names = [name for name, came in self.sources.items() if came == source]
            if names:
                shown = ", ".join(f"{name}={show(value_at(self.settings, OPTIONS[name].path))}"
                                  for name in names)
                groups.append(f"{title}: {shown}")
        return "; ".join(groups) or "no settings"


def resolve_sources(
    args: argparse.Namespace,
    names: Sequence[str],
    command: str,
    environ: Mapping[str, str] | None = None,
) -> Resolution:
    """Combine flags, environment and defaults, remembering which one each setting came from."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []
    ignored: list[str] = []
    for name in names:
        option = OPTIONS[name]
        default = option.default_for(command)
        value = getattr(args, name, _UNSET)
        source = FLAG
        variable = None if value is not _UNSET else aliases.variable(
            option.env, aliases.UPSTREAM.get(name), option.parse, env, warnings)
        if variable is not None:
            raw = env[variable]
            source = ENVIRONMENT
            try:
                value = option.parse(raw)
            except ValueError as exc:
                ignored.append(name)
                warnings.append(f"ignoring {variable}={raw[:40]!r}: {exc}; using the default "
                                f"{default!r}")
        if value is _UNSET:
            value, source = default, DEFAULT
        values[name] = value
        sources[name] = source
    settings = build(SETTINGS_OF[command], {OPTIONS[n].path: v for n, v in values.items()})
    if "host_dev_dir" in names and values["host_dev_dir"] is None:
        warnings.append("host device identity check is off (--host-dev-dir is empty)")
    return Resolution(settings, warnings, sources, tuple(ignored))


def build(kind: type[DaemonSettings], values: Mapping[tuple[str, ...], Any]) -> Any:
    """``kind``'s defaults with ``values`` set, each at its path (a group's fields, or a top one)."""
    settings: Any = kind()
    changes: dict[str, Any] = {}
    for path, value in values.items():
        if len(path) == 1:
            changes[path[0]] = value
        else:
            group = changes.get(path[0], getattr(settings, path[0]))
            assert is_dataclass(group) and not isinstance(group, type)
            changes[path[0]] = replace(group, **{path[1]: value})
    return replace(settings, **changes)


def shown_settings(settings: Any, names: Sequence[str]) -> dict[str, str]:
    """Each option's effective value as an operator would type it, for the JSON start-up line."""
    return {name: show(value_at(settings, OPTIONS[name].path)) for name in names}


def log_warnings(warnings: Sequence[str]) -> None:
    for text in warnings:
        logging.getLogger("hlplugin.config").warning(text)
