"""Why a path can never be a directory: the words both `serve`'s flag check and the CDI
reconciler use, instead of the EEXIST or ENOTDIR that creating it would report; and how a CDI
directory is exposed to others than root (the reconciler and `doctor`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def not_a_directory(path: Path) -> str:
    """Why ``path`` can never be a directory (it, or its nearest existing ancestor, is something
    else), or "" (it is one, or can be made, or it cannot be looked at: the caller's own attempt
    then says why)."""
    for candidate in (path, *path.parents):
        try:
            is_dir = candidate.is_dir()
            exists = is_dir or candidate.exists()
        except OSError:
            return ""
        if is_dir:
            return ""
        if exists:
            return (f"{path} is not a directory" if candidate == path
                    else f"{path} cannot be a directory: {candidate} is not a directory")
    return ""


def exposure(directory: Path, owner: int | None = None) -> dict[Path, str]:
    """How others than root could add, replace or remove a CDI spec in ``directory``: for it and
    the directory holding it (symlinks resolved; each that exists), "" or the problem and its fix.

    A CDI directory writable by group or others, or owned by another user than root (or
    ``owner``: the daemon's own, when it runs as another user), lets that user add a spec that
    injects devices into containers, or replace ours between two checks; a parent that is
    (without the sticky bit, which keeps others from renaming what is not theirs) lets them
    replace the directory itself.
    """
    allowed = {0} if owner is None else {0, owner}
    real = Path(os.path.realpath(directory))
    found: dict[Path, str] = {}
    for path in (real, real.parent):
        if path in found:  # "/" is its own parent
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                   if mode & bit and (path == real or not mode & stat.S_ISVTX)]
        problems, fixes = [], []
        if writers:
            problems.append(f"writable by {' and '.join(writers)} (mode {mode:04o})")
            fixes.append(f"chmod 755 {path}")
        if st.st_uid not in allowed:
            problems.append(f"owned by uid {st.st_uid}, not root")
            fixes.append(f"chown root {path}")
        what, could = (("the CDI directory", "others could add a spec that injects devices into "
                        "containers, or replace ours") if path == real else
                       ("the CDI directory's parent", "others could replace the CDI directory"))
        found[path] = (f"{path}, {what}, is {' and '.join(problems)}: {could} (fix: "
                       f"{', '.join(fixes)})" if problems else "")
    return found
