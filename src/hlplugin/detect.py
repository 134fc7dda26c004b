"""Which hypervisor device this node has, waiting for one to appear: both daemons need it before
they can build a plugin, and it needs no prober (the bootstrap never opens the device)."""

from __future__ import annotations

import contextlib
import logging
from enum import StrEnum

from hlplugin import hvnode
from hlplugin.deviceplugin.health.watch import DirWatcher
from hlplugin.names import NO_HYPERVISOR_HINT
from hlplugin.settings import HYPERVISORS, HealthSettings, show

log = logging.getLogger(__name__)


class Pending(StrEnum):
    """/readyz's condition while wait_for_hypervisor waits (a DaemonSpec's ``pending``)."""

    HYPERVISOR = "hypervisor"


def pending(settings: HealthSettings) -> dict[str, str]:
    """What both daemons' /readyz says until a hypervisor device is found: what auto looks for,
    and where."""
    return {Pending.HYPERVISOR: f"no mshv or kvm device under {show(settings.dev_dir)}"}


def detect_hypervisor(settings: HealthSettings) -> str | None:
    """The configured hypervisor, or for ``auto`` the present node (mshv over kvm, as upstream;
    by lstat, so a symlink at either name does not count)."""
    if settings.hypervisor != "auto":
        return settings.hypervisor
    return hvnode.detect(settings.dev_dir)


async def wait_for_hypervisor(settings: HealthSettings) -> str:
    """``auto`` with no device yet: stay up (not ready) until /dev/mshv or /dev/kvm appears."""
    found = detect_hypervisor(settings)
    if found is not None:
        return found
    skipped = "".join(f"; {why}" for why in hvnode.skipped(settings.dev_dir))
    log.warning("no hypervisor device under %s (looked for mshv and kvm%s); waiting for one; %s",
                show(settings.dev_dir), skipped, NO_HYPERVISOR_HINT)
    # aclosing: leaving the loop early must close the watcher now, not whenever the garbage
    # collector finalizes the generator (by then its inotify fd number may belong to another).
    async with contextlib.aclosing(DirWatcher(settings.dev_dir, HYPERVISORS).changes()) as changes:
        async for _ in changes:
            found = detect_hypervisor(settings)
            if found is not None:
                log.info("hypervisor device %s appeared", settings.dev_dir / found)
                return found
    raise AssertionError("unreachable: the watcher never ends")
