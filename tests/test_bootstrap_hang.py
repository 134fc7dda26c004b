"""Hung /dev under the bootstrap: its Allocate re-checks the node off the event loop.

The node watch's pass runs in a BoundedRunner; Allocate asks that producer for a fresh pass rather
than stat'ing the node itself, so a /dev that stops answering costs a refusal within the budget,
never a frozen event loop (which would fail liveness and take every other call down with it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from pathlib import Path

import grpc
import pytest
from fusefs import HangingFs
from harness import Node, needs_kvm, needs_root, on_kubelet

from hlplugin.bootstrap import SLOTS as ACCESS_SLOTS
from hlplugin.names import DEVICE_ACCESS_RESOURCE
from hlplugin.settings import HealthSettings
from hlplugin.tools.emulator import AdmissionError

BUDGET = HealthSettings.probe_timeout  # the node check's budget (the bootstrap takes no flag for it)
PROMPT = BUDGET + 2.0  # a guard: a refusal that waited for the storage would never come


@needs_root
@needs_kvm
@pytest.mark.guard(60)
async def test_allocate_on_a_hung_dev_refuses_within_the_budget_and_stays_live(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    kvm = os.stat("/dev/kvm").st_rdev
    with HangingFs(tmp_path / "fuse-dev", "kvm", stat.S_IFCHR | 0o600, rdev=kvm) as fs:
        # The periodic recheck (10 s) is far away: only Allocate's own check meets the hang.
        args = ["bootstrap", "--plugin-dir", str(node.plugin_dir), "--dev-dir", str(fs.mountpoint)]
        async with on_kubelet(node, args) as (kubelet, proc):
            try:
                await kubelet.wait_for(lambda: kubelet.allocatable(DEVICE_ACCESS_RESOURCE) == ACCESS_SLOTS)
                await kubelet.admit(DEVICE_ACCESS_RESOURCE)  # the node answers: granted
                fs.hang()
                loop = asyncio.get_running_loop()
                began = loop.time()
                with pytest.raises(AdmissionError) as refused:
                    await kubelet.allocate(DEVICE_ACCESS_RESOURCE, [["device-access-kvm"]],
                                           timeout=PROMPT)
                took = loop.time() - began
                assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value
                assert "cannot grant /dev/kvm" in refused.value.details, refused.value.details
                assert f"timed out after {BUDGET:.1f}s" in refused.value.details, \
                    refused.value.details
                assert BUDGET * 0.9 <= took < PROMPT, took
                assert fs.pending == 1  # one helper stuck in the kernel, the loop free
                code, body = await proc.http("/healthz")
                assert code == 200, body
                # The failed pass withdraws the slot.
                await kubelet.wait_for(lambda: kubelet.allocatable(DEVICE_ACCESS_RESOURCE) == 0)
            finally:
                fs.release()
            # Once /dev answers, the next Allocate's own check grants (the one slot went to the
            # pod admitted above, so the plugin is asked directly) and restores the slot, long
            # before the periodic recheck would.
            granted = await kubelet.allocate(DEVICE_ACCESS_RESOURCE, [["device-access-kvm"]])
            assert [d.host_path for d in granted.container_responses[0].devices] == ["/dev/kvm"]
            await kubelet.wait_for(lambda: kubelet.allocatable(DEVICE_ACCESS_RESOURCE) == ACCESS_SLOTS, 5)
            assert await proc.signal(signal.SIGTERM, timeout=10) == 0
