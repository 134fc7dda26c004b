"""A plugin's own record of what it did, kept across restarts: one JSON file, written atomically
(ownedfile: temp file, fsync, exchange, never over what is not ours), versioned and checksummed,
and read whole or not at all.

The file is ``{"kind": K, "version": 1, "checksum": "sha256:<hex>", "entries": {...}}``; the
checksum is over the entries' canonical JSON (sorted keys, no spaces), so a torn, truncated or
hand-edited file is told from a good one. A file that is there and is not exactly that (not a
regular file, too large, not JSON, another kind, another version, a checksum that does not match)
raises Corrupt with the reason: the caller refuses loudly and leaves the file as it is for the
operator. Nothing of it is ever used, so nothing is half-read. A missing file is an empty record.

Several instances of a plugin may keep one record (the old and the new pod of a surging upgrade,
both serving the kubelet): InstanceLock, an flock(2) beside it, is held across each
read-modify-write, and the record is read anew under it, so no instance writes over what another
recorded.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hlplugin.deviceplugin.files import kind_of
from hlplugin.deviceplugin.ownedfile import NotRegular, OwnedFile

VERSION = 1
# A DRA claim's entry is about 300 bytes: 8 MiB holds some 25,000, far more than a node prepares.
MAX_BYTES = 8 << 20
MODE = 0o600  # only the plugin (root) reads it


class Corrupt(Exception):
    """The file is there and cannot be trusted; ``str()`` says why, naming the file."""


def _digest(entries: Mapping[str, Any]) -> str:
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def encode(kind: str, entries: Mapping[str, Any]) -> bytes:
    """The file's bytes for ``entries`` (JSON values only)."""
    document = {"kind": kind, "version": VERSION, "checksum": _digest(entries), "entries": entries}
    return (json.dumps(document, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode()


def decode(kind: str, content: bytes, where: str = "checkpoint") -> dict[str, Any]:
    """The entries of a file of ``kind``; raises Corrupt saying what is wrong with it."""
    try:
        document = json.loads(content)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Corrupt(f"{where} is not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(document, dict) or document.get("kind") != kind:
        found = document.get("kind") if isinstance(document, dict) else type(document).__name__
        raise Corrupt(f"{where} is not a {kind} checkpoint (kind {str(found)[:40]!r})")
    version = document.get("version")
    if version != VERSION:
        newer = " (written by a newer version: roll forward, or move it aside)" if (
            isinstance(version, int) and version > VERSION) else ""
        raise Corrupt(f"{where} has version {str(version)[:20]!r}, this one reads {VERSION}{newer}")
    entries = document.get("entries")
    if not isinstance(entries, dict):
        raise Corrupt(f"{where} has no entries object")
    if document.get("checksum") != _digest(entries):
        raise Corrupt(f"{where} does not match its checksum (torn or edited)")
    return entries


class Checkpoint:
    """``directory/name``: ``load()`` the entries (empty when missing), ``save()`` them anew.
    Blocking: run it off the event loop, one call at a time."""

    def __init__(self, directory: Path, name: str, kind: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.file = OwnedFile(directory, name, MODE)
        self.path = self.file.path
        self.kind = kind
        self.max_bytes = max_bytes

    def load(self) -> dict[str, Any]:
        """Raises Corrupt, or OSError when it cannot be read at all (EIO, EACCES, ...)."""
        try:
            found = self.file.read(self.max_bytes + 1)
        except NotRegular as exc:
            raise Corrupt(f"{self.path} is {exc}, not a checkpoint file; left as it is") from None
        if found is None:
            return {}
        content, _ = found
        if len(content) > self.max_bytes:
            raise Corrupt(f"{self.path} is larger than {self.max_bytes} bytes")
        return decode(self.kind, content, str(self.path))

    def save(self, entries: Mapping[str, Any]) -> None:
        """Atomically: a reader (a restart) sees the whole old record or the whole new one.
        Raises NotRegular (something not ours at the path: left in place) or OSError (EFBIG for
        a record larger than load() would read back: never written, so it cannot lock us out)."""
        content = encode(self.kind, entries)
        if len(content) > self.max_bytes:
            raise OSError(errno.EFBIG, f"the record would be {len(content)} bytes, over the "
                                       f"{self.max_bytes} a checkpoint may have")
        self.file.replace(content)

    def cleanup_leftovers(self) -> int:
        """Temp files a crash in save() left behind."""
        return self.file.cleanup_leftovers()

    def exists(self) -> bool:
        return os.path.lexists(self.path)


class InstanceLock:
    """An exclusive flock(2) on ``directory/name`` that every instance of a plugin on the node
    takes around its changes of a shared record. The file is created once and never removed (a
    removed lock file would let two instances each lock a file of their own)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.path = directory / name

    def try_acquire(self) -> int | None:
        """The locked file descriptor (close it to release), or None while another instance
        holds the lock. Never follows a symlink or takes what is not a regular file (NotRegular);
        OSError when the directory cannot be used. Run it off the event loop (the open)."""
        os.makedirs(self.directory, 0o755, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, MODE)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise NotRegular("a symlink" if exc.errno == errno.ELOOP else "a directory") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegular(kind_of(st.st_mode))
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd
