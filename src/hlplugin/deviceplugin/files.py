"""Facts about paths, standard library only (the device prober imports it too): what kind of file
sits at a path, whether it is a character device, and how long a unix socket's path may be.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# sun_path holds 108 bytes including the terminating NUL, but a gRPC server binding
# "unix://PATH" checks everything after "unix:", so "//" counts: PATH may have 105 bytes.
MAX_SOCKET_PATH = 105

_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISREG, "a regular file"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, for a message: "a symlink", "a FIFO", ..."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return f"mode {mode:o}"


def char_device(path: Path) -> tuple[os.stat_result, str]:
    """The one character-device check: lstat ``path`` (a symlink is not followed, so it is
    refused); its stat, and "" when it is a character device or else what it is (kind_of).
    Raises OSError when it cannot be lstat'd."""
    st = os.lstat(path)
    return st, "" if stat.S_ISCHR(st.st_mode) else kind_of(st.st_mode)


def socket_path_problem(directory: Path, socket_name: str) -> str:
    """Why a socket named ``socket_name`` cannot live in ``directory``, or "" when it can."""
    longest = len(os.fsencode(directory / socket_name))
    if longest > MAX_SOCKET_PATH:
        return (f"{directory} is too long for a unix socket path ({longest} > {MAX_SOCKET_PATH} "
                f"bytes with {socket_name})")
    return ""
