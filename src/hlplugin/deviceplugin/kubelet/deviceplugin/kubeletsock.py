"""What the plugin directory's sockets say about the kubelet, without registering: which socket
is there (its identity) and whether anything still listens on it.

A kubelet that exits ends our ListAndWatch stream and leaves its kubelet.sock behind, dead, until
a new kubelet deletes every socket and serves a fresh one (docs/kubelet.md). Telling a dead socket
from a live one lets the lifecycle wait for the new kubelet instead of dialling the dead one.

The problems are worded for an operator; ``setting`` is how the operator chose the directory (the
daemon's flag), which the hints name.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

DIR_SETTING = "the plugin directory"  # a hint's name for it when the daemon gives none


def connect_error(path: Path) -> OSError | None:
    """Why nothing listens on the unix socket at ``path`` (the connect's error), or None when a
    process does: a non-blocking connect, closed at once (no gRPC call, so the kubelet sees no
    request). A full backlog counts as listening."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return None
        except OSError as exc:
            return None if exc.errno in (errno.EAGAIN, errno.EINPROGRESS) else exc
    return None


def listens(path: Path) -> bool:
    """Whether a process listens on the unix socket at ``path`` (see ``connect_error``)."""
    return connect_error(path) is None


def dir_problem(plugin_dir: Path, setting: str = DIR_SETTING) -> str:
    """Why ``plugin_dir`` cannot hold our socket, or ""."""
    try:
        st = os.stat(plugin_dir)
    except FileNotFoundError:
        return (f"{plugin_dir} does not exist (is {setting} the kubelet's "
                f"device-plugins directory?)")
    except OSError as exc:
        return f"cannot use {plugin_dir}: {exc.strerror} (errno {exc.errno})"
    return "" if stat.S_ISDIR(st.st_mode) else f"{plugin_dir} is not a directory"


def kubelet_problem(kubelet_path: Path, setting: str = DIR_SETTING) -> str:
    """Why there is no kubelet to register with at ``kubelet_path``."""
    if os.path.lexists(kubelet_path):
        return f"{kubelet_path} is not a socket"
    return (dir_problem(kubelet_path.parent, setting) or f"no kubelet.sock at {kubelet_path} (is "
            f"the kubelet running, and is {setting} its device-plugins directory?)")
