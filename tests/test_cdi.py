"""The CDI spec reconciler against real files and real inotify: a wrong or missing spec repaired
once and reported, a change during a shared pass never answered as right, cheap when right,
crash leftovers removed, periodic repairs never more often than the floor (a hostile path or
storage, and swaps during repairs: test_cdi_hostile.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401  (to_thread's, imported before any fork)
import ctypes
import errno
import itertools
import json
import logging
import os
import platform
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import needs_root, running, spec_is_exact, temp_files, wait_until
from support.cdi import CAUSES, DESIRED, STALE, Reconciler, assert_desired, exchange, forked, state
from support.cdi import cdi_dir as cdi_dir  # a fixture
from support.observers import Calls
from support.waits import loop_turn, quiet, quiet_blocking

from hlplugin.cdi_spec import TEMP_PREFIX, check_file, desired_spec
from hlplugin.deviceplugin.health.conditions import MIN_PERIOD, Condition


def _mutate(change: Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], object]) -> bytes:
    """Our spec, rendered as we do, after ``change(spec, its edits, its device node)``."""
    spec = desired_spec("kvm", 65534, 65534)
    edits = spec["devices"][0]["containerEdits"]
    change(spec, edits, edits["deviceNodes"][0])
    return (json.dumps(spec, indent=2) + "\n").encode()


STALE_CASES = {
    "kind": _mutate(lambda s, e, n: s.update(kind="example.com/other")),
    "name": _mutate(lambda s, e, n: s["devices"][0].update(name="mshv")),
    "path": _mutate(lambda s, e, n: n.update(path="/dev/mshv")),
    "type": _mutate(lambda s, e, n: n.update(type="b")),
    "permissions": _mutate(lambda s, e, n: n.update(permissions="rwm")),
    "uid": _mutate(lambda s, e, n: n.update(uid=0)),
    "fileMode": _mutate(lambda s, e, n: n.update(fileMode=0o600)),
    "no-fileMode": _mutate(lambda s, e, n: n.pop("fileMode")),
    "gid": _mutate(lambda s, e, n: n.update(gid=0)),
    "env": _mutate(lambda s, e, n: e["env"].append("EXTRA=1")),
    "cdiVersion": _mutate(lambda s, e, n: s.update(cdiVersion="0.6.0")),
    "extra-device": _mutate(lambda s, e, n: s["devices"].append(
        {"name": "other", "containerEdits": {"env": ["A=1"]}})),
    "extra-edit": _mutate(lambda s, e, n: e.update(mounts=[{"hostPath": "/", "containerPath": "/host"}])),
    "spec-level-edit": _mutate(lambda s, e, n: s.update(containerEdits={"env": ["A=1"]})),
    "missing-edit": _mutate(lambda s, e, n: e.pop("env")),
    "reformatted": json.dumps(desired_spec("kvm", 65534, 65534)).encode(),
}

MALFORMED_CASES = {
    "not-json": b"this is not json\n",
    "truncated": DESIRED[: len(DESIRED) // 2],
    "empty": b"",
    "array": b"[]\n",
    "binary": b"\xff\xfe\x00garbage",
    "devices-not-list": _mutate(lambda s, e, n: s.update(devices="kvm")),
    "uid-string": _mutate(lambda s, e, n: n.update(uid="65534")),
    "fileMode-octal-string": _mutate(lambda s, e, n: n.update(fileMode="0666")),
    "env-not-strings": _mutate(lambda s, e, n: e.update(env=[1])),
    "edits-not-object": _mutate(lambda s, e, n: s["devices"][0].update(containerEdits=[])),
    "no-kind": _mutate(lambda s, e, n: s.pop("kind")),
}


def _written(data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> Callable[[Path], None]:
    def put(path: Path) -> None:
        path.write_bytes(data)
        os.chmod(path, mode)
        if owner is not None:
            os.chown(path, *owner)
    return put


def _setgid_directory(path: Path) -> None:
    os.chown(path.parent, 0, 4242)  # a group the spec must not inherit
    os.chmod(path.parent, 0o2755)


REPAIRS = [
    pytest.param(None, "missing", 0o022, id="missing-directory-with-parents"),
    pytest.param(lambda path: None, "missing", 0o022, id="missing"),
    pytest.param(_setgid_directory, "missing", 0o022, id="missing-in-a-setgid-directory", marks=needs_root),
    pytest.param(_written(DESIRED, 0o600), "metadata", 0o077, id="mode-also-against-the-umask"),
    pytest.param(_written(DESIRED, owner=(12345, 12345)), "metadata", 0o022, id="owner", marks=needs_root),
    *(pytest.param(_written(bad), "stale", 0o022, id=f"stale-{name}") for name, bad in STALE_CASES.items()),
    *(pytest.param(_written(bad), "malformed", 0o022, id=f"malformed-{name}")
      for name, bad in MALFORMED_CASES.items()),
]


@pytest.mark.parametrize(("damage", "cause", "umask"), REPAIRS)
async def test_a_wrong_or_missing_spec_is_repaired_once_and_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        damage: Callable[[Path], None] | None, cause: str, umask: int) -> None:
    cdi_dir = tmp_path / "a" / "b" / "cdi"
    rig = Reconciler(cdi_dir)
    if damage is not None:
        cdi_dir.mkdir(parents=True)
        damage(rig.path)
    assert not rig.cdi.ok
    old = os.umask(umask)
    try:
        with caplog.at_level(logging.INFO, logger="hlplugin.cdi"):
            # Twenty callers at once: one reconcile at a time, so one repair, and all see it.
            conditions = await asyncio.gather(*(rig.rec.reconcile(f"c{i}") for i in range(20)))
    finally:
        os.umask(old)
    assert conditions == [Condition(True)] * 20
    assert rig.rec.condition == Condition(True) == rig.cdi
    assert_desired(rig.path)  # our euid and egid: a setgid directory's group is not inherited
    if damage is None:
        assert stat.S_IMODE(os.stat(cdi_dir).st_mode) == 0o755
    assert rig.repairs(cause) == 1
    assert sum(rig.repairs(c) for c in CAUSES) == 1
    assert any("repaired" in r.getMessage() and cause in r.getMessage() for r in caplog.records)
    # Nothing to do the second time.
    before = state(rig.path)
    assert (await rig.rec.reconcile("periodic")).ok
    assert state(rig.path) == before
    assert sum(rig.repairs(c) for c in CAUSES) == 1


@pytest.mark.parametrize("shared", ["pass", "read"])
async def test_a_change_made_while_a_shared_pass_or_read_ran_is_never_answered_as_right(
        cdi_dir: Path, shared: str) -> None:
    """ensure() shares a pass or read already in flight; one that read the spec before a change
    made while it ran must not answer for the change. Without a watch running, inotify vouches
    for nothing, so only a read that began after the call may."""
    rig = Reconciler(cdi_dir)
    assert (await rig.rec.reconcile("start")).ok
    reads = Calls(rig.rec.producer.runner, "run")
    first = asyncio.create_task(rig.rec.reconcile("watch") if shared == "pass" else rig.rec.ensure())
    # One loop step at a time, so the read's completion is not yet seen when it has started.
    while not reads.began:
        await loop_turn()
    # Hold the loop (deliberately blocking) until the helper finished its read: the result is
    # then in, but the loop has not seen it, so the change below races it and comes first.
    deadline = time.monotonic() + 10
    while rig.rec.producer.runner.busy:
        assert time.monotonic() < deadline, "the read never finished"
        quiet_blocking(0.001, "a busy wait's step: the runner's helper is blocking on purpose")
    temp = cdi_dir / "tamper"
    temp.write_bytes(STALE)
    os.replace(temp, rig.path)  # atomically, as a tamperer or a stale writer would
    assert (await rig.rec.ensure()).ok
    assert rig.path.read_bytes() == DESIRED  # repaired before it said right
    assert rig.repairs("stale") == 1
    assert (await first).ok


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flags", [True, pytest.param(False, marks=pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the seccomp filter is x86_64 only"))],
    ids=["renameat2", "without-renameat2-flags"])
def test_ensure_is_cheap_when_right_repairs_what_it_can_reports_what_it_cannot(
        cdi_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, flags: bool) -> None:
    """Also where renameat2 has no flags (a filesystem without them, as some FUSE ones): the
    repairs fall back to check-and-rename, and say so once."""
    async def scenario() -> None:  # in the child, caplog's handler collects the child's records
        rig = Reconciler(cdi_dir)
        assert check_file(rig.path, DESIRED) == (False, f"{rig.path} is missing")
        rig.path.write_bytes(STALE)
        ok, diff = check_file(rig.path, DESIRED)
        assert not ok and diff.startswith("--- desired\n")
        assert '-            "uid": 65534,' in diff and '+            "uid": 1000,' in diff

        assert (await rig.rec.reconcile("start")).ok
        assert check_file(rig.path, DESIRED) == (True, "")
        assert_desired(rig.path)
        before = state(rig.path)
        for _ in range(100):
            assert (await rig.rec.ensure()).ok
        assert state(rig.path) == before  # never rewritten
        assert rig.repairs("stale") == 1

        # Same size, same mtime: only the bytes tell.
        st = os.stat(rig.path)
        tampered = DESIRED.replace(b'"rw"', b'"rx"')
        assert len(tampered) == len(DESIRED)
        rig.path.write_bytes(tampered)  # in place, the same inode
        os.utime(rig.path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(rig.path).st_mtime_ns == st.st_mtime_ns
        assert (await rig.rec.ensure()).ok
        assert_desired(rig.path)
        assert rig.repairs("stale") == 2

        os.chmod(rig.path, 0o666)
        assert (await rig.rec.ensure()).ok
        assert_desired(rig.path)
        assert rig.repairs("metadata") == 1

        rig.path.unlink()
        assert (await rig.rec.ensure()).ok
        assert_desired(rig.path)
        assert rig.repairs("missing") == 1

        # What it cannot repair (a symlink) it reports, and leaves alone.
        rig.path.unlink()
        rig.path.symlink_to(tmp_path / "nowhere")
        reason = f"{rig.path} is a symlink; refusing to replace what we do not own"
        assert await rig.rec.ensure() == Condition(False, reason) == rig.cdi
        assert rig.path.is_symlink() and not (tmp_path / "nowhere").exists()
        assert temp_files(cdi_dir) == []
        warnings = [r for r in caplog.records if "does not support renameat2" in r.getMessage()]
        assert len(warnings) == (0 if flags else 1)

    forked(lambda: None if flags else _kernel_without_renameat2_flags(), scenario)


@pytest.mark.timeout(60)
async def test_run_removes_crash_leftovers_repairs_promptly_and_touches_nothing_else(
        cdi_dir: Path, tmp_path: Path) -> None:
    """That a reader never sees the spec torn, empty or missing while repairs replace it is
    test_faults' SIGKILL and atomic replacement rows, readers in other processes."""
    sibling = cdi_dir / "vendor.example.json"
    sibling.write_bytes(b'{"cdiVersion": "0.3.0", "kind": "example.com/x", "devices": []}\n')
    os.chmod(sibling, 0o600)
    lookalikes = [cdi_dir / "hyperlight.json.bak", cdi_dir / ".hyperlight.json.swp",
                  cdi_dir / ".other.json.tmp-1", cdi_dir / "other.json", cdi_dir / "hyperlight.json.tmp-x"]
    for path in lookalikes:
        path.write_bytes(STALE)
    # A crash's leftovers: regular files with our prefix; a symlink or a directory with it is not.
    leftovers = [cdi_dir / f"{TEMP_PREFIX}deadbeef", cdi_dir / f"{TEMP_PREFIX}0123"]
    for path in leftovers:
        path.write_bytes(DESIRED[:10])
    target = tmp_path / "target.txt"
    target.write_bytes(b"keep")
    link = cdi_dir / f"{TEMP_PREFIX}link"
    link.symlink_to(target)
    temp_dir = cdi_dir / f"{TEMP_PREFIX}dir"
    temp_dir.mkdir()
    neighbours = {p: state(p) for p in [sibling, *lookalikes, target, link, temp_dir]}
    rig = Reconciler(cdi_dir, interval=60.0)
    assert rig.rec.file.cleanup_leftovers() == 2
    assert not any(p.exists() for p in leftovers)
    leftovers[0].write_bytes(b"partial")  # run() removes it at start
    timings: dict[str, float] = {}
    # With a 60 s interval, only the watcher can explain a repair within the guard.
    async with running(rig.rec):
        await wait_until(lambda: rig.cdi.ok)
        assert not leftovers[0].exists()
        assert_desired(rig.path)
        tamper = cdi_dir / "tamper.json.new"
        for i in range(300):
            tamper.write_bytes(STALE)  # replaced atomically
            if i % 2:
                os.chmod(tamper, 0o600)
            os.rename(tamper, rig.path)
            await wait_until(lambda: spec_is_exact(rig.path, DESIRED), step=0.001)
        await wait_until(lambda: rig.repairs("stale") == 300)  # counted just after the rename
        rig.path.unlink()
        timings["deleted"] = await wait_until(lambda: spec_is_exact(rig.path, DESIRED))
        for _ in range(5):
            rig.path.write_bytes(STALE)  # in place
            timings["rewritten"] = await wait_until(lambda: spec_is_exact(rig.path, DESIRED))
        os.chmod(rig.path, 0o600)
        timings["chmod"] = await wait_until(lambda: spec_is_exact(rig.path, DESIRED))
        # A bounded watch, 50 ms: the inotify events of our own repairs arrive within a
        # millisecond or two, and a repair they caused would show in the counts below.
        await quiet(0.05, "a bounded watch for a repair our own repairs' events would cause")
    assert_desired(rig.path)
    assert rig.repairs("missing") == 2 and rig.repairs("metadata") == 1
    assert rig.repairs("stale") + rig.repairs("malformed") == 300 + 5
    assert rig.cdi.ok
    assert {p: state(p) for p in neighbours} == neighbours
    assert temp_files(cdi_dir) == sorted([link.name, temp_dir.name])
    print("repair latency (s):", {k: round(v, 4) for k, v in timings.items()})


