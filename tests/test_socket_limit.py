"""The socket path limit at its edge (issue 11 #9): the longest socket name is the bootstrap's,
and a plugin dir whose socket path is one byte too long is refused naming the flag."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

import grpc
import pytest
from harness import emulator, healthy_tracker, short_dir

from hlplugin import cli, config, names
from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.bootstrap import SOCKET as ACCESS_SOCKET
from hlplugin.bootstrap import DeviceAccessPlugin
from hlplugin.deviceplugin import files
from hlplugin.deviceplugin.kubelet.deviceplugin.lifecycle import PluginLifecycle
from hlplugin.deviceplugin.settings import KubeletSettings

ACCESS = "hyperlight.dev/device-access"


def plugin_dir_of_length(total: int) -> Path:
    """A directory whose device-access socket path has exactly ``total`` bytes."""
    base = short_dir()
    pad = total - len(f"{base}/") - len(f"/{names.LONGEST_SOCKET}")
    path = base / ("d" * pad)
    path.mkdir()
    assert len(os.fsencode(path / names.LONGEST_SOCKET)) == total
    return path


async def test_longest_accepted_plugin_dir_binds_and_registers() -> None:
    plugin_dir = plugin_dir_of_length(files.MAX_SOCKET_PATH)
    assert names.LONGEST_SOCKET == ACCESS_SOCKET
    assert config.socket_path_problem(plugin_dir) == ""

    tracker = healthy_tracker()
    plugin = PluginLifecycle(KubeletSettings(plugin_dir), ACCESS_SOCKET, ACCESS,
                             lambda: DeviceAccessPlugin(
                                 "kvm", tracker, functools.partial(asyncio.sleep, 0, True)))
    async with emulator(plugin_dir) as kubelet:
        task = asyncio.create_task(plugin.run())
        try:
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS)
        finally:
            task.cancel()
            await asyncio.wait({task})


async def test_one_byte_longer_plugin_dir_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    plugin_dir = plugin_dir_of_length(files.MAX_SOCKET_PATH + 1)
    assert config.socket_path_problem(plugin_dir)

    # The limit is not stricter than gRPC: one byte more does not bind.
    server = grpc.aio.server()
    with pytest.raises(RuntimeError, match="Failed to bind"):
        server.add_insecure_port(f"unix://{plugin_dir / names.LONGEST_SOCKET}")
    await server.stop(None)
    # Let go of the server while its loop runs: pytest.raises' tracebacks hold this frame in a
    # reference cycle, and a grpc.aio server collected after its loop closed segfaults pytest.
    del server
    with pytest.raises(SystemExit) as exited:
        cli.main(["bootstrap", "--plugin-dir", str(plugin_dir)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--plugin-dir" in err and "too long" in err
