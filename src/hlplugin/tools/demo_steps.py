"""The demo's parts that are not its walk (tools/demo.py): the "why" lines and how they are said,
the daemons as the demo runs them, and small helpers (node root, command lines, durations, finding
a CDI device as a runtime does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from hlplugin import config
from hlplugin.deviceplugin import files
from hlplugin.names import LONGEST_SOCKET
from hlplugin.tools.process import DaemonProcess

T = TypeVar("T")

WIDTH = 100

# One line per step on why it happens, for someone who has never seen a device plugin.
WHY = {
    "intro": "a device plugin is a daemon on each node that tells the kubelet, over a unix socket, how "
             "many units of a resource the node has, and answers Allocate when a pod is given one",
    "start": "no cluster is needed: the emulator speaks the kubelet's device-plugin gRPC API and follows "
             "its rules, and the daemons are the same processes the DaemonSets run",
    "capacity": "the 2,000 slots are not 2,000 devices: each one is the same /dev/kvm, and the count "
                "(DEVICE_COUNT) only caps how many containers on the node may hold it at once",
    "bootstrap": "the bootstrap daemon's three hyperlight.dev/device-access units are for the main "
                 "daemon's own pods (the running one, during an upgrade its successor, and one "
                 "still terminating when a rollback comes before the upgrade finished): that "
                 "is how the main daemon gets the device to test without privilege",
    "allocate": "CDI (Container Device Interface) is a JSON file on the node that describes devices by "
                "name; the plugin answers with a name and the container runtime does the rest",
    "use": "this is what a workload's container gets: the runtime reads the CDI spec, creates the device "
           "node and allows it; opening it (and, on KVM, running a guest) proves it works",
    "repair": "the runtime reads that file at every container start, so a deleted or damaged spec would "
              "break new pods: the daemon watches it and rewrites it atomically",
    "grant": "this is the bootstrap daemon's only answer: the hypervisor node, read/write, nothing else",
    "stop": "at an upgrade or a pod deletion the container runtime sends SIGTERM: each daemon removes "
            "its socket and exits 0, and the CDI spec stays for containers already running",
}


class DemoError(Exception):
    """A step that should have worked did not; the demo stops and cleans up."""


class DemoDaemon(DaemonProcess):
    """A demo daemon: the user's HYPERLIGHT_* and DEVICE_* variables must not change the demo."""

    def __init__(self, name: str, args: list[str]) -> None:
        twins = {o.env for o in config.OPTIONS.values() if o.env}
        super().__init__(args, name=name,
                         env={k: v for k, v in os.environ.items() if k not in twins})

    @classmethod
    def pair(cls, plugin_dir: Path, cdi_dir: Path, dev_dir: Path,
             hypervisor: str) -> tuple[DemoDaemon, DemoDaemon]:
        """The main daemon and the bootstrap on one node root, ``dev_dir`` as the host view too."""
        dev = str(dev_dir)
        serve = cls("hlplugin serve", [
            "serve", "--plugin-dir", str(plugin_dir), "--cdi-dir", str(cdi_dir), "--dev-dir", dev,
            "--host-dev-dir", dev, "--hypervisor", hypervisor])
        boot = cls("hlplugin bootstrap", [
            "bootstrap", "--plugin-dir", str(plugin_dir), "--dev-dir", dev, "--hypervisor", hypervisor])
        return serve, boot

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        code, body = await self.get("/readyz")
        try:
            return code, dict(json.loads(body))
        except ValueError:
            return code, {}

    async def metric(self, family: str, **labels: str) -> float | None:
        _, body = await self.get("/metrics")
        for metric in text_string_to_metric_families(body.decode()):
            for sample in metric.samples:
                if sample.name == family and all(sample.labels.get(k) == v
                                                 for k, v in labels.items()):
                    return float(sample.value)
        return None

    def logged(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((line for line in self.lines if predicate(line)), None)


class Narration:
    """The demo's voice: numbered steps, indented items, a "why" line per step, what could not be
    done, and timings for the summary."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.timings: list[tuple[str, float]] = []
        self.missing: list[str] = []  # what could not be done, for the summary
        self.step_number = 0

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def step(self, title: str) -> None:
        self.step_number += 1
        self.say(f"\n{self.step_number}. {title}")

    def item(self, text: str) -> None:
        self.say(f"   {text}")

    def why(self, key: str) -> None:
        self.say(textwrap.fill(WHY[key], WIDTH, initial_indent="   why: ",
                               subsequent_indent="        "))

    def cannot(self, what: str, why: str) -> None:
        self.missing.append(what)
        self.item(f"could not {what}: {why}")

    async def timed(self, label: str, work: Awaitable[T]) -> T:
        """Await ``work``; its duration goes to the summary when it succeeds."""
        started = time.monotonic()
        result = await work
        self.timings.append((label, time.monotonic() - started))
        return result


def resolve(cdi_dir: Path, qualified: str) -> tuple[Path, dict[str, Any]]:
    """Find ``vendor/class=name`` the way a CDI runtime does: the spec of that kind, the device of
    that name."""
    kind, _, name = qualified.partition("=")
    for path in sorted(cdi_dir.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            spec = json.loads(path.read_bytes())
            if spec.get("kind") != kind:
                continue
            for device in spec.get("devices", []):
                if device.get("name") == name:
                    return path, dict(device)
    raise DemoError(f"no CDI spec in {cdi_dir} declares {qualified}")


def make_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="hlplugin-demo-"))
    if files.socket_path_problem(root / "device-plugins", LONGEST_SOCKET):
        root.rmdir()  # a long TMPDIR: unix socket paths are capped, /tmp is short
        root = Path(tempfile.mkdtemp(prefix="hlplugin-demo-", dir="/tmp"))
    return root


def command_line(argv: list[str], prefix: str) -> str:
    """``argv`` as a shell command to paste: each option with its value on a line of its own."""
    words = [shlex.quote(word) for word in argv]
    first = next((i for i, w in enumerate(words) if w.startswith("--")), len(words))
    lines = [" ".join(words[:first])]
    for word in words[first:]:
        if word.startswith("--"):
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    indent = " " * len(prefix) + "    "
    return prefix + f" \\\n{indent}".join(lines)


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
