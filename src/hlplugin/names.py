"""The names Hyperlight's two daemons are known by: their resources and their sockets.

Declared once here; the daemons, the CDI spec's kind, the CLI's path check and the demo read them.
"""

from __future__ import annotations

from enum import StrEnum

# The main plugin's resource, which is also the CDI kind of the spec it writes.
HYPERVISOR_RESOURCE = "hyperlight.dev/hypervisor"
HYPERVISOR_SOCKET = "hyperlight.sock"
# The bootstrap daemon's: one slot that grants the hypervisor node to the main daemon's pod.
DEVICE_ACCESS_RESOURCE = "hyperlight.dev/device-access"
DEVICE_ACCESS_SOCKET = "hyperlight-device-access.sock"
# The DRA driver's name (its ResourceSlices, DeviceClass selector and plugin registration).
DRA_DRIVER = "hyperlight.dev"


def dra_socket_names(pod_uid: str) -> tuple[str, str]:
    """The DRA driver's (registration, service) socket names: per pod, so the two pods of a
    surging upgrade each have theirs (the Go helper's names, k8s.io/dynamic-resource-allocation
    kubeletplugin); without a UID, fixed ones."""
    if pod_uid:
        return f"{DRA_DRIVER}-{pod_uid}-reg.sock", f"dra-{pod_uid}.sock"
    return f"{DRA_DRIVER}-reg.sock", "dra.sock"


# In the DRA driver's directory: which of its instances writes the CDI spec (the one the kubelet
# registered last), and the lock every instance's CDI pass holds (deviceplugin/kubelet/dra/writer.py).
CDI_WRITER_FILE = "cdi-writer"


# What to look at when a machine has no hypervisor device, or one that does not work.
NO_HYPERVISOR_HINT = ("is the kvm module loaded (modprobe kvm_intel or kvm_amd), virtualisation "
                      "turned on in the firmware, and, in a virtual machine, nested virtualisation "
                      "enabled?")
# How operators choose the kubelet's device-plugins directory: the hints in the daemons' messages
# name it.
PLUGIN_DIR_FLAG = "--plugin-dir"
REGISTRY_DIR_FLAG = "--registry-dir"  # the DRA driver's: the kubelet's plugins_registry


class ConditionName(StrEnum):
    """The health conditions the daemons' producers keep (each producer declares its own in
    CONDITIONS; a daemon's tracker requires exactly its producers'): /readyz keys, the
    ``condition`` label, and the words of every "condition X is unhealthy" line."""

    CDI = "cdi"
    DEVICE = "device"
    HOST_IDENTITY = "host_identity"


# The longer socket name: what bounds how long the plugin directory's path may be.
LONGEST_SOCKET = max(HYPERVISOR_SOCKET, DEVICE_ACCESS_SOCKET, key=len)
