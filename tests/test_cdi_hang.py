"""Hung CDI storage: the CDI directory on a FUSE filesystem that stops answering.

Every pass over the spec runs in the reconciler's BoundedRunner, so storage that hangs costs one
stuck helper thread and a failing ``cdi`` condition naming the timeout, never a hung event loop,
an Allocate queued behind a lock, a failed liveness probe or a daemon that cannot stop.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest
from fusefs import HangingFileFs
from harness import Node, needs_kvm, needs_root, on_kubelet, wait_until

from hlplugin.cdi import DEFAULT_BUDGET, SPEC_FILE, render_spec
from hlplugin.config import Settings
from hlplugin.emulator import AdmissionError
from hlplugin.names import HYPERVISOR_RESOURCE, HYPERVISOR_SOCKET

INTERVAL = 1.0  # --cdi-interval: the periodic pass that first meets the hang
PROMPT = 1.0  # a guard for "at once": an Allocate that waited for the storage would take the budget


@needs_root
@needs_kvm
@pytest.mark.guard(60)
async def test_hung_cdi_storage_fails_cdi_within_its_budget_and_the_daemon_stays_up(
        tmp_path: Path) -> None:
    node = Node.make(tmp_path)
    defaults = Settings()
    desired = render_spec("kvm", defaults.device_uid, defaults.device_gid)
    with HangingFileFs(node.cdi_dir, SPEC_FILE, desired) as fs:
        args = node.serve_args("--hypervisor", "kvm", "--cdi-interval", str(INTERVAL))
        async with on_kubelet(node, args) as (kubelet, proc):
            await kubelet.wait_for(lambda: kubelet.allocatable(HYPERVISOR_RESOURCE) > 0, 20)
            await kubelet.allocate(HYPERVISOR_RESOURCE, [["kvm-0"]])  # served from FUSE: right
            assert fs.requests > 0

            fs.hang()
            loop = asyncio.get_running_loop()
            hung = loop.time()

            def cdi_failed() -> bool:
                return any(m.startswith("condition cdi is unhealthy") for m in proc.messages())

            # The next periodic pass meets the hang and gives up after its budget; the guard is
            # that plus one interval and slack for a loaded machine.
            await wait_until(cdi_failed, INTERVAL + DEFAULT_BUDGET + 10, "condition cdi to fail")
            failed_after = loop.time() - hung
            ready = json.loads(await proc.wait_http("/readyz", 503))
            reason = ready["conditions"]["cdi"]["reason"]
            assert not ready["conditions"]["cdi"]["ok"]
            assert f"timed out after {DEFAULT_BUDGET:.1f}s" in reason or "still stuck" in reason, \
                reason
            assert str(node.cdi_dir / SPEC_FILE) in reason
            assert failed_after >= DEFAULT_BUDGET * 0.9, failed_after  # it did wait its budget
            assert fs.pending >= 1  # the helper is still stuck in the kernel

            began = loop.time()
            with pytest.raises(AdmissionError) as refused:
                await kubelet.allocate(HYPERVISOR_RESOURCE, [["kvm-0"]], timeout=DEFAULT_BUDGET * 2)
            took = loop.time() - began
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value
            assert "cdi: cannot check" in refused.value.details, refused.value.details
            assert took < PROMPT, took

            code, body = await proc.http("/healthz")
            assert code == 200, body

            # SIGTERM: the daemon stops at once (its socket is gone); the process itself can only
            # be reaped once the kernel lets the stuck helper go (a FUSE request already read by
            # the server waits uninterruptibly), so the filesystem answers before we reap it.
            try:
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGTERM)
                await wait_until(lambda: not (node.plugin_dir / HYPERVISOR_SOCKET).exists(), 10,
                                 "the daemon to stop serving")
                assert "hlplugin serve stopping" in proc.messages()
            finally:
                fs.release()
            assert await proc.signal(signal.SIGTERM, timeout=10) == 0
