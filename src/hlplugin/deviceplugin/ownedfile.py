"""One file that a daemon owns in a directory it shares with others, kept without trusting the path.

Read never follows a symlink nor blocks on a FIFO; replace is atomic (a reader sees the whole old
or the whole new file) and never clobbers what is not ours: the new file is swapped in with
renameat2(RENAME_EXCHANGE), what it displaced is inspected, and anything but a regular file is
exchanged back and refused. Leftover temp files of a crash are removed; nothing else in the
directory is touched, and the file itself is never deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import cast

from hlplugin.deviceplugin.files import kind_of

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# The kernel says EINVAL when a filesystem lacks the flags (FUSE without rename2, ...); ENOSYS
# when the kernel lacks renameat2 (before 3.15) or libc lacks a way to call it.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
_MAX_INSTALL_ATTEMPTS = 100
# renameat2's system call number, for a libc without the wrapper (glibc before 2.28).
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "armv7l": 382, "armv8l": 382,
                  "i686": 353, "i386": 353, "ppc64le": 357, "ppc64": 357, "s390x": 347}
_Renameat2 = Callable[[int, bytes, int, bytes, int], int]


class NotRegular(Exception):
    """Something other than a regular file sits at the path; ``str()`` says what."""


def read_regular(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """Up to ``limit`` bytes and the fstat of a regular file; None when missing.

    lstat first, then O_NOFOLLOW|O_NONBLOCK and fstat: never follows a symlink, never blocks on a
    FIFO, and a swap between the two checks is still caught. Raises NotRegular or OSError.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(kind_of(st.st_mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(kind_of(st.st_mode))
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _load_renameat2() -> _Renameat2 | None:
    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is not None:
        func.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint)
        func.restype = ctypes.c_int
        return cast(_Renameat2, func)
    number = _SYS_RENAMEAT2.get(os.uname().machine)
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long

    def via_syscall(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(old),
                           ctypes.c_int(newdirfd), ctypes.c_char_p(new), ctypes.c_uint(flags)))

    return via_syscall


_renameat2 = _load_renameat2()


