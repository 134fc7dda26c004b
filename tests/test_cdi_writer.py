"""The DRA driver's one CDI spec writer per node (deviceplugin/kubelet/dra/writer.py, issue 38 item 2),
in process: real reconcilers, a real record and flock, real unix sockets standing for the
instances' service sockets (listening: a live instance; a socket file nobody listens on: a dead
one). tests/test_dra_daemon.py runs the hand-over between two driver processes."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from harness import short_dir
from support.cdi import DESIRED, STALE, Reconciler

from hlplugin.deviceplugin.health.producer import Trigger
from hlplugin.deviceplugin.kubelet.dra.writer import SharedWriter
from hlplugin.names import CDI_WRITER_FILE


class Instance:
    """One driver instance: its service socket's name, its writer record, its reconciler."""

    def __init__(self, plugin_dir: Path, cdi_dir: Path, name: str, desired: bytes = DESIRED,
                 **writer: float) -> None:
        self.endpoint = plugin_dir / name
        self.writer = SharedWriter(plugin_dir, CDI_WRITER_FILE, self.endpoint, **writer)
        self.rig = Reconciler(cdi_dir, turn=self.writer.turn)
        self.rig.rec.desired = desired
        self._server: socket.socket | None = None

    async def pass_(self) -> None:
        await self.rig.rec.reconcile(Trigger.DEMAND)

    def serve(self) -> None:
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.endpoint))
        self._server.listen(8)

    def die(self) -> None:
        """As SIGKILL leaves it: the socket file stays, nobody listens on it."""
        assert self._server is not None
        self._server.close()
        self._server = None


class Node:
    def __init__(self) -> None:
        root = short_dir()
        self.plugin_dir = root / "plugins"
        self.cdi_dir = root / "cdi"
        self.cdi_dir.mkdir()
        self.plugin_dir.mkdir()
        self.record = self.plugin_dir / CDI_WRITER_FILE
        self.spec = self.cdi_dir / "hyperlight.json"

    def instance(self, name: str, desired: bytes = DESIRED, **writer: float) -> Instance:
        return Instance(self.plugin_dir, self.cdi_dir, name, desired, **writer)

    def content(self) -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return self.spec.read_bytes()
        return None


async def test_an_instance_takes_over_from_no_writer_only_once_it_serves() -> None:
    """At start (not serving: the kubelet cannot know it yet) it only looks; once it answers on
    its socket, no live writer (none named, or a torn name) is taken over."""
    node = Node()
    node.record.write_bytes(b"\xff\0torn")  # what a crash in the middle of a claim could leave
    a = node.instance("dra-a.sock")
    await a.pass_()
    assert node.content() is None and a.rig.cdi.ok  # a look: "written when it takes over"
    a.serve()
    await a.pass_()
    assert node.content() == DESIRED and a.rig.repairs("missing") == 1
    assert node.record.read_bytes() == b"dra-a.sock\n"


async def test_the_instance_registered_last_writes_and_the_one_it_replaced_only_looks() -> None:
    node = Node()
    old, new = node.instance("dra-old.sock"), node.instance("dra-new.sock", STALE)
    old.serve()
    await old.pass_()
    assert node.content() == DESIRED
    new.serve()
    await new.pass_()  # serving, not registered: the old one is named and answers
    assert node.content() == DESIRED and new.rig.repairs("stale") == 0 and new.rig.cdi.ok
    new.writer.claim()  # the kubelet's NotifyRegistrationStatus(registered=true)
    await new.pass_()
    assert node.content() == STALE and new.rig.repairs("stale") == 1
    assert node.record.read_bytes() == b"dra-new.sock\n"
    for _ in range(3):  # the old one's passes, and the new one's after its claim: no fight
        await old.pass_()
        await new.pass_()
    assert node.content() == STALE and old.rig.repairs("stale") == 0 and old.rig.cdi.ok
    assert new.rig.repairs("stale") == 1
    # The writer dies: the instance still serving takes over at its next pass.
    new.die()
    await old.pass_()
    assert node.content() == DESIRED and old.rig.repairs("stale") == 1
    assert node.record.read_bytes() == b"dra-old.sock\n"


async def test_a_pass_that_cannot_get_the_lock_in_time_only_looks() -> None:
    """Another instance's pass holds the lock (writing, or hung in storage): we write nothing."""
    node = Node()
    a = node.instance("dra-a.sock", lock_wait=0.05)
    a.serve()
    with _locked(a.writer):
        await a.pass_()
        assert node.content() is None and a.rig.cdi.ok
    await a.pass_()
    assert node.content() == DESIRED


async def test_a_record_that_is_not_a_regular_file_fails_cdi_and_nothing_is_written() -> None:
    node = Node()
    target = node.plugin_dir / "elsewhere"
    target.write_bytes(b"dra-a.sock\n")
    node.record.symlink_to(target)
    a = node.instance("dra-a.sock")
    a.serve()
    await a.pass_()
    assert not a.rig.cdi.ok and node.content() is None
    assert a.rig.cdi.reason == (f"cannot tell which instance writes {node.spec}: {node.record} is "
                                f"a symlink (refusing to write)")
    assert node.record.is_symlink() and target.read_bytes() == b"dra-a.sock\n"


@contextlib.contextmanager
def _locked(writer: SharedWriter) -> Iterator[None]:
    """The record's flock, held as another instance's pass holds it (closing releases it)."""
    fd = writer.lock.try_acquire()
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)
