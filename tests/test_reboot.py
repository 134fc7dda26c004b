"""A node reboot through the kubelet emulator (docs/kubelet.md, "A node reboot"), with both real
daemons: the kubelet re-admits the node's pods before any plugin registers, so the main plugin's
pod, which requests hyperlight.dev/device-access, fails admission once; the replacement its
DaemonSet makes is admitted as soon as the bootstrap has registered (docs/operations.md, "After a
node reboot")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from harness import Node, daemon, emulator, needs_kvm

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.tools.emulator import AdmissionError, Pod

ACCESS = "hyperlight.dev/device-access"
HYPERVISOR = "hyperlight.dev/hypervisor"


@needs_kvm
@pytest.mark.guard(120)
async def test_after_a_reboot_the_main_pod_fails_once_and_its_replacement_is_admitted(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    bootstrap_args = ["bootstrap", "--plugin-dir", str(node.plugin_dir),
                      "--dev-dir", str(node.dev_dir)]
    serve_args = node.serve_args("--device-count", "4")
    bootstrap_pod = Pod("hyperlight-device-access-a1")  # requests no device
    main_pod = Pod("hyperlight-device-plugin-b2", {ACCESS: 1})
    loop = asyncio.get_running_loop()
    async with emulator(node.plugin_dir) as kubelet:
        # Before the reboot: the node as installed.
        async with daemon(bootstrap_args):
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS, 30)
            await kubelet.admit_pod(main_pod)
            async with daemon(serve_args):
                await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR) == 4, 30)
        # The reboot: no container survives (both killed above); the kubelet comes up and
        # re-admits both pods at once.
        outcomes = await kubelet.reboot([bootstrap_pod, main_pod])
        assert outcomes[bootstrap_pod.name] is None
        failed = outcomes[main_pod.name]
        assert isinstance(failed, AdmissionError), "the main pod was admitted before its plugin ran"
        assert str(failed) == (f"UnexpectedAdmissionError: allocate failed for {ACCESS}: no devices: "
                               f"Allocate failed due to no healthy devices present; cannot allocate "
                               f"unhealthy devices {ACCESS}, which is unexpected")

        # The admitted bootstrap pod starts; until it registers, a replacement fails the same way.
        async with daemon(bootstrap_args) as bootstrap:
            with pytest.raises(AdmissionError, match="cannot allocate unhealthy devices"):
                await kubelet.admit_pod(Pod("hyperlight-device-plugin-c3", {ACCESS: 1}))
            await kubelet.wait_for(lambda: kubelet.allocatable(ACCESS) == ACCESS_SLOTS, 30)
            registered = loop.time()
            await kubelet.admit_pod(Pod("hyperlight-device-plugin-d4", {ACCESS: 1}))
            async with daemon(serve_args) as main:
                await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR) == 4, 30)
                serving = loop.time()
    print(f"\nafter the reboot: bootstrap started to registered "
          f"{registered - bootstrap.started:.2f} s (a replacement before that fails); "
          f"replacement admitted to {HYPERVISOR} allocatable {serving - main.started:.2f} s")
