"""Facts about paths, standard library only (the device prober imports it too): what kind of file
sits at a path, whether it is a character device, and how long a path or a unix socket's may be.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hlplugin.deviceplugin.quoting import quote

# The kernel refuses a path of PATH_MAX bytes or more (the count includes the terminating NUL),
# and a component of more than NAME_MAX bytes, with ENAMETOOLONG (linux/limits.h).
PATH_MAX = 4096
NAME_MAX = 255
# How much of a path a message quotes (a path setting may be up to PATH_MAX).
PATH_CHARS = 256

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


def path_problem(path: str) -> str:
    """Why the kernel would refuse ``path`` whatever the filesystem holds (too long as a whole or
    in a component, a NUL byte), or "" when it would not; quotes a bounded prefix of it."""
    if "\0" in path:
        return f"must not contain a NUL byte, got {quote(path)}"
    try:
        encoded = os.fsencode(path)
    except UnicodeError:
        return f"cannot be encoded for the file system, got {quote(path)}"
    if len(encoded) >= PATH_MAX:
        return (f"is {len(encoded)} bytes long; the most a path may have is {PATH_MAX - 1} "
                f"(PATH_MAX), got {quote(path)}")
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        name = os.fsdecode(longest)
        return (f"has a component of {len(longest)} bytes, {quote(name)}; the most is {NAME_MAX} "
                f"(NAME_MAX)")
    return ""


def socket_path_problem(directory: Path, socket_name: str) -> str:
    """Why a socket named ``socket_name`` cannot live in ``directory``, or "" when it can."""
    longest = len(os.fsencode(directory / socket_name))
    if longest > MAX_SOCKET_PATH:
        return (f"{quote(str(directory), PATH_CHARS)} is too long for a unix socket path "
                f"({longest} > {MAX_SOCKET_PATH} bytes with {socket_name})")
    return ""
