"""The DRA driver's control-plane side as `hlplugin dra` runs it: this node's ResourceSlice kept
by ``slices.SliceController``, one more root task of the driver, beside its kubelet side.

Imported by hlplugin.dra only when the driver runs in a cluster (hlplugin.dra.driver.cluster_api): the
API client's wing (hlplugin.kubeapi) and the controller cost a driver run by hand nothing, not
even their import (tests/test_lean_imports.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hlplugin.deviceplugin.health.conditions import HealthState, HealthTracker
from hlplugin.dra.slices import SliceController
from hlplugin.kubeapi import Client, Config
from hlplugin.nodefacts import read_node_device


class Slices:
    """This node's slice: ``run`` is the root task, ``condition`` the driver's /readyz note."""

    def __init__(self, api: Config, node: str, hypervisor: str, dev_dir: Path, *, slots: int,
                 tracker: HealthTracker) -> None:
        self.api, self.node, self.hypervisor, self.dev_dir = api, node, hypervisor, dev_dir
        self.slots, self.tracker = slots, tracker
        self.controller: SliceController | None = None

    def condition(self) -> tuple[bool, str]:
        if self.controller is None:
            return False, "reading the node's facts for the slice's device"
        return self.controller.condition()

    async def run(self) -> None:
        """Read the device's facts, then keep the slice until cancelled (it is never deleted).

        The facts are read in a helper thread: asking the device its KVM API version is an
        ioctl, which a hung kernel may never answer, and the kubelet side must keep serving
        meanwhile (the device monitor says such a device is unhealthy)."""
        device = await asyncio.to_thread(read_node_device, self.hypervisor, self.dev_dir)
        # The device's health is the proofs' (the CDI spec, the device check, its identity), as
        # the gate before every Prepare reads it: a device that would refuse new claims is
        # tainted, so the scheduler allocates it none; health back is the taint removed.
        controller = SliceController(Client(self.api), self.node, device, slots=self.slots,
                                     healthy=self.tracker.state.healthy)
        self.tracker.add_listener(lambda _old, new: self._health(controller, new))
        self.controller = controller
        await controller.run()

    @staticmethod
    def _health(controller: SliceController, state: HealthState) -> None:
        controller.set_healthy(state.healthy)
