"""What the DRA driver's checkpoint holds for one claim (an Entry, checked field by field when
read), and the Pin that tells whether the record's file is still the one this instance last read
or wrote: the pieces of claims.ClaimPreparer's record that need no event loop."""

from __future__ import annotations

import os
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlplugin.deviceplugin.kubelet.dra.draservice import ClaimRef, PreparedDevice


class Pin:
    """The record's file as this instance last read or wrote it, held open (O_PATH, no I/O) so its
    inode cannot be freed and its number handed to another file while we compare against it.

    Every write of the record (ours or another instance's) is a new file exchanged into place,
    never an edit in place, so "the file at the path is still this inode, with the size, mtime and
    ctime we saw" means "the record is still the one our memory holds". ``current()`` is one
    lstat(2) of a path in the node's local plugin directory, answered from the kernel's caches:
    cheap enough for the event loop, as Endpoint.ours() is.
    """

    def __init__(self, path: Path, fd: int, st: os.stat_result) -> None:
        self.path = path
        self._key = _key(st)
        self._close = weakref.finalize(self, os.close, fd)  # also when a timed-out read drops it

    @classmethod
    def take(cls, path: Path) -> Pin | None:
        """The regular file at ``path`` now, or None (missing, not a regular file, not to be
        opened: never followed, never opened for I/O, so a FIFO cannot block). None only costs
        the next Prepare the locked path."""
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return cls(path, fd, st)

    def current(self) -> bool:
        try:
            return _key(os.lstat(self.path)) == self._key
        except OSError:
            return False

    def close(self) -> None:
        self._close()


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Entry:
    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.claim.namespace, "name": self.claim.name,
                "devices": [{"requests": list(d.requests), "pool": d.pool, "device": d.device,
                             "ids": list(d.ids), "share": d.share} for d in self.devices]}


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of strings")
    return tuple(value)


def entry(uid: str, value: Any) -> Entry:
    """One checkpoint entry, checked field by field: a checksum proves the bytes are the ones we
    wrote, not that a future or past version wrote the same shape."""
    if not isinstance(value, dict):
        raise ValueError("not an object")
    devices = []
    for device in value["devices"]:
        pool, name, share = device["pool"], device["device"], device["share"]
        if not all(isinstance(v, str) for v in (pool, name, share)):
            raise ValueError("pool, device and share must be strings")
        devices.append(PreparedDevice(_strings(device["requests"]), pool, name,
                                      _strings(device["ids"]), share))
    namespace, name = value["namespace"], value["name"]
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise ValueError("namespace and name must be strings")
    return Entry(ClaimRef(namespace, uid, name), tuple(devices))
