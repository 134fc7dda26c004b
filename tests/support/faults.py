"""What the fault matrix's rows share (tests/test_faults*.py): a node root with a sibling spec and
mknod'd device views, the world's tools (replace, obstruct, workers that read the spec) and
`matrix_row`, one row's daemon on the kubelet emulator."""

from __future__ import annotations

import contextlib
import json
import os
import random
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import harness
from faultreport import KVM, Row, scenario
from harness import (
    Node,
    Rig,
    on_kubelet,
)

from hlplugin.cdi_spec import render_spec
from hlplugin.settings import CdiSettings

RESOURCE = "hyperlight.dev/hypervisor"
SOCKET = "hyperlight.sock"
COUNT = 16
SERVE = ("--hypervisor", "kvm", "--device-count", str(COUNT))
GUARD = 20.0  # seconds; only ever reached when something is broken
KVM_RDEV = os.stat(KVM).st_rdev if KVM.exists() else os.makedev(10, 232)
SIBLING = b'{"cdiVersion": "0.5.0", "kind": "vendor.example/gpu", "devices": []}\n'
# The exact content every repair must produce: what `hlplugin cdi --hypervisor kvm` prints (its
# output is tested in tests/test_config.py), rendered in process, not by a command run at import.
DESIRED = render_spec("kvm", CdiSettings.device_uid, CdiSettings.device_gid)


def fresh_node(root: Path, *, dev: bool = False) -> Node:
    """A node root whose CDI dir holds a sibling spec; with ``dev`` its own dev and host-dev dirs
    holding mknod'd KVM nodes."""
    views = [root / "dev", root / "host-dev"] if dev else []
    for d in views:
        d.mkdir(parents=True)
        harness.mknod_char(d / "kvm", KVM_RDEV)
    node = Node.make(root, *views)
    node.cdi_dir.mkdir(parents=True, exist_ok=True)
    (node.cdi_dir / "vendor-gpu.json").write_bytes(SIBLING)
    return node


def replace(path: Path, content: bytes | int) -> None:
    """Put bytes (or a character device with these numbers) at ``path`` with one rename: the
    daemon sees the old or the new entry, never a gap."""
    temp = path.with_name(f".fault-{os.getpid()}-{random.randrange(1 << 30)}")
    if isinstance(content, bytes):
        temp.write_bytes(content)
    else:
        os.mknod(temp, stat.S_IFCHR | 0o600, content)
    os.rename(temp, path)


def obstruct(path: Path, make: Callable[[Path], None]) -> None:
    """Put something that is not a regular file where our spec is: made beside it and renamed over
    it in one step (a directory cannot replace a file so: the harness's races the repairs)."""
    if make is os.mkdir:
        harness.obstruct_with_directory(path)
    else:
        make(path.with_name(path.name + ".obstruction"))
        os.rename(path.with_name(path.name + ".obstruction"), path)


def remove_obstruction(path: Path) -> None:
    (os.rmdir if path.is_dir() and not path.is_symlink() else os.unlink)(path)


_WORKER = r"""
import json, os, sys, time
mode, path, stop, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[5])
contents = {name: data.encode("latin-1") for name, data in json.loads(sys.argv[4]).items()}
label, counts, odd, n = {data: name for name, data in contents.items()}, {}, [], 0
temp = os.path.join(os.path.dirname(path), ".tamper-%d" % os.getpid())
while not os.path.exists(stop):
    if mode == "tamper":
        with open(temp, "wb") as f:
            f.write(contents["stale"])
        os.rename(temp, path)
        n += 1
        time.sleep(pause)  # the writer's pace: a process of the world
        continue
    for _ in range(1 if pause else 500):
        try:
            with open(path, "rb") as f:
                data = f.read()
            key = label.get(data, "torn")
            if key == "torn" and len(odd) < 5:
                odd.append(data[:120].decode(errors="replace"))
        except OSError as exc:
            key = "error " + (exc.strerror or str(exc))
        counts[key] = counts.get(key, 0) + 1
        if pause:
            time.sleep(pause)  # the reader's pace: a process of the world
print(json.dumps({"counts": counts, "odd": odd, "tampered": n}))
"""


@contextlib.contextmanager
def workers(root: Path, path: Path, contents: dict[str, bytes], readers: int, pause: float = 0.0,
            tamper: float | None = None) -> Iterator[dict[str, Any]]:
    """Reader processes that classify every read of ``path`` by ``contents``, pausing ``pause`` s
    between reads (and a tamperer writing ``contents["stale"]`` every ``tamper`` s); on a clean
    exit the yielded dict holds their merged counts."""
    stop = root / "workers.stop"
    known = json.dumps({name: data.decode("latin-1") for name, data in contents.items()})
    modes = [("read", pause)] * readers + ([] if tamper is None else [("tamper", tamper)])
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, mode, str(path), str(stop), known,
                               str(wait)], stdout=subprocess.PIPE) for mode, wait in modes]
    result: dict[str, Any] = {"counts": Counter(), "odd": [], "tampered": 0}
    try:
        yield result
        stop.touch()
        for proc in procs:
            out = json.loads(proc.communicate(timeout=30)[0])
            result["tampered"] += out["tampered"]
            result["odd"] += out["odd"]
            result["counts"].update(out["counts"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.asynccontextmanager
async def matrix_row(name: str, node: Node, *extra: str,
                     keep: Sequence[str] = ("vendor-gpu.json",)) -> AsyncIterator[tuple[Row, Rig]]:
    """One row of the matrix: its scenario, which keeps ``keep`` in the CDI dir byte-identical,
    and the daemon registered and healthy on a kubelet; on failure the daemon's last log lines."""
    with scenario(name, [node.cdi_dir / kept for kept in keep]) as row:
        async with on_kubelet(node, node.serve_args(*SERVE, *extra)) as (kubelet, proc):
            try:
                r = Rig(node, kubelet, proc, COUNT, DESIRED, guard=GUARD)
                await r.healthy()
                yield row, r
            except BaseException:
                print(f"--- hlplugin serve (pid {proc.pid}, exit {proc.exited()}), last log lines:",
                      *proc.raw[-40:], sep="\n", file=sys.stderr)
                raise
