"""`hlplugin dra` as a process whose API server is named rather than found in the pod: run as
``python tests/support/dracluster.py URL dra ARGS...``, it is the driver of hlplugin.dra with
its flags parsed as the command line parses them, but ``api`` an explicit server (the fake on
loopback) in place of the in-cluster one, whose CA and token live at a fixed path no test may
write. A process, not a task of the test's: the daemon's gRPC server then ends with it (run
inside pytest, its server outlives the event loop and leaves gRPC's poller thread behind).

``DriverProcess`` runs it with what tools.process.DaemonProcess gives every daemon under test:
a free HTTP port, JSON log lines kept, SIGTERM to stop.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from hlplugin.tools.drive import Daemon

SCRIPT = Path(__file__).resolve()


class DriverProcess(Daemon):
    def __init__(self, url: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        super().__init__(args, env)
        self.args = [sys.executable, str(SCRIPT), url, *self.args[3:]]  # after `-m hlplugin`


def main(url: str, argv: Sequence[str]) -> None:
    from hlplugin import cli, config, dra, logs
    from hlplugin.deviceplugin.process.daemon import Launch
    from hlplugin.kubeapi import Config

    args = cli.build_parser("dra").parse_args(argv)
    settings = config.resolve_sources(args, config.DRA_OPTIONS, "dra").settings
    logs.configure(settings.logging.format, settings.logging.level)
    asyncio.run(dra.dra(settings, Launch(), api=lambda: Config.from_url(url)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