def _kernel_without_renameat2_flags() -> None:
    """Make this process's kernel answer renameat2 with any flag EINVAL, as a filesystem without
    RENAME_EXCHANGE/RENAME_NOREPLACE does (FUSE without rename2, ...): a seccomp filter, inherited
    by the threads started afterwards. x86_64 only (the system call number and argument offset).
    """
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, einval = 0x7FFF0000, 0x00050000 | errno.EINVAL
    program = [  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k
        (ld, 0, 0, 4), (jeq, 0, 5, 0xC000003E),  # arch == x86_64
        (ld, 0, 0, 0), (jeq, 0, 3, 316),  # nr == renameat2
        (ld, 0, 0, 48), (jeq, 1, 0, 0),  # args[4] (flags) == 0
        (ret, 0, 0, einval), (ret, 0, 0, allow),
    ]
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))
    prog = struct.pack("=H6xQ", len(program), ctypes.addressof(filters))  # struct sock_fprog
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, prog, 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    with pytest.raises(OSError, match=r"\[Errno 22\]"):  # ENOENT, were it not for the filter
        exchange(Path("/nonexistent-a"), Path("/nonexistent-b"))


async def test_run_repairs_periodically_but_never_more_often_than_the_floor(
        cdi_dir: Path, tmp_path: Path) -> None:
    """An interval of 0 (an in-process caller; the CLI refuses it) is not a busy loop; and the
    periodic pass repairs what the watcher cannot see."""
    began: dict[int, float] = {}  # passes completed -> when the next one began

    def clock() -> float:  # first read while N passes are done: pass N + 1 starting
        return began.setdefault(checks.ended, time.monotonic())

    rig = Reconciler(cdi_dir, interval=0, clock=clock)
    checks = Calls(rig.rec.producer, "check")  # a pass each
    alias = tmp_path / "alias.json"
    passes = began.values()  # in order of insertion: pass by pass

    async with running(rig.rec):
        await wait_until(lambda: len(passes) >= 5)
        assert rig.cdi.ok
        # A write through a hard link in another directory raises no event in the CDI directory.
        os.link(rig.path, alias)
        alias.write_bytes(STALE)  # in place, the same inode
        await wait_until(lambda: spec_is_exact(rig.path, DESIRED))
    # The first pass's own write may wake the watcher once; the passes after it are periodic.
    gaps = [b - a for a, b in itertools.pairwise(list(passes)[1:5])]
    assert min(gaps) >= MIN_PERIOD * 0.9, gaps
    assert alias.read_bytes() == STALE  # the old inode, no longer our spec
    assert_desired(rig.path)
    # A pass may land between the overwrite's truncate and its write (an empty or partial file),
    # so how many repairs and which causes depend on timing; at least one happened.
    assert sum(rig.repairs(c) for c in CAUSES) >= 1
