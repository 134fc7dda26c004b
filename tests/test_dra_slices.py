"""`hlplugin dra` publishes this node's ResourceSlice where it runs in a cluster, and only there.
The driver runs as a process, hlplugin.dra.driver.dra with its flags parsed as the command line parses
them, but its API server named (tests/support/dracluster.py: the fake on loopback of
tests/support/fakeapi.py) in place of the in-cluster one a pod has, whose CA and token live at a
fixed path no test may write. The slice carries --slots and the proofs' health (a taint while
the device fails its check, gone when it passes); /readyz shows the slice's condition without
gating readiness, so an API server that is away fails nothing the kubelet asks; outside a
cluster (`hlplugin dra` itself) no controller runs and one line says why."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from harness import daemon, mknod_char, needs_kvm, wait_until
from support.dracluster import Node, driver, readyz
from support.fakeapi import FakeApiServer
from support.fakeslices import NODE, add_node
from support.pluginwatcher import FakePluginWatcher

from hlplugin import config, kubeapi
from hlplugin.dra import driver as dra
from hlplugin.dra.slices import UNHEALTHY_TAINT
from hlplugin.kubeapi import RESOURCE_SLICES
from hlplugin.names import DRA_DRIVER
from hlplugin.tools.process import free_port

NAME = f"{NODE}-{DRA_DRIVER}"
pytestmark = pytest.mark.guard(60)


def slices_note(body: dict[str, Any]) -> dict[str, Any]:
    return dict(body.get("advisory", {}).get("slices", {}))


def stored(server: FakeApiServer) -> dict[str, Any] | None:
    return server.objects.get(RESOURCE_SLICES.path(), {}).get(("", NAME))


def taints(found: dict[str, Any]) -> list[Any]:
    (device,) = found["spec"]["devices"]
    return list(device.get("taints", []))


async def test_the_running_driver_publishes_its_slice_and_readyz_notes_it_without_gating() -> None:
    """No kvm under --dev-dir: the device fails its check, so the slice carries the taint, and
    /readyz fails on ``device`` (and ``registered``: no kubelet here) alone: ``slices`` is a note
    beside the conditions, published."""
    node = Node()
    async with FakeApiServer() as server:
        add_node(server)
        async with driver(node, server.url, "--slots", "7") as proc:
            await wait_until(lambda: stored(server) is not None, 30, "the slice published")
            found = stored(server)
            assert found is not None
            (device,) = found["spec"]["devices"]
            assert device["capacity"] == {"slots": {"value": "7", "requestPolicy": {
                "default": "1", "validRange": {"min": "1"}}}}
            assert taints(found) == [UNHEALTHY_TAINT]

            async def noted() -> bool:
                return slices_note((await readyz(proc))[1]).get("ok") is True

            await wait_until(noted, 10, "/readyz noting the slice published")
            status, body = await readyz(proc)
            assert body["advisory"] == {
                "slices": {"ok": True, "reason": f"slice {NAME} published (pool generation 1)"},
                "claims": {"ok": True, "reason": "no claim read yet"}}
            assert status == 503 and "slices" not in body["conditions"]
            assert [name for name, c in body["conditions"].items() if not c["ok"]] == ["device", "registered"]


@needs_kvm
async def test_the_device_passing_its_check_again_removes_the_taint() -> None:
    """The controller follows the proofs' tracker: kvm appears under --dev-dir (a node of the
    host's device), the next device check passes, and the slice is written again without the taint."""
    node = Node()
    async with FakeApiServer() as server:
        add_node(server)
        async with driver(node, server.url):
            await wait_until(lambda: (found := stored(server)) is not None and bool(taints(found)),
                             30, "the slice published with the taint")
            mknod_char(node.dev_dir / "kvm", os.stat("/dev/kvm").st_rdev)
            await wait_until(lambda: (found := stored(server)) is not None and not taints(found),
                             30, "the taint removed once the device passes its check")


@needs_kvm
async def test_an_api_server_away_is_said_in_readyz_and_the_driver_stays_ready() -> None:
    """The kubelet side keeps serving while the API server is unreachable: /readyz answers 200
    (every condition holds) and its note names why the slice is not published."""
    node = Node()
    mknod_char(node.dev_dir / "kvm", os.stat("/dev/kvm").st_rdev)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    watcher = FakePluginWatcher(node.registry)  # the kubelet: registered, it is ready
    async with driver(node, nobody) as proc:

        async def said() -> bool:
            await watcher.sync()
            return "cannot connect to the API server" in slices_note((await readyz(proc))[1]).get(
                "reason", "")

        await wait_until(said, 30, "/readyz naming the unreachable API server")

        async def ready() -> bool:
            await watcher.sync()
            return (await readyz(proc))[0] == 200

        await wait_until(ready, 30, "/readyz ready, the API server still away")
        _, body = await readyz(proc)
        assert slices_note(body)["ok"] is False and "slices" not in body["conditions"]


async def test_outside_a_cluster_no_slice_is_published_and_one_line_says_why() -> None:
    """The process as an operator runs it, with no KUBERNETES_SERVICE_HOST: one info line, no
    controller (no ``slices`` anywhere in /readyz), and the kubelet side as before."""
    node = Node()
    async with daemon(node.args(), {"KUBERNETES_SERVICE_HOST": ""}, graceful=True) as proc:
        body = json.loads(await proc.wait_http("/readyz", 503))
        assert "advisory" not in body and "slices" not in body["conditions"]
        assert "registered" in body["conditions"]
        lines = [line for line in proc.lines if "ResourceSlice" in str(line.get("message"))]
        assert [(line["level"], line["message"]) for line in lines] == [
            ("info", "no ResourceSlice is published: KUBERNETES_SERVICE_HOST is not set (not "
                     "running in a pod); the kubelet side serves without it")], proc.raw


def test_in_a_pod_without_a_token_no_slice_is_published_naming_the_token(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "hlplugin.dra")
    token = tmp_path / "token"
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert dra.cluster_api(pod, token) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"no ResourceSlice is published: no service-account token at {token} (none mounted into "
        "the pod); the kubelet side serves without it"]


def test_the_driver_looks_for_the_token_where_the_client_reads_it() -> None:
    assert dra.SERVICE_ACCOUNT_TOKEN == kubeapi.config.SERVICE_ACCOUNT / "token"


def test_slots_is_a_dra_setting_with_its_range() -> None:
    no_flags = argparse.Namespace()
    for value, expected in (("1", 1), ("50000", 50000), ("0", 2000), ("50001", 2000)):
        resolution = config.resolve_sources(no_flags, config.DRA_OPTIONS, "dra",
                                            {"HYPERLIGHT_SLOTS": value})
        assert resolution.settings.dra.slots == expected, value
