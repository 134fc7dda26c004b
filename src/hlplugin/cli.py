"""Command line: `hlplugin serve | bootstrap | dra | cdi | doctor | demo`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hlplugin import __version__, config, logs
from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.process.signals import StopSignals
from hlplugin.deviceplugin.quoting import clip, quote
from hlplugin.dirs import not_a_directory
from hlplugin.names import NO_HYPERVISOR_HINT, dra_socket_names
from hlplugin.settings import ServeSettings

log = logging.getLogger("hlplugin")


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, the options it takes, and what runs it. A daemon's ``run`` names
    the module and coroutine function that serve it (imported after the start-up policy, since
    they import gRPC); another's is a function of the parsed arguments and settings."""

    help: str
    options: tuple[str, ...]
    run: Callable[[argparse.Namespace, Any], int] | None = None
    daemon: tuple[str, str] | None = None


def _cdi_command(args: argparse.Namespace, settings: ServeSettings) -> int:
    return _cdi(settings, args.check)


def _doctor_command(args: argparse.Namespace, settings: ServeSettings) -> int:
    from hlplugin.tools.doctor import doctor

    return doctor(settings, as_json=args.json, device_only=args.device_only)


def _demo_command(args: argparse.Namespace, settings: ServeSettings) -> int:
    if args.resource and args.allocate is None:
        args.subparser.error(f"unrecognized arguments: {args.resource}")
    if args.allocate is not None:
        from hlplugin.tools.demo_hold import allocate

        return allocate(args.allocate, args.resource)
    if args.hold:
        if args.keep:
            args.subparser.error("argument --hold: not allowed with --keep (it removes everything)")
        from hlplugin.tools.demo_hold import hold

        return hold()
    from hlplugin.tools.demo import demo

    return demo(keep=args.keep)


_COMMANDS = {
    "serve": Command("run the main device plugin (hyperlight.dev/hypervisor)", config.SERVE_OPTIONS,
                     daemon=("hlplugin.plugin", "serve")),
    "bootstrap": Command("run the bootstrap plugin (hyperlight.dev/device-access)",
                         config.BOOTSTRAP_OPTIONS, daemon=("hlplugin.bootstrap", "bootstrap")),
    "dra": Command("run the DRA driver hyperlight.dev (opt-in, in place of serve on a node)",
                   config.DRA_OPTIONS, daemon=("hlplugin.dra.driver", "dra")),
    "cdi": Command("print the CDI spec the daemon keeps, or --check a file against it",
                   config.CDI_OPTIONS, _cdi_command),
    "doctor": Command("check whether this node could serve Hyperlight workloads",
                      config.DOCTOR_OPTIONS, _doctor_command),
    "demo": Command("run both daemons against a built-in kubelet emulator in a temporary node root",
                    (), _demo_command),
}

# What `serve` does to the machine it runs on, said in its --help and in the README.
SERVE_EFFECTS = (
    "With the defaults, serve writes /var/run/cdi/hyperlight.json (podman and containerd on this "
    "machine read it; it stays after exit, by design, for containers already running), creates "
    "hyperlight.sock in /var/lib/kubelet/device-plugins and serves HTTP on 0.0.0.0:8080, every "
    "address of the machine. To run it by hand without touching the machine, give it scratch "
    "directories and a loopback address: hlplugin serve --plugin-dir /tmp/hl/plugins --cdi-dir "
    "/tmp/hl/cdi --http-address 127.0.0.1:0 (hlplugin demo does that, with a kubelet emulator).")
# `hlplugin cdi` takes the serve command line as it is, so an operator can paste it; --help lists
# only what shapes the spec.
CDI_SHAPES = ("dev_dir", "hypervisor", "device_uid", "device_gid")


class _Parser(argparse.ArgumentParser):
    """Usage errors quote a bounded, escaped prefix of what they were given: argparse's own
    messages (an unrecognized argument, a value after a switch) would echo it whole."""

    def error(self, message: str) -> NoReturn:
        super().error(logs.escape(clip(message, _MAX_ERROR_CHARS)))


# Room for every message of ours (each quotes a bounded prefix) and argparse's.
_MAX_ERROR_CHARS = 1024