def renameat2(dir_fd: int, old: str, new: str, flags: int) -> None:
    """Linux renameat2(2) within one directory; raises OSError like the os module does."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), old)
    if _renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old, None, new)


def temp_prefix(name: str) -> str:
    """The prefix of the temp files an OwnedFile ``name`` writes beside itself."""
    return f".{name}.tmp-"


class OwnedFile:
    """``directory/name``, ours: read without following, replaced atomically, never clobbering.

    Its temp files are ``.<name>.tmp-<random>`` in the same directory. Not thread-safe: one
    caller at a time (a producer's runner) reads and replaces.
    """

    def __init__(self, directory: Path, name: str, mode: int) -> None:
        self.directory = directory
        self.name = name
        self.path = directory / name
        self.mode = mode
        self.temp_prefix = temp_prefix(name)
        self._uid = os.geteuid()
        self._gid = os.getegid()
        self._warned_no_exchange = False

    def read(self, limit: int) -> tuple[bytes, os.stat_result] | None:
        """See read_regular."""
        return read_regular(self.path, limit)

    def metadata_right(self, st: os.stat_result) -> bool:
        """The file has our mode and is owned by our effective user and group."""
        return (stat.S_IMODE(st.st_mode) == self.mode and st.st_uid == self._uid
                and st.st_gid == self._gid)

    def replace(self, content: bytes) -> None:
        """Atomically put ``content`` at our path: temp file, fsync, swap in, fsync the directory.

        All names are resolved in one directory fd, so every step acts on the same directory.
        Raises NotRegular (something not ours is at the path: left in place) or OSError.
        """
        os.makedirs(self.directory, 0o755, exist_ok=True)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            temp = self.temp_prefix + os.urandom(8).hex()
            self._write_temp(dir_fd, temp, content)
            try:
                self._install(dir_fd, temp)
            finally:
                self._discard_temp(dir_fd, temp)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def cleanup_leftovers(self) -> int:
        """Remove temp files a crash left behind (regular files with our prefix only)."""
        removed = 0
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(self.temp_prefix):
                continue
            path = self.directory / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed += 1
                    log.info("removed leftover temp file %s", path)
        return removed

    def _write_temp(self, dir_fd: int, name: str, content: bytes) -> None:
        """Create ``name`` with ``content``, our mode and group, on disk."""
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC
        fd = os.open(name, flags, self.mode, dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, self.mode)  # against the umask
                st = os.fstat(fd)
                if st.st_gid != self._gid:  # a setgid directory passes its group on
                    os.fchown(fd, -1, self._gid)
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise

    def _install(self, dir_fd: int, temp: str) -> None:
        """Move ``temp`` to our path without ever replacing what is not ours.

        Exchange, then look at what was displaced: a regular file (our old one) stays at the
        temp name for replace() to remove; anything else is exchanged back and refused. No
        check-then-act window: what we inspect is what we took. With nothing at the path, a
        no-replace rename; if something appeared in between, exchange again.
        """
        for _ in range(_MAX_INSTALL_ATTEMPTS):
            try:
                renameat2(dir_fd, temp, self.name, RENAME_EXCHANGE)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    try:
                        renameat2(dir_fd, temp, self.name, RENAME_NOREPLACE)
                        return
                    except OSError as again:
                        if again.errno == errno.EEXIST:
                            continue  # created meanwhile: exchange and look at it
                        exc = again
                if exc.errno in _UNSUPPORTED:
                    self._install_without_renameat2(dir_fd, temp)
                    return
                if exc.errno == errno.EBUSY:  # a mount point: renaming over it is refused anyway
                    raise NotRegular("a mount point") from None
                raise
            displaced = os.stat(temp, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(displaced.st_mode):
                return  # our old file, now at the temp name, which replace() removes
            self._put_back(dir_fd, temp)
            raise NotRegular(kind_of(displaced.st_mode))
        raise OSError(errno.EAGAIN, f"{self.name} kept appearing and disappearing")

    def _install_without_renameat2(self, dir_fd: int, temp: str) -> None:
        """For filesystems without renameat2 flags (some FUSE): check, then rename.

        A non-regular file swapped in between the two steps is replaced; only someone who can
        write the directory can do that, and our file is what takes its place.
        """
        if not self._warned_no_exchange:
            self._warned_no_exchange = True
            log.warning("the filesystem of %s does not support renameat2 with RENAME_EXCHANGE or "
                        "RENAME_NOREPLACE; replacing %s with lstat and rename",
                        self.directory, self.name)
        with contextlib.suppress(FileNotFoundError):
            mode = os.stat(self.name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegular(kind_of(mode))
        try:
            os.rename(temp, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise NotRegular("a mount point") from None
            raise

    def _put_back(self, dir_fd: int, temp: str) -> None:
        """Return what an exchange displaced (now at ``temp``) to our path; what is there now (our
        file, normally) goes to ``temp``. If our path is empty meanwhile, a no-replace move."""
        error: OSError | None = None
        # Exchange; if our path emptied meanwhile (ENOENT), move; if it filled again (EEXIST), ...
        attempts = ((RENAME_EXCHANGE, errno.ENOENT), (RENAME_NOREPLACE, errno.EEXIST))
        for flags, again in itertools.islice(itertools.cycle(attempts), 2 * _MAX_INSTALL_ATTEMPTS):
            try:
                renameat2(dir_fd, temp, self.name, flags)
                return
            except OSError as exc:
                error = exc
                if exc.errno != again:
                    break
        log.warning("could not return what was at %s to its place; it is at %s: %s",
                    self.name, temp, error.strerror if error else "")

    @staticmethod
    def _discard_temp(dir_fd: int, temp: str) -> None:
        """Remove our temp name if it holds a regular file: the file we wrote, or our old file
        an exchange took from our path. Anything else (what an exchange took and could not put
        back) is not ours to delete, and stays."""
        try:
            st = os.stat(temp, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.unlink(temp, dir_fd=dir_fd)
            else:
                log.warning("left %s in place: it is %s, not ours", temp, kind_of(st.st_mode))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove our temp file %s: %s", temp, exc.strerror)
