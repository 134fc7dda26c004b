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
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from hlplugin.names import DRA_DRIVER
from hlplugin.tools.drive import Daemon, short_dir

SCRIPT = Path(__file__).resolve()
NODE = "node-a"  # the node a driver of these tests runs on (its pool)


class DriverProcess(Daemon):
    def __init__(self, url: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        super().__init__(args, env)
        self.args = [sys.executable, str(SCRIPT), url, *self.args[3:]]  # after `-m hlplugin`


class Node:
    """Scratch directories for one driver."""

    def __init__(self) -> None:
        root = short_dir()
        self.registry, self.plugin_dir = root / "registry", root / "plugins" / DRA_DRIVER
        self.cdi_dir, self.dev_dir = root / "cdi", root / "dev"
        for directory in (self.registry, self.cdi_dir, self.dev_dir):
            directory.mkdir()

    def args(self, *more: str) -> list[str]:
        return ["dra", "--registry-dir", str(self.registry), "--dra-dir", str(self.plugin_dir),
                "--node-name", NODE, "--cdi-dir", str(self.cdi_dir), "--dev-dir", str(self.dev_dir),
                "--host-dev-dir", "", "--hypervisor", "kvm", "--health-interval", "1s", *more]


@contextlib.asynccontextmanager
async def driver(node: Node, url: str, *more: str) -> AsyncIterator[DriverProcess]:
    """`hlplugin dra` for the block, its API server at ``url`` (support/dracluster.py); then
    stopped with SIGTERM, as the kubelet stops it."""
    proc = await DriverProcess(url, node.args(*more)).start()
    try:
        yield proc
    finally:
        assert await proc.stop() == 0, proc.raw


async def readyz(proc: DriverProcess) -> tuple[int, dict[str, Any]]:
    """/readyz's status and body; (0, {}) before the driver serves HTTP."""
    code, body = await proc.get("/readyz")
    return code, json.loads(body) if code else {}


def main(url: str, argv: Sequence[str]) -> None:
    from hlplugin import cli, config, logs
    from hlplugin.deviceplugin.process.daemon import Launch
    from hlplugin.dra import driver as dra
    from hlplugin.kubeapi import Config

    args = cli.build_parser("dra").parse_args(argv)
    settings = config.resolve_sources(args, config.DRA_OPTIONS, "dra").settings
    logs.configure(settings.logging.format, settings.logging.level)
    asyncio.run(dra.dra(settings, Launch(), api=lambda: Config.from_url(url)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
