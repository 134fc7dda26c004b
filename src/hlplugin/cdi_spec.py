"""The CDI spec we own, as data: what it says, its exact bytes, and how to tell ours from others.

Pure functions, no I/O but check_file's one read: the reconciler (cdi.py) keeps the file equal to
render_spec(), doctor and the tests compare against it, and Allocate names qualified_name().
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hlplugin.deviceplugin.ownedfile import NotRegular, read_regular, temp_prefix
from hlplugin.names import HYPERVISOR_RESOURCE

SPEC_FILE = "hyperlight.json"
TEMP_PREFIX = temp_prefix(SPEC_FILE)  # what a crash of a repair may leave beside it
KIND = HYPERVISOR_RESOURCE
MODE = 0o644  # the spec file's own mode on the host (runtimes read it as root)
# Far larger than any spec we write; bounds what a foreign file can make us read or diff.
MAX_READ = 1 << 20


def qualified_name(hypervisor: str) -> str:
    """The fully qualified CDI device name that runtimes resolve, e.g. for Allocate."""
    return f"{KIND}={hypervisor}"


# Consumers reject a cdiVersion newer than they know (podman 4.3 rejects 0.6.0) and one older than
# the fields a spec uses need. Every field we write (fileMode included) is in the spec since its
# first tagged release, 0.3.0. test_cdi_version_covers_every_field_we_write and the podman tests
# (podman 4.3.1 resolves our spec) guard this.
CDI_VERSION = "0.3.0"
# The mode of the node *in the container* (the host's node is untouched). Stated because runtimes
# disagree when it is missing: runc, under podman, makes it 0666; containerd 2.x copies the host's
# mode (0600 or 0660 root:kvm), so a workload whose UID is not DEVICE_UID gets EACCES. 0666 lets
# any UID in the container open the one device it was allocated: the container's /dev is its own,
# the device cgroup admits this node only, and nothing else becomes reachable.
DEVICE_FILE_MODE = 0o666


def desired_spec(hypervisor: str, uid: int, gid: int) -> dict[str, Any]:
    """One device, ``<hypervisor>``: its node (owned by uid/gid, mode 0666), and two env vars."""
    device_path = f"/dev/{hypervisor}"
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": hypervisor,
            "containerEdits": {
                # JSON has no octal: fileMode is Go's os.FileMode, a decimal number (438).
                "deviceNodes": [{"path": device_path, "type": "c", "permissions": "rw",
                                 "fileMode": DEVICE_FILE_MODE, "uid": uid, "gid": gid}],
                "env": [f"HYPERLIGHT_HYPERVISOR={hypervisor}",
                        f"HYPERLIGHT_DEVICE_PATH={device_path}"],
            },
        }],
    }


def render_spec(hypervisor: str, uid: int, gid: int) -> bytes:
    """Deterministic bytes (fixed key order, indent 2, trailing newline): equal means unchanged."""
    return (json.dumps(desired_spec(hypervisor, uid, gid), indent=2) + "\n").encode()


def check_file(path: Path, desired: bytes) -> tuple[bool, str]:
    """(True, "") when ``path`` holds exactly ``desired``; else (False, what differs).

    Content only: mode and owner depend on who runs the check.
    """
    try:
        found = read_regular(path, MAX_READ)
    except NotRegular as exc:
        return False, f"{path} is not a regular file ({exc})"
    except OSError as exc:
        return False, f"{path} cannot be read: {exc.strerror}"
    if found is None:
        return False, f"{path} is missing"
    content, _ = found
    if content == desired:
        return True, ""
    import difflib  # only a difference needs it: not loaded by a daemon's start

    diff = difflib.unified_diff(
        desired.decode(errors="replace").splitlines(keepends=True),
        content.decode(errors="replace").splitlines(keepends=True),
        fromfile="desired", tofile=str(path))
    return False, "".join(diff) or f"{path} differs from the desired content"


def _list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) for v in value)


def _edits_well_formed(edits: Any) -> bool:
    if not isinstance(edits, dict) or not _list_of(edits.get("env", []), str):
        return False
    if not all(_list_of(edits.get(k, []), dict)
               for k in ("deviceNodes", "mounts", "hooks", "netDevices")):
        return False
    for node in edits.get("deviceNodes", []):
        if not isinstance(node.get("path"), str):
            return False
        if any(k in node and not isinstance(node[k], str)
               for k in ("type", "permissions", "hostPath")):
            return False
        if any(k in node and type(node[k]) is not int for k in ("uid", "gid", "major", "minor", "fileMode")):
            return False
    return True


def well_formed(content: bytes) -> bool:
    """Enough of the CDI shape to tell a stale spec from garbage (only for the repair metric)."""
    try:
        doc = json.loads(content)
    except ValueError:
        return False
    if not isinstance(doc, dict) or not isinstance(doc.get("cdiVersion"), str):
        return False
    if not isinstance(doc.get("kind"), str) or not _list_of(doc.get("devices"), dict):
        return False
    if not all(isinstance(d.get("name"), str) and _edits_well_formed(d.get("containerEdits"))
               for d in doc["devices"]):
        return False
    return "containerEdits" not in doc or _edits_well_formed(doc["containerEdits"])
