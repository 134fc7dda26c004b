"""Command line: `hlplugin serve | bootstrap | cdi | doctor | demo`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hlplugin import __version__, config, logs
from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.quoting import clip, quote
from hlplugin.deviceplugin.signals import StopSignals
from hlplugin.dirs import not_a_directory
from hlplugin.names import NO_HYPERVISOR_HINT

log = logging.getLogger("hlplugin")

_COMMANDS = {
    "serve": ("run the main device plugin (hyperlight.dev/hypervisor)", config.SERVE_OPTIONS),
    "bootstrap": ("run the bootstrap plugin (hyperlight.dev/device-access)",
                  config.BOOTSTRAP_OPTIONS),
    "cdi": ("print the CDI spec the daemon keeps, or --check a file against it", config.CDI_OPTIONS),
    "doctor": ("check whether this node could serve Hyperlight workloads", config.DOCTOR_OPTIONS),
    "demo": ("run both daemons against a built-in kubelet emulator in a temporary node root", ()),
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
        prog="hlplugin",
        description="Kubernetes device plugin for Hyperlight micro-VMs. Every option has an "
                    "environment twin; a flag wins over its twin.")
    parser.add_argument("--version", action="version", version=f"hlplugin {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, options) in _COMMANDS.items():
        durations = name != "cdi" and any(config.OPTIONS[o].metavar == config.DURATION
                                          for o in options)
        description = {"serve": f"{help_text}. {SERVE_EFFECTS}",
                       "cdi": f"{help_text}. It also takes the rest of the serve command line, "
                              "and ignores it: only the options below shape the spec."}
        sub = commands.add_parser(name, help=help_text, description=description.get(name, help_text),
                                  epilog=config.DURATION_HELP if durations else None)
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
    options = _COMMANDS[args.command][1]
    resolution = config.resolve_sources(args, options, args.command)
    settings = resolution.settings
    daemon = args.command in ("serve", "bootstrap")
    if daemon:
        problem = config.socket_path_problem(settings.plugin_dir)
        if problem:
            args.subparser.error(f"argument --plugin-dir (or HYPERLIGHT_PLUGIN_DIR): {problem}")
    if args.command == "serve":
        problem = not_a_directory(settings.cdi_dir)
        if problem:
            args.subparser.error(f"argument --cdi-dir (or HYPERLIGHT_CDI_DIR): {problem}")
    logs.configure(settings.log_format, settings.log_level)
    if daemon:
        # Before gRPC is imported: its C core prints to fd 2 from its own threads (errors only,
        # unless GRPC_VERBOSITY says otherwise).
        logs.capture_stderr()
        # Each setting once: in the text line, grouped by source; in JSON, as fields.
        if settings.log_format == "json":
            log.info("hlplugin %s %s starting", args.command, __version__,
                     extra={"version": __version__,
                            "settings": {n: config.show(getattr(settings, n)) for n in options},
                            "sources": resolution.sources})
        else:
            log.info("hlplugin %s %s starting; %s", args.command, __version__,
                     resolution.describe())
    config.log_warnings(resolution.warnings)
    if daemon:
        _limit_malloc_arenas()
        # From here until the process exits a stop signal never kills it (deviceplugin/signals.py).
        signals = StopSignals().install()
        from hlplugin.deviceplugin.daemon import Launch  # imports gRPC: after capture_stderr

        launch = Launch(resolution.ignored, signals)
    if args.command == "serve":
        from hlplugin.plugin import serve

        _imports_done()
        return _run(serve(settings, launch), signals)
    if args.command == "bootstrap":
        from hlplugin.bootstrap import bootstrap

        _imports_done()
        return _run(bootstrap(settings, launch), signals)
    _imports_done()
    if args.command == "cdi":
        return _cdi(settings, args.check)
    if args.command == "doctor":
        from hlplugin.tools.doctor import doctor

        return doctor(settings, as_json=args.json, device_only=args.device_only)
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


def _cdi(settings: config.Settings, check: Path | None) -> int:
    from hlplugin import cdi_spec  # the bootstrap has no CDI: not loaded by its start

    hypervisor = settings.detect_hypervisor()
    if hypervisor is None:
        print(f"hlplugin cdi: no mshv or kvm device under "
              f"{quote(str(settings.dev_dir), files.PATH_CHARS)}; pass --hypervisor "
              f"(and {NO_HYPERVISOR_HINT})", file=sys.stderr)
        return 1
    desired = cdi_spec.render_spec(hypervisor, settings.device_uid, settings.device_gid)
    if check is None:
        sys.stdout.buffer.write(desired)
        return 0
    ok, difference = cdi_spec.check_file(check, desired)
    if not ok:
        print(difference, file=sys.stderr)
    return 0 if ok else 1
