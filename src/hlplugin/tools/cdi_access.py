"""`hlplugin doctor`'s "CDI dir access" row: whether others than root could add or replace a CDI
spec that a runtime reads, in the daemon's directory or in /etc/cdi (containerd reads both), each
with its parent, in the words the main daemon logs (hlplugin.dirs.exposure)."""

from __future__ import annotations

import os
from pathlib import Path

from hlplugin.dirs import exposure
from hlplugin.settings import HealthSettings

ETC_CDI = Path("/etc/cdi")


class Exposed(Exception):
    """Some directory is exposed: the row's detail (a warning, not a failure)."""


def check(directory: Path) -> str:
    """The row's detail when nothing is exposed; raises Exposed with every problem and its fix.
    In the daemon's pod (its /host-dev mount is there) /etc is the image's, not the node's: then
    only ``directory`` is looked at, and the detail says so."""
    host_dev = HealthSettings.host_dev_dir
    in_pod = host_dev is not None and host_dev.exists()
    looked: dict[Path, str] = {}
    for candidate in (directory,) if in_pod else (directory, ETC_CDI):
        for path, problem in exposure(candidate, os.geteuid()).items():
            looked.setdefault(path, problem)
    unseen = (f"; {ETC_CDI} not looked at: in the daemon's pod it is the image's, not the node's "
              "(run doctor on the node for it)") if in_pod else ""
    problems = [problem for problem in looked.values() if problem]
    if problems:
        raise Exposed("; ".join(problems) + unseen)
    where = ", ".join(map(str, looked)) or "nothing there yet"
    return f"{where}: owned by root, not writable by group or others{unseen}"
