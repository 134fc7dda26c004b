"""A FUSE filesystem that stops answering, served from the test process over /dev/fuse (no
library needed): a fake of the world (a hung network or FUSE mount), never of our code.

It holds one entry owned by root: a character device (opening it opens the real driver) or a
regular file with given bytes (a CDI spec, say). ``hang()`` makes every request about the entry
(its lookup, stat, open, read ...) wait unanswered until ``release()``, so whatever touches it
blocks in the kernel. Nothing is cached (valid 0, direct I/O), so every access asks us. Closing
unmounts and aborts anything still waiting.
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
_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header
_OUT = struct.Struct("<IiQ")  # fuse_out_header
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
_LOOKUP, _GETATTR, _OPEN, _READ, _RELEASE, _INIT, _OPENDIR = 1, 3, 14, 15, 18, 26, 27
_NO_REPLY = frozenset({2, 36, 42})  # FORGET, INTERRUPT, BATCH_FORGET
_EMPTY_REPLY = frozenset({_RELEASE, 25, 28, 29})  # FLUSH, READDIR (found by name only), RELEASEDIR


class HangingFs:
    """One entry ``name`` with ``mode`` (and device numbers ``rdev``, or bytes ``content`` for a
    regular file), mounted at ``mountpoint``; see the module docstring."""

    def __init__(self, mountpoint: Path, name: str, mode: int, *, rdev: int = 0,
                 content: bytes = b"") -> None:
        self.mountpoint = mountpoint
        self.name = name.encode()
        self.content = content
        minor, major = os.minor(rdev), os.major(rdev)
        encoded = (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)  # new_encode_dev
        self._attrs = {
            1: _ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0),
            2: _ATTR.pack(2, len(content), 1, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, encoded, 4096, 0)}
        self.requests = 0
        self._hang = False
        self._pending: list[tuple[int, int, int, bytes]] = []
        self._lock = threading.Lock()
        self._fd = -1
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fuse")

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
        _libc.umount2(bytes(self.mountpoint), 2)  # MNT_DETACH
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
        for request in pending:
            self._answer(*request)

    def _serve(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 17)
            except OSError:
                return  # unmounted and closed
            length, opcode, unique, node, *_ = _IN.unpack_from(data)
            body = data[_IN.size:length]
            self.requests += 1
            if opcode in _NO_REPLY:
                continue
            # The entry is node 2, found by name in the root. A RELEASE, sent in the background,
            # blocks no thread: answered at once, so ``pending`` counts blocked calls only.
            ours = (node == 2 and opcode != _RELEASE) or (
                opcode == _LOOKUP and body.rstrip(b"\0") == self.name)
            with self._lock:
                if self._hang and ours:
                    self._pending.append((opcode, node, unique, body))
                    continue
            self._answer(opcode, node, unique, body)

    def _answer(self, opcode: int, node: int, unique: int, body: bytes) -> None:
        error, reply = 0, b""
        if opcode == _INIT:
            reply = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 16, 12, 4096, 1, 1, 0, 0) + bytes(28)
        elif opcode == _LOOKUP and node == 1 and body.rstrip(b"\0") == self.name:
            reply = struct.pack("<QQQQII", 2, 0, 0, 0, 0, 0) + self._attrs[2]  # fuse_entry_out
        elif opcode == _GETATTR:
            reply = bytes(16) + self._attrs[node]  # fuse_attr_out: valid 0
        elif opcode in (_OPEN, _OPENDIR):  # fuse_open_out: a file with direct I/O
            reply = struct.pack("<QII", 0, int(opcode == _OPEN), 0)
        elif opcode == _READ:
            _, offset, size = struct.unpack_from("<QQI", body)  # fuse_read_in: fh, offset, size
            reply = self.content[offset:offset + size]
        elif opcode not in _EMPTY_REPLY:
            error = errno.ENOENT if opcode == _LOOKUP else errno.ENOSYS
        with contextlib.suppress(OSError):  # an interrupted or aborted request
            os.write(self._fd, _OUT.pack(_OUT.size + len(reply), -error, unique) + reply)
