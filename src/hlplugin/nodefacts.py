"""What this node's one DRA device says of itself (the attributes of its ResourceSlice device, a
DeviceClass's or a claim's selector reads them), and where the node tells us.

Standard library and the prober only, no API client: read once at the driver's start, since none
of it changes while the node runs (a node moved to another hypervisor restarts its pods).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlplugin import probe

log = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class NodeDevice:
    """The device's facts, as attributes a claim's CEL selector reads
    (``device.attributes["hyperlight.dev"].hypervisor == "kvm"``): unqualified names are in the
    driver's own domain. An unknown fact (None, "") is left out rather than guessed."""

    hypervisor: str
    kvm_api_version: int | None = None
    node_is_virtual: bool | None = None
    cpu_vendor: str = ""

    def attributes(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {"hypervisor": {"string": self.hypervisor}}
        if self.kvm_api_version is not None:
            found["kvmApiVersion"] = {"int": self.kvm_api_version}
        if self.node_is_virtual is not None:
            found["nodeIsVirtual"] = {"bool": self.node_is_virtual}
        if self.cpu_vendor:
            found["cpuVendor"] = {"string": self.cpu_vendor}
        return found


def cpu_facts(text: str) -> tuple[str, bool | None]:
    """(vendor, is a virtual machine) from /proc/cpuinfo's first processor: ``vendor_id``
    (GenuineIntel, AuthenticAMD; arm64 has none) and the ``hypervisor`` flag the kernel sets when
    the CPU runs under one (x86's CPUID bit; arm64 has no such flag: unknown there)."""
    vendor, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags" and flags is None:
            flags = value.split()
        elif not line.strip() and (vendor or flags is not None):
            break  # the first processor's block is enough: they all say the same
    return vendor, None if flags is None else "hypervisor" in flags


def read_node_device(hypervisor: str, dev_dir: Path, cpuinfo: Path = CPUINFO) -> NodeDevice:
    """The facts of this node: the KVM API version asked of the device itself (the prober's
    first step; mshv has none), the CPU's vendor and whether the node is a VM from cpuinfo. A
    fact that cannot be read is logged and left out of the slice."""
    version = None
    if hypervisor == "kvm":
        try:
            version = probe.kvm_api_version(dev_dir / "kvm")
        except probe.ProbeError as exc:
            log.warning("the slice's device has no kvmApiVersion attribute: %s", exc)
    try:
        vendor, virtual = cpu_facts(cpuinfo.read_text(errors="replace"))
    except OSError as exc:
        log.warning("the slice's device has no cpuVendor or nodeIsVirtual attribute: %s", exc)
        vendor, virtual = "", None
    return NodeDevice(hypervisor, version, virtual, vendor)
