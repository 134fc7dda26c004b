"""A FUSE filesystem that stops answering, served from the test process over /dev/fuse (no
library needed): a fake of the world (a hung network or FUSE mount), never of our code.

It holds one entry. ``HangingDevFs``'s is ``kvm``, a character device with the real KVM numbers,
so opening it opens the real driver; ``HangingFileFs``'s is a regular file with given bytes (a CDI
spec, say). ``hang()`` makes every lookup, stat, open and read of the entry wait unanswered until
``release()``, so whatever touches it blocks in the kernel. Nothing is cached (valid 0, direct
I/O), so every access asks us. Closing unmounts and aborts anything still waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
import threading
from pathlib import Path

import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_IN = struct.Struct("<IIQQIIIHH")   # fuse_in_header
_OUT = struct.Struct("<IiQ")        # fuse_out_header
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
_ENTRY = struct.Struct("<QQQQII")   # fuse_entry_out without its attr
_ATTR_OUT = struct.Struct("<QII")   # fuse_attr_out without its attr
_OPEN_OUT = struct.Struct("<QII")   # fuse_open_out
_READ_IN = struct.Struct("<QQI")    # the start of fuse_read_in: fh, offset, size
_LOOKUP, _FORGET, _GETATTR, _OPEN, _READ, _RELEASE, _FLUSH = 1, 2, 3, 14, 15, 18, 25
_INIT, _OPENDIR, _READDIR, _RELEASEDIR, _INTERRUPT, _BATCH_FORGET = 26, 27, 28, 29, 36, 42
_ENTRY_OPS = frozenset({_GETATTR, _OPEN, _READ, _RELEASE, _FLUSH})
_FOPEN_DIRECT_IO = 1
_MNT_DETACH = 2


class HangingFs:
    """One entry named ``name`` with mode ``mode`` (and device numbers ``rdev``, or bytes
    ``content`` for a regular file), owned by root; see the module docstring."""

    def __init__(self, mountpoint: Path, name: str, mode: int, *, rdev: int = 0,
                 content: bytes = b"") -> None:
        self.mountpoint = mountpoint
        self.name = name.encode()
        self.mode = mode
        self.content = content
        minor, major = os.minor(rdev), os.major(rdev)
        self._rdev = (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)  # new_encode_dev
        self._hang = False
        self._pending: list[tuple[int, int, bytes]] = []
        self._lock = threading.Lock()
        self._fd = -1
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fuse")
        self.requests = 0

    def __enter__(self) -> HangingFs:
        if not os.path.exists("/dev/fuse"):
            pytest.skip("no /dev/fuse")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        options = f"fd={self._fd},rootmode=40755,user_id=0,group_id=0,allow_other".encode()
        if _libc.mount(b"hlplugin-fault", bytes(self.mountpoint), b"fuse", 0, options) != 0:
            code = ctypes.get_errno()
            os.close(self._fd)
            pytest.skip(f"cannot mount a FUSE filesystem: {os.strerror(code)}")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        _libc.umount2(bytes(self.mountpoint), _MNT_DETACH)
        os.close(self._fd)  # aborts the connection: waiting requests fail, the thread ends
        self._thread.join(5)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def hang(self) -> None:
        with self._lock:
            self._hang = True

    def release(self) -> None:
        with self._lock:
            self._hang = False
            pending, self._pending = self._pending, []
        for opcode, unique, body in pending:
            self._answer_entry(opcode, unique, body)

    def _attr(self, ino: int) -> bytes:
        if ino == 1:
            return _ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
        return _ATTR.pack(2, len(self.content), 1, 0, 0, 0, 0, 0, 0, self.mode, 1, 0, 0,
                          self._rdev, 4096, 0)

    def _reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        with contextlib.suppress(OSError):  # an interrupted or aborted request
            os.write(self._fd, _OUT.pack(_OUT.size + len(body), -error, unique) + body)

    def _answer_entry(self, opcode: int, unique: int, body: bytes) -> None:
        if opcode == _LOOKUP:
            self._reply(unique, 0, _ENTRY.pack(2, 0, 0, 0, 0, 0) + self._attr(2))
        elif opcode == _GETATTR:
            self._reply(unique, 0, _ATTR_OUT.pack(0, 0, 0) + self._attr(2))
        elif opcode == _OPEN:
            self._reply(unique, 0, _OPEN_OUT.pack(0, _FOPEN_DIRECT_IO, 0))
        elif opcode == _READ:
            _, offset, size = _READ_IN.unpack_from(body)
            self._reply(unique, 0, self.content[offset:offset + size])
        else:  # RELEASE, FLUSH
            self._reply(unique)

    def _serve(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 17)
            except OSError:
                return  # unmounted and closed
            length, opcode, unique, node, *_ = _IN.unpack_from(data)
            body = data[_IN.size:length]
            self.requests += 1
            if opcode == _INIT:
                self._reply(unique, 0, struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 16, 12, 4096, 1,
                                                   1, 0, 0) + bytes(28))
            elif opcode in (_FORGET, _BATCH_FORGET, _INTERRUPT):
                continue  # no reply expected
            elif (opcode == _LOOKUP and node == 1 and body.rstrip(b"\0") == self.name) or (
                    opcode in _ENTRY_OPS and node == 2):
                with self._lock:
                    if self._hang:
                        self._pending.append((opcode, unique, body))
                        continue
                self._answer_entry(opcode, unique, body)
            elif opcode == _GETATTR and node == 1:
                self._reply(unique, 0, _ATTR_OUT.pack(0, 0, 0) + self._attr(1))
            elif opcode == _OPENDIR:
                self._reply(unique, 0, _OPEN_OUT.pack(0, 0, 0))
            elif opcode in (_READDIR, _RELEASEDIR):
                self._reply(unique)  # an empty listing: the entry is found by name only
            elif opcode == _LOOKUP:
                self._reply(unique, errno.ENOENT)
            else:
                self._reply(unique, errno.ENOSYS)


class HangingDevFs(HangingFs):
    """``kvm``: a character device with ``rdev``'s numbers (mode 0600)."""

    def __init__(self, mountpoint: Path, rdev: int) -> None:
        super().__init__(mountpoint, "kvm", stat.S_IFCHR | 0o600, rdev=rdev)


class HangingFileFs(HangingFs):
    """``name``: a regular file (mode 0644) holding ``content``."""

    def __init__(self, mountpoint: Path, name: str, content: bytes) -> None:
        super().__init__(mountpoint, name, stat.S_IFREG | 0o644, content=content)
