"""Why a path can never be a directory: the words both `serve`'s flag check and the CDI
reconciler use, instead of the EEXIST or ENOTDIR that creating it would report."""

from __future__ import annotations

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
