"""DirWatcher in process, on real directories: inotify and the polling fallback report the same
changes, and a directory that is missing, removed or replaced is watched again when it is back.
Where the kernel refuses inotify (limits used up), a child in a user namespace of its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harness import wait_until
from support.loopstate import new_sockets_hear
from support.waits import quiet

from hlplugin.deviceplugin.health.watch import FILE_EVENTS, DirWatcher

GUARD = 10.0  # seconds; a guard, reached only when a test is broken


@contextlib.asynccontextmanager
async def watching(watcher: DirWatcher) -> AsyncIterator[list[set[str]]]:
    """The batches ``watcher`` yields, collected while the block runs."""
    batches: list[set[str]] = []

    async def collect() -> None:
        async for batch in watcher.changes():
            batches.append(batch)

    task = asyncio.create_task(collect())
    try:
        yield batches
    finally:
        task.cancel()
        await asyncio.wait({task})


async def seen(batches: list[set[str]], name: str, what: str) -> None:
    """Wait for a batch naming ``name`` after the ones already there; then forget them all."""
    await wait_until(lambda: any(name in b for b in batches), GUARD, what)
    batches.clear()


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
async def test_named_changes_are_reported_and_others_are_not(tmp_path: Path, inotify: bool) -> None:
    watched = tmp_path / "cdi"
    watched.mkdir()
    watcher = DirWatcher(watched, {"spec.json"}, poll_interval=0.05, use_inotify=inotify,
                         events=FILE_EVENTS)
    async with watching(watcher) as batches:
        await seen(batches, "spec.json", "the first batch: every name, anything may be new")
        assert (watcher.live_fd is not None) is inotify
        (watched / "other.json").write_text("{}")  # not a watched name: never reported
        (watched / "spec.json").write_text("{}")
        await seen(batches, "spec.json", "a created file")
        temp = watched / ".spec.tmp"
        temp.write_text("[]")
        os.replace(temp, watched / "spec.json")
        await seen(batches, "spec.json", "a file renamed over it")
        os.chmod(watched / "spec.json", 0o600)
        await seen(batches, "spec.json", "a mode change")
        (watched / "spec.json").write_text("{} ")  # truncated and written in place: one inode
        await seen(batches, "spec.json", "a write in place")
        (watched / "spec.json").unlink()
        await seen(batches, "spec.json", "a removal")
        (watched / "other.json").unlink()
        # A bounded watch for a report that should not come: every change above was reported
        # within one poll interval (50 ms); four of them is ample.
        await quiet(0.2, "a bounded watch for a report that should not come")
        assert all(b == {"spec.json"} for b in batches), batches


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
async def test_a_missing_or_replaced_directory_is_watched_again(tmp_path: Path,
                                                                 inotify: bool) -> None:
    watched = tmp_path / "plugins"
    watcher = DirWatcher(watched, {"kubelet.sock"}, poll_interval=0.05, use_inotify=inotify)
    async with watching(watcher) as batches:
        if not inotify:  # polling reports the first look, the name's absence included
            await seen(batches, "kubelet.sock", "the first look")
        watched.mkdir()  # appears after the watch started
        (watched / "kubelet.sock").write_text("")
        await seen(batches, "kubelet.sock", "a name in a directory that appeared late")
        watched.rename(tmp_path / "old")  # replaced: the old directory's events no longer count
        watched.mkdir()
        await seen(batches, "kubelet.sock", "the directory replaced")
        if inotify:
            await wait_until(lambda: watcher.live_fd is not None, GUARD, "the watch re-added")
        (tmp_path / "old" / "kubelet.sock").unlink()  # in the old directory: nothing to report
        (watched / "kubelet.sock").write_text("")
        await seen(batches, "kubelet.sock", "a change in the new directory")


# --- when the kernel refuses inotify ---------------------------------------------------------------

# In a user namespace of its own, where its inotify limits (/proc/sys/user/max_inotify_*, per user
# namespace since Linux 5.11) are 0: the kernel itself refuses, as on a node whose
# fs.inotify.max_user_watches (or max_user_instances) is used up; the machine's limits are untouched.
_CHILD = r"""
import asyncio, json, logging, sys
from pathlib import Path
from hlplugin.deviceplugin.health.watch import DirWatcher

limit, watched = sys.argv[1], Path(sys.argv[2])
with open(f"/proc/sys/user/max_inotify_{limit}", "w") as sysctl:
    sysctl.write("0")
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("hlplugin").addHandler(handler)

async def main():
    watcher = DirWatcher(watched, {"spec.json"}, poll_interval=0.05)
    batches = []
    async def collect():
        async for batch in watcher.changes():
            batches.append(batch)
    task = asyncio.create_task(collect())
    async def seen(what):
        async with asyncio.timeout(20):
            while not any("spec.json" in b for b in batches):
                await asyncio.sleep(0.01)  # a poll step while batches arrive (in the child)
        batches.clear()
    try:
        await seen("the first look")
        (watched / "spec.json").write_text("{}")
        await seen("a created file")
        (watched / "spec.json").unlink()
        await seen("a removal")
    except TimeoutError:
        print(json.dumps({"error": "no change reported within 20 s"}))
        return
    finally:
        task.cancel()
    print(json.dumps({"live_fd": watcher.live_fd, "warnings": [
        r.getMessage() for r in records if r.levelno >= logging.WARNING]}))

asyncio.run(main())
"""


def _in_user_namespace(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["unshare", "--user", "--map-root-user", *argv], capture_output=True,
                          text=True, timeout=60, check=False)


@functools.cache
def _user_namespaces() -> str:
    """Why the test cannot make a user namespace with its own inotify limits, or ""."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    if not Path("/proc/sys/user/max_inotify_watches").exists():
        return "needs per-user-namespace inotify limits (Linux 5.11 or later)"
    probe = _in_user_namespace("sh", "-c", "echo 0 > /proc/sys/user/max_inotify_watches")
    return f"cannot make a user namespace: {probe.stderr.strip()}" if probe.returncode else ""


@pytest.mark.skipif(bool(_user_namespaces()), reason=_user_namespaces() or "-")
@pytest.mark.parametrize(("limit", "says"), [
    ("watches", "cannot watch"),  # inotify_add_watch fails with ENOSPC
    ("instances", "inotify unavailable"),  # inotify_init1 fails with EMFILE
])
def test_a_kernel_that_refuses_inotify_is_said_once_and_polled(tmp_path: Path, limit: str,
                                                                says: str) -> None:
    watched = tmp_path / "cdi"
    watched.mkdir()
    done = _in_user_namespace(sys.executable, "-c", _CHILD, limit, str(watched))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "error" not in result, result  # the changes were reported, by polling
    assert result["live_fd"] is None  # so nothing trusts a quiet inotify watch
    warnings = result["warnings"]
    assert len(warnings) == 1 and says in warnings[0] and str(watched) in warnings[0], warnings
    if limit == "watches":
        assert "No space left on device" in warnings[0] and "max_user_watches" in warnings[0]


async def test_a_closed_watch_leaves_the_event_loop_nothing_of_its_inotify_fd(tmp_path: Path) -> None:
    """Closing the watch removes its reader before the inotify fd closes: a file opened next
    under the freed number must still get its events."""
    changes = DirWatcher(tmp_path, None, use_inotify=True).changes()
    await anext(changes)
    await changes.aclose()
    assert await new_sockets_hear(), "a new socket under the freed fd number saw no event"
