"""Command line: `hlplugin serve | bootstrap | cdi | doctor | demo`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hlplugin import __version__, cdi_spec, config, logs
from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.quoting import clip, quote

log = logging.getLogger("hlplugin")

_COMMANDS = {
    "serve": ("run the main device plugin (hyperlight.dev/hypervisor)", config.SERVE_OPTIONS),
    "bootstrap": ("run the bootstrap plugin (hyperlight.dev/device-access)",
                  config.BOOTSTRAP_OPTIONS),
    "cdi": ("print the CDI spec the daemon keeps, or --check a file against it", config.CDI_OPTIONS),
    "doctor": ("check whether this node could serve Hyperlight workloads", config.DOCTOR_OPTIONS),
    "demo": ("run both daemons against a built-in kubelet emulator in a temporary node root", ()),
}


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hlplugin",
        description="Kubernetes device plugin for Hyperlight micro-VMs. Every option has an "
                    "environment twin; a flag wins over its twin.")
    parser.add_argument("--version", action="version", version=f"hlplugin {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, options) in _COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(subparser=sub)  # errors found after parsing print this command's usage
        config.add_options(sub, options, name)
        if name == "cdi":
            sub.add_argument("--check", type=_file, metavar="FILE",
                             help="exit 0 when FILE is exactly the spec, 1 with a difference")
        elif name == "doctor":
            sub.add_argument("--json", action="store_true", help="print the report as JSON")
        elif name == "demo":
            sub.add_argument("--keep", action="store_true",
                             help="keep the temporary node root and print its path")
    return parser


def _limit_malloc_arenas() -> None:
    """glibc gives each thread that allocates its own arena; gRPC's threads allocate little, so
    two arenas suffice and save resident memory on every node. Done before gRPC starts threads."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        m_arena_max = -8
        ctypes.CDLL(None).mallopt(m_arena_max, 2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
    logs.configure(settings.log_format, settings.log_level)
    if daemon:
        # Before gRPC is imported: its C core prints to fd 2 from its own threads (errors only,
        # unless GRPC_VERBOSITY says otherwise).
        logs.capture_stderr()
        log.info("hlplugin %s %s starting; %s", args.command, __version__, resolution.describe(),
                 extra={"version": __version__,
                        "settings": {n: config.show(getattr(settings, n)) for n in options},
                        "sources": resolution.sources})
    config.log_warnings(resolution.warnings)
    if daemon:
        _limit_malloc_arenas()
    if args.command == "serve":
        from hlplugin.plugin import serve

        return _run(serve(settings))
    if args.command == "bootstrap":
        from hlplugin.bootstrap import bootstrap

        return _run(bootstrap(settings))
    if args.command == "cdi":
        return _cdi(settings, args.check)
    if args.command == "doctor":
        from hlplugin.tools.doctor import doctor

        return doctor(settings, as_json=args.json)
    from hlplugin.tools.demo import demo

    return demo(keep=args.keep)


def _run(coroutine: Coroutine[Any, Any, None]) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(coroutine)
    # Stopped. The interpreter still waits for worker threads, and a check stuck in the kernel
    # (a hung filesystem) holds one until it returns: a second SIGTERM meanwhile, once asyncio
    # has restored the default action, must not turn a clean stop into death by signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


def _cdi(settings: config.Settings, check: Path | None) -> int:

    hypervisor = settings.detect_hypervisor()
    if hypervisor is None:
        print(f"hlplugin cdi: no mshv or kvm device under "
              f"{quote(str(settings.dev_dir), files.PATH_CHARS)}; pass --hypervisor", file=sys.stderr)
        return 1
    desired = cdi_spec.render_spec(hypervisor, settings.device_uid, settings.device_gid)
    if check is None:
        sys.stdout.buffer.write(desired)
        return 0
    ok, difference = cdi_spec.check_file(check, desired)
    if not ok:
        print(difference, file=sys.stderr)
    return 0 if ok else 1
