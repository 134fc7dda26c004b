"""What a container runtime does with a CDI device name: find the spec of its kind, the device of
its name, and the device node its edits create. `hlplugin doctor --device-only` checks the spec
the daemon would write this way, as a workload's runtime would read it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hlplugin.deviceplugin.files import char_device


def device_node(spec: bytes, qualified: str) -> dict[str, Any]:
    """The one device node ``qualified`` (``vendor/class=name``) creates by ``spec``; ValueError
    saying what is missing when the spec does not declare it, or not as one node."""
    kind, _, name = qualified.partition("=")
    parsed = json.loads(spec)
    if parsed.get("kind") != kind:
        raise ValueError(f"the spec's kind is {parsed.get('kind')!r}, not {kind!r}")
    for device in parsed.get("devices", []):
        if device.get("name") == name:
            nodes = device.get("containerEdits", {}).get("deviceNodes", [])
            if len(nodes) != 1:
                raise ValueError(f"{qualified} creates {len(nodes)} device nodes, not one")
            return dict(nodes[0])
    raise ValueError(f"the spec declares no device {qualified}")


def resolves_to(spec: bytes, qualified: str, dev_dir: Path) -> str:
    """What ``qualified`` resolves to by ``spec``, checked against the node as this process sees
    it under ``dev_dir`` (a character device); ValueError saying what is wrong otherwise."""
    node = device_node(spec, qualified)
    host_path = Path(node.get("hostPath") or node["path"])
    seen = dev_dir / host_path.name
    try:
        st, problem = char_device(seen)
    except OSError as exc:
        raise ValueError(f"{qualified} names {host_path}, but {seen}: {exc.strerror}") from None
    if problem:
        raise ValueError(f"{qualified} names {host_path}, but {seen} is not a character device")
    return (f"{qualified} resolves to {host_path} ({os.major(st.st_rdev)}:{os.minor(st.st_rdev)}), "
            f"created {node['permissions']} for uid {node['uid']}, gid {node['gid']} in the "
            "container")
