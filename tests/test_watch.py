"""DirWatcher in process, on real directories: inotify and the polling fallback report the same
changes, and a directory that is missing, removed or replaced is watched again when it is back."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harness import wait_until

from hlplugin.deviceplugin.watch import FILE_EVENTS, DirWatcher

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
        await asyncio.sleep(0.2)
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