def _file(text: str) -> Path:
    problem = files.path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return Path(text)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only`` (the command about to run), the other commands are
    listed without their options, which a start would build and never parse."""
    parser = _Parser(
        prog="hlplugin", formatter_class=config.HelpFormatter,
        description="Kubernetes device plugin for Hyperlight micro-VMs. Every option has an "
                    "environment twin; a flag wins over its twin.")
    parser.add_argument("--version", action="version", version=f"hlplugin {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in _COMMANDS.items():
        help_text, options = command.help, command.options
        durations = name != "cdi" and any(config.OPTIONS[o].metavar == config.DURATION
                                          for o in options)
        description = {"serve": f"{help_text}. {SERVE_EFFECTS}",
                       "cdi": f"{help_text}. It also takes the rest of the serve command line, "
                              "and ignores it: only the options below shape the spec."}
        sub = commands.add_parser(name, help=help_text, description=description.get(name, help_text),
                                  epilog=config.DURATION_HELP if durations else None,
                                  formatter_class=config.HelpFormatter)
        sub.set_defaults(subparser=sub)  # errors found after parsing print this command's usage
        if only is not None and name != only:
            continue
        config.add_options(sub, options, name)
        if name == "cdi":
            for action in sub._actions:
                if action.dest in config.OPTIONS and action.dest not in CDI_SHAPES:
                    action.help = argparse.SUPPRESS
            sub.add_argument("--check", type=_file, metavar="FILE",
                             help="exit 0 when FILE is exactly the spec, 1 with a difference")
        elif name == "doctor":
            sub.add_argument("--json", action="store_true", help="print the report as JSON")
            sub.add_argument("--device-only", action="store_true",
                             help="check only the hypervisor and the CDI device a workload would "
                                  "get, nothing of the kubelet: exit 0 where they work (the verdict "
                                  "of hlplugin demo)")
        elif name == "demo":
            sub.add_argument("--keep", action="store_true",
                             help="keep the temporary node root and print its path")
            sub.add_argument("--hold", action="store_true",
                             help="start both daemons and the emulator and keep them running until "
                                  "Ctrl-C, printing their URLs and commands to try")
            sub.add_argument("--allocate", metavar="SOCKET", type=Path,
                             help="ask the held demo listening on SOCKET to allocate "
                                  "(hyperlight.dev/hypervisor, or RESOURCE: device-access)")
            sub.add_argument("resource", nargs="?", default="", metavar="RESOURCE",
                             help=argparse.SUPPRESS)
    return parser


def _limit_malloc_arenas() -> None:
    """glibc gives each thread that allocates its own arena; gRPC's threads allocate little, so
    two arenas suffice and save resident memory on every node. Done before gRPC starts threads."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        m_arena_max = -8
        ctypes.CDLL(None).mallopt(m_arena_max, 2)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and argv[0] in _COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse reports these with the top level's usage; the command's is the help
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    command = _COMMANDS[args.command]
    resolution = config.resolve_sources(args, command.options, args.command)
    for problem in _unusable_dirs(args.command, resolution.settings):
        args.subparser.error(problem)
    if command.daemon is not None:
        return _start_daemon(args.command, command, resolution)
    logs.configure(resolution.settings.logging.format, resolution.settings.logging.level)
    config.log_warnings(resolution.warnings)
    _imports_done()
    assert command.run is not None
    return command.run(args, resolution.settings)


def _unusable_dirs(command: str, settings: Any) -> list[str]:
    """What would make a daemon's directories unusable, as usage errors naming the flag."""
    problems = []
    if command in ("serve", "bootstrap"):
        problem = config.socket_path_problem(settings.kubelet.plugin_dir)
        if problem:
            problems.append(f"argument --plugin-dir (or HYPERLIGHT_PLUGIN_DIR): {problem}")
    if command == "dra":
        registration, service = dra_socket_names(settings.dra.pod_uid)
        for option, name in (("registry_dir", registration), ("dra_dir", service)):
            flag = config.OPTIONS[option]
            problem = files.socket_path_problem(config.value_at(settings, flag.path), name)
            if problem:
                problems.append(f"argument {flag.flag} (or {flag.env}): {problem}")
    if command in ("serve", "dra"):
        problem = not_a_directory(settings.cdi.dir)
        if problem:
            problems.append(f"argument --cdi-dir (or HYPERLIGHT_CDI_DIR): {problem}")
    return problems


def _start_daemon(name: str, command: Command, resolution: config.Resolution) -> int:
    """The start-up policy of both daemons, in its order: signals (before any thread starts),
    logging, then stderr captured before gRPC is imported (its C core prints to fd 2 from its own
    threads), the one start line, the warnings, malloc arenas, and only then the daemon's own
    imports."""
    # From here until the process exits no signal but SIGKILL ends it without its stop: before
    # any thread starts, since each inherits the mask (deviceplugin/process/signals.py).
    signals = StopSignals().install()
    settings = resolution.settings
    logs.configure(settings.logging.format, settings.logging.level)
    logs.capture_stderr()
    # Each setting once: in the text line, grouped by source; in JSON, as fields.
    if settings.logging.format == "json":
        log.info("hlplugin %s %s starting", name, __version__,
                 extra={"version": __version__,
                        "settings": config.shown_settings(settings, command.options),
                        "sources": resolution.sources})
    else:
        log.info("hlplugin %s %s starting; %s", name, __version__, resolution.describe())
    config.log_warnings(resolution.warnings)
    _limit_malloc_arenas()
    from hlplugin.deviceplugin.process.daemon import Launch  # imports gRPC: after capture_stderr

    assert command.daemon is not None
    module, function = command.daemon
    run = getattr(importlib.import_module(module), function)
    _imports_done()
    return _run(run(settings, Launch(resolution.ignored, signals)), signals)


def _imports_done() -> None:
    """The start's imports are done: if the entry point turned the cyclic GC off for them
    (hlplugin/__main__.py), their objects go out of its sight for good (gc.freeze: the few
    hundred that were garbage among them stay) and it is turned back on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _run(coroutine: Coroutine[Any, Any, None], signals: StopSignals) -> int:
    try:
        asyncio.run(coroutine)
    finally:
        # Stopped, the process may still wait for a helper stuck in the kernel (a hung
        # filesystem) to return: a second SIGTERM meanwhile must not kill it.
        signals.ignore()
    return 0


def _cdi(settings: ServeSettings, check: Path | None) -> int:
    from hlplugin import cdi_spec  # the bootstrap has no CDI: not loaded by its start
    from hlplugin.detect import detect_hypervisor

    hypervisor = detect_hypervisor(settings.health)
    if hypervisor is None:
        print(f"hlplugin cdi: no mshv or kvm device under "
              f"{quote(str(settings.health.dev_dir), files.PATH_CHARS)}; pass --hypervisor "
              f"(and {NO_HYPERVISOR_HINT})", file=sys.stderr)
        return 1
    desired = cdi_spec.render_spec(hypervisor, settings.cdi.device_uid, settings.cdi.device_gid)
    if check is None:
        sys.stdout.buffer.write(desired)
        return 0
    ok, difference = cdi_spec.check_file(check, desired)
    if not ok:
        print(difference, file=sys.stderr)
    return 0 if ok else 1
