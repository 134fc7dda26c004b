"""Which instance of a plugin-watcher plugin writes a file that every instance keeps (a DRA
driver's container-device spec): the one the kubelet registered last.

During a surge the old and the new pod of a DRA driver both run, both registered (per-pod socket
names), and the kubelet calls the newest. Their releases may render the shared file differently
(a changed setting), and two writers would rewrite it in turn, each write waking the other.
The device plugin has a socket only one instance can hold (role.py); a plugin-watcher plugin has
none, so the instances agree through one small file in their shared directory:

- Its content names the writer: the file name of its service socket (its endpoint).
- Every pass of every instance takes an exclusive flock(2) on it for the whole pass (read the
  name, decide, write the shared file or only look): a write happens only under the lock, by the
  instance named in it at that moment. So there is never a second writer, not even while the
  name changes (a pass of the old writer in flight finishes before the new one's begins).
- The kubelet's NotifyRegistrationStatus(registered) is the hand-over point: ``claim()`` makes
  the instance's next pass name itself, whoever was named; from then on it writes, and the one
  it replaced only looks (its next pass reads the new name). The kubelet calls the newest
  registered plugin, so the file is what the instance answering the kubelet renders.
- Crashes: a name whose socket nobody answers on (the writer exited, was killed, never served;
  a torn or empty record) is no writer, and the next pass of an instance that itself answers
  on its socket takes over. An instance that does not serve yet (its first pass, at start) never
  takes over from anyone: two instances starting at once cannot take it from each other in turn.
  One that cannot tell (a socket it may not connect to) leaves the writer be.

The lock file is never removed (a removed lock file would let two instances each lock a file of
their own), nor is anything but a regular file at its name used (checkpoint.InstanceLock).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from hlplugin.deviceplugin.kubelet.dra.checkpoint import InstanceLock
from hlplugin.deviceplugin.kubelet.endpoint import find_holder
from hlplugin.deviceplugin.ownedfile import NotRegular

LOCK_WAIT = 1.0  # seconds a pass waits for another instance's pass; then it only looks
_POLL = 0.005
_MAX_NAME = 255  # NAME_MAX: more is a torn or foreign record


class SharedWriter:
    """The node-wide writer record of ``directory/name``, as seen by the instance serving
    ``endpoint`` (a socket in ``directory``)."""

    def __init__(self, directory: Path, name: str, endpoint: Path, *,
                 lock_wait: float = LOCK_WAIT) -> None:
        self.lock = InstanceLock(directory, name)
        self.path = self.lock.path
        self.directory = directory
        self.me = endpoint.name
        self._lock_wait = lock_wait
        self._claims = 0  # registrations the kubelet notified (counted on the event loop)
        self._claimed = 0  # of those, the ones a pass has acted on (in the pass's thread)

    def claim(self) -> None:
        """The kubelet registered us: our next pass names us the writer, whoever was."""
        self._claims += 1

    @contextlib.contextmanager
    def turn(self) -> Iterator[bool]:
        """In a pass's thread, around the whole pass: True when this instance writes. Another
        instance's pass that holds the lock past ``lock_wait``: False (it is writing, or hangs in
        storage; we only look). Raises NotRegular or OSError when the lock file cannot be used."""
        fd = self._acquire()
        if fd is None:
            yield False
            return
        try:
            yield self._decide(fd)
        finally:
            os.close(fd)

    def _acquire(self) -> int | None:
        deadline = time.monotonic() + self._lock_wait
        while (fd := self._try()) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL)
        return fd

    def _try(self) -> int | None:
        """The lock's descriptor, or None while another instance holds it; errors name the file."""
        try:
            return self.lock.try_acquire()
        except NotRegular as exc:
            raise NotRegular(f"{self.path} is {exc}") from None
        except OSError as exc:
            raise OSError(exc.errno, f"cannot lock {self.path}: {exc.strerror}") from None

    def _decide(self, fd: int) -> bool:
        named = _name(os.pread(fd, _MAX_NAME + 2, 0))
        claims = self._claims
        if claims > self._claimed:
            self._claimed = claims
        elif named == self.me:
            return True
        elif named and self._answers(named):
            return False
        elif not self._answers(self.me):
            return False  # not serving yet: we may not be the instance the kubelet will call
        if named != self.me:
            os.ftruncate(fd, 0)  # a crash between these two leaves no name: no writer
            os.pwrite(fd, self.me.encode() + b"\n", 0)
        return True

    def _answers(self, name: str) -> bool:
        """A live process serves the socket ``name`` in our directory; so is one we cannot ask
        (EACCES...): a writer we cannot tell dead is left be."""
        try:
            holder = find_holder(self.directory / name)
        except OSError:
            return True
        if holder is None:
            return False
        holder.close()
        return True


def _name(content: bytes) -> str:
    """The writer's socket name in a record; "" for none, or for what no instance writes."""
    try:
        name = content.decode("ascii").strip()
    except UnicodeDecodeError:
        return ""
    if (not name or len(name) > _MAX_NAME or name in (".", "..")
            or any(c in name for c in "/\0\n")):
        return ""
    return name
