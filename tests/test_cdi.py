"""The CDI spec reconciler against real files, real inotify and, as root, real mounts."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401  (to_thread's, imported before any fork)
import contextlib
import ctypes
import errno
import itertools
import json
import logging
import os
import platform
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import needs_root, running, sh, spec_is_exact, split_settings, temp_files, wait_until
from support.observers import Calls
from support.waits import loop_turn, quiet, quiet_blocking

import hlplugin.cdi
from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import SPEC_FILE, TEMP_PREFIX, check_file, desired_spec, render_spec
from hlplugin.deviceplugin.health.conditions import MIN_PERIOD, Condition, HealthTracker
from hlplugin.metrics import Metrics
from hlplugin.settings import CdiSettings

SCHEMA_DIR = Path(__file__).parent / "data" / "cdi-schema"
DESIRED = render_spec("kvm", 65534, 65534)
STALE = render_spec("kvm", 1000, 1000)  # well-formed, another uid/gid


class Reconciler:
    """A reconciler in process, wired to a real tracker and metrics registry (harness.Rig is the
    daemon's, on a kubelet)."""

    def __init__(self, cdi_dir: Path, **kwargs: Any) -> None:
        self.tracker = HealthTracker(required=("cdi",))
        self.metrics = Metrics()
        settings, rest = split_settings(CdiSettings, kwargs, dir=cdi_dir)
        self.rec = CdiReconciler(settings, DESIRED, tracker=self.tracker, metrics=self.metrics, **rest)
        self.path = cdi_dir / SPEC_FILE

    def repairs(self, cause: str) -> float:
        return self._count("repairs", cause=cause)

    def refusals(self, reason: str) -> float:
        return self._count("refusals", reason=reason)

    def _count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(f"hyperlight_cdi_{name}_total", labels) or 0.0

    @property
    def cdi(self) -> Condition:
        return self.tracker.state.conditions["cdi"]


@pytest.fixture
def cdi_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cdi"
    path.mkdir()
    return path


def assert_desired(path: Path) -> None:
    """Our spec, as we own it (valid CDI: test_rendered_spec_validates_against_the_cdi_schema)."""
    assert spec_is_exact(path, DESIRED)
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def state(path: Path) -> object:
    """What is at ``path``, not followed: identity, and its bytes, target, entries or device."""
    try:
        st = os.lstat(path)
    except OSError:  # nothing there (or no directory for it)
        return None
    identity = st.st_ino, st.st_mode, st.st_mtime_ns, st.st_size
    if stat.S_ISLNK(st.st_mode):
        return identity, os.readlink(path)
    if stat.S_ISDIR(st.st_mode):
        return identity, {name: state(path / name) for name in os.listdir(path)}
    return identity, path.read_bytes() if stat.S_ISREG(st.st_mode) else st.st_rdev


def test_desired_spec_is_exactly_the_documented_content_rendered_deterministically() -> None:
    assert hlplugin.cdi_spec.qualified_name("kvm") == "hyperlight.dev/hypervisor=kvm"
    assert desired_spec("kvm", 65534, 65533) == {
        "cdiVersion": "0.3.0",
        "kind": hlplugin.cdi_spec.KIND,
        "devices": [{
            "name": "kvm",
            "containerEdits": {
                "deviceNodes": [{"path": "/dev/kvm", "type": "c", "permissions": "rw",
                                 "fileMode": 0o666, "uid": 65534, "gid": 65533}],
                "env": ["HYPERLIGHT_HYPERVISOR=kvm", "HYPERLIGHT_DEVICE_PATH=/dev/kvm"],
            },
        }],
    }
    mshv = desired_spec("mshv", 0, 0)["devices"][0]["containerEdits"]
    assert mshv["deviceNodes"][0]["path"] == "/dev/mshv"
    assert mshv["env"] == ["HYPERLIGHT_HYPERVISOR=mshv", "HYPERLIGHT_DEVICE_PATH=/dev/mshv"]
    # Rendered deterministically, with a decimal fileMode.
    first = render_spec("kvm", 65534, 65534)
    assert first == render_spec("kvm", 65534, 65534)
    assert first.endswith(b"}\n") and not first.endswith(b"\n\n")
    assert json.loads(first) == desired_spec("kvm", 65534, 65534)
    assert first.startswith(b'{\n  "cdiVersion": "0.3.0",\n  "kind": "hyperlight.dev/hypervisor",')
    assert render_spec("kvm", 1, 2) != first
    # Without fileMode, containerd 2.x gives the container's node the host's mode (0600 here), so
    # only DEVICE_UID could open it. JSON has no octal: Go decodes 438 into os.FileMode 0o666.
    node = json.loads(first)["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node["fileMode"] == 438 == 0o666
    assert type(node["fileMode"]) is int
    assert b'"fileMode": 438,' in first


# Fields each CDI version up to CDI_VERSION (0.3.0) knows; anything newer would need a newer
# cdiVersion (see the version table in tests/data/cdi-schema's source, SPEC.md).
FIELDS_0_3_0 = {
    "spec": {"cdiVersion", "kind", "devices", "containerEdits"},
    "device": {"name", "containerEdits"},
    "edits": {"env", "deviceNodes", "hooks", "mounts"},
    "node": {"path", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"},
}


@pytest.mark.parametrize("hypervisor", ["kvm", "mshv"])
def test_cdi_version_covers_every_field_we_write(hypervisor: str) -> None:
    spec = desired_spec(hypervisor, 65534, 65534)
    assert spec["cdiVersion"] == hlplugin.cdi_spec.CDI_VERSION == "0.3.0"
    assert set(spec) <= FIELDS_0_3_0["spec"]
    vendor, _, name = spec["kind"].partition("/")
    assert vendor and "." not in name  # a dot in the name segment needs 0.6.0
    for device in spec["devices"]:
        assert set(device) <= FIELDS_0_3_0["device"]
        assert device["name"][0].isalpha()  # a leading digit needs 0.5.0
        edits = device["containerEdits"]
        assert set(edits) <= FIELDS_0_3_0["edits"]
        for node in edits["deviceNodes"]:
            assert set(node) <= FIELDS_0_3_0["node"]  # hostPath would need 0.5.0


@pytest.mark.skipif(not (SCHEMA_DIR / "schema.json").is_file(),
                    reason=f"CDI reference schema not found at {SCHEMA_DIR}")
@pytest.mark.parametrize(("hypervisor", "uid", "gid"),
                         [("kvm", 65534, 65534), ("mshv", 0, 4_294_967_295)])
def test_rendered_spec_validates_against_the_cdi_schema(hypervisor: str, uid: int, gid: int) -> None:
    from jsonschema import Draft7Validator, ValidationError
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    defs = Resource.from_contents(json.loads((SCHEMA_DIR / "defs.json").read_text()),
                                  default_specification=DRAFT7)
    registry: Registry[Any] = Registry().with_resource("defs.json", defs)
    validator = Draft7Validator(json.loads((SCHEMA_DIR / "schema.json").read_text()), registry=registry)
    validator.validate(json.loads(render_spec(hypervisor, uid, gid)))
    with pytest.raises(ValidationError):  # the validator does check what we rely on
        validator.validate(desired_spec("kvm", -1, 0))


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
CAUSES = ("missing", "malformed", "stale", "metadata")


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

    _forked(lambda: None if flags else _kernel_without_renameat2_flags(), scenario)


def _forked(prepare: Callable[[], None], scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``prepare``, then ``scenario()`` on its own loop with a guard, in a forked child (the
    fork is no test: it never returns into pytest); a failure there fails the test, traceback and
    all."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            prepare()
            asyncio.run(asyncio.wait_for(scenario(), 60))
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
            os._exit(1)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        failure = f.read().decode()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, failure


def _become_nobody() -> None:
    os.setgroups([])
    os.setegid(65534)
    os.seteuid(65534)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _hostile(kind: str, tmp_path: Path,
             stack: contextlib.ExitStack) -> tuple[Path, Callable[[], object], str]:
    """A CDI dir with something not ours at our path, or on storage where writes fail: the dir,
    what undoes the harm, and the cause of the repair that follows. What an obstruction points
    to lies in ``tmp_path/outside``."""
    outside, cdi_dir = tmp_path / "outside", tmp_path / "cdi"
    outside.mkdir()
    cdi_dir.mkdir()
    path = cdi_dir / SPEC_FILE
    if "symlink" in kind:
        target = outside / kind  # a dangling symlink's is never created
        if kind != "dangling-symlink":
            target.write_bytes(DESIRED if kind == "symlink-to-desired-copy" else b"not yours\n")
            os.chmod(target, 0o644)
        path.symlink_to(target)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    elif kind == "device-node":
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))
    elif kind == "mount-point":
        (outside / "mounted.json").write_bytes(STALE)
        path.write_bytes(b"")
        sh("mount", "--bind", str(outside / "mounted.json"), str(path))
        stack.callback(subprocess.run, ["umount", str(path)], check=False)
        # Unmounting raises no inotify event in the directory: a retry finds the empty file.
        return cdi_dir, lambda: sh("umount", str(path)), "malformed"
    elif kind == "not-creatable":  # a file where the directory belongs
        blocker = tmp_path / "blocker"
        blocker.write_bytes(b"a file where a directory should be")
        return blocker / "cdi", blocker.unlink, "missing"
    elif kind == "cdi-dir-is-a-file":  # `--cdi-dir FILE` at start is exit 2; this is later
        blocker = tmp_path / "blocker"
        blocker.write_bytes(b"a file where a directory should be")
        return blocker, blocker.unlink, "missing"
    elif kind == "permission-denied":
        # pytest's tmp_path lies under a 0700 directory that user 65534 cannot walk.
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hlplugin-cdi-")))
        os.chmod(base, 0o755)
        cdi_dir = base / "cdi"
        cdi_dir.mkdir()
        os.chown(cdi_dir, 65534, 65534)
        os.chmod(cdi_dir, 0o555)
        return cdi_dir, lambda: os.chmod(cdi_dir, 0o755), "missing"
    else:  # read-only or full storage, holding a stale spec
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        size = "1m" if kind == "read-only" else "16k"
        sh("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt))
        stack.callback(subprocess.run, ["umount", str(mnt)], check=False)
        cdi_dir = mnt / "cdi"
        cdi_dir.mkdir()
        (cdi_dir / SPEC_FILE).write_bytes(STALE)
        if kind == "read-only":
            sh("mount", "-o", "remount,ro", str(mnt))
            return cdi_dir, lambda: sh("mount", "-o", "remount,rw", str(mnt)), "stale"
        filler = cdi_dir / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        assert os.statvfs(mnt).f_bavail == 0
        return cdi_dir, filler.unlink, "stale"
    return cdi_dir, lambda: _remove(path), "missing"


def _row(kind: str, refusal: str, detail: str, root: bool = False) -> Any:
    return pytest.param(kind, refusal, detail, id=kind, marks=needs_root if root else ())


HOSTILE = [
    *(_row(kind, "not_regular", "a symlink")
      for kind in ("symlink-to-desired-copy", "symlink-outside", "dangling-symlink")),
    _row("directory", "not_regular", "a directory"),
    _row("fifo", "not_regular", "a FIFO"),
    _row("socket", "not_regular", "a socket"),
    _row("device-node", "not_regular", "a character device", root=True),
    _row("mount-point", "not_regular", "a mount point", root=True),
    # a file where an ancestor directory belongs, or the directory itself
    _row("not-creatable", "write_failed", "{cdi_dir} cannot be a directory: {blocker} is not a "
                                          "directory (ENOTDIR)"),
    _row("cdi-dir-is-a-file", "write_failed", "{cdi_dir} is not a directory (EEXIST)"),
    _row("permission-denied", "write_failed", "Permission denied (EACCES)", root=True),
    _row("read-only", "write_failed", "Read-only file system (EROFS)", root=True),
    _row("full", "write_failed", "No space left on device (ENOSPC)", root=True),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "refusal", "detail"), HOSTILE)
def test_hostile_path_or_storage_is_refused_left_alone_retried_and_recovers(
        tmp_path: Path, kind: str, refusal: str, detail: str) -> None:
    with contextlib.ExitStack() as stack:
        cdi_dir, fix, cause = _hostile(kind, tmp_path, stack)
        path, outside = cdi_dir / SPEC_FILE, tmp_path / "outside"
        before, kept = state(path), {p: state(p) for p in outside.iterdir()}
        if refusal == "not_regular" and kind != "mount-point":  # it neither follows nor blocks
            assert check_file(path, DESIRED) == (False, f"{path} is not a regular file ({detail})")
        detail = detail.format(cdi_dir=cdi_dir, blocker=tmp_path / "blocker")
        reason = (f"{path} is {detail}; refusing to replace what we do not own"
                  if refusal == "not_regular" else f"cannot write {path}: {detail}")

        async def scenario() -> None:
            rig = Reconciler(cdi_dir, max_backoff=0.01)
            assert await rig.rec.reconcile("start") == Condition(False, reason) == rig.cdi
            assert rig.refusals(refusal) == 1
            assert not (await rig.rec.ensure()).ok
            assert rig.refusals(refusal) == 2 == rig.refusals("not_regular") + rig.refusals("write_failed")
            assert state(path) == before
            assert temp_files(cdi_dir) == []  # a temp file made for a failed write is removed
            async with running(rig.rec):
                await wait_until(lambda: rig.refusals(refusal) >= 5)  # retrying
                assert state(path) == before and not rig.cdi.ok  # never replaced, never deleted
                fix()
                await wait_until(lambda: rig.cdi.ok)
            assert_desired(path)  # owned by whoever we run as
            assert check_file(path, DESIRED) == (True, "")
            assert rig.repairs(cause) == 1 == sum(rig.repairs(c) for c in CAUSES)
            assert temp_files(cdi_dir) == []
            # Our own file made unreadable to us (to root, merely of the wrong mode).
            os.chmod(path, 0o000)
            assert (await rig.rec.reconcile("periodic")).ok
            assert_desired(path)
            assert rig.repairs("metadata") == 1

        # In a forked child, as root or (permission-denied) as user 65534, a non-root daemon.
        _forked(_become_nobody if kind == "permission-denied" else lambda: None, scenario)
    assert {p: state(p) for p in outside.iterdir()} == kept


_LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE = 1


def exchange(a: Path, b: Path, flags: int = 2) -> None:
    """renameat2(RENAME_EXCHANGE, or RENAME_NOREPLACE with flags=1), written here apart from
    the code under test."""
    if _LIBC.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), flags) != 0:  # AT_FDCWD
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a))


class Swapper:
    """Someone with write access to the CDI directory (a fake of the world) who, while a repair
    runs, keeps exchanging its object at ``side`` (a symlink or a directory) with whatever is at
    our ``path``; or ("gap") keeps moving its symlink from our path to ``side`` and back, so our
    path is now missing, now the symlink. None of its moves destroys anything: if after a pass
    its object is at neither name, the repair replaced it. What the exchanges move to ``side`` is
    what a runtime could have read at our path."""

    def __init__(self, path: Path, side: Path) -> None:
        self.path, self.side, self.kind, self.swaps = path, side, "", 0
        self.go, self.halt, self.halted = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="swapper", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def racing(self, kind: str) -> Iterator[None]:
        self.kind = kind
        self.halt.clear()
        self.halted.clear()
        self.go.set()
        try:
            yield
        finally:
            self.halt.set()
            assert self.halted.wait(5.0), "the swapper hung"  # a guard

    def _run(self) -> None:
        while self.go.wait() and self.kind:
            self.go.clear()
            while not self.halt.is_set():
                if self.kind == "gap":  # never over anything: nothing is lost by its doing
                    for a, b in ((self.path, self.side), (self.side, self.path)):
                        with contextlib.suppress(FileNotFoundError, FileExistsError):
                            exchange(a, b, RENAME_NOREPLACE)
                else:
                    exchange(self.side, self.path)
                self.swaps += 1
            self.halted.set()

    def stop(self) -> None:
        self.kind = ""
        self.go.set()
        self.thread.join(5.0)


@pytest.mark.timeout(120)
async def test_a_symlink_or_directory_swapped_in_during_repairs_is_never_replaced(
    cdi_dir: Path, tmp_path: Path,
) -> None:
    """Thousands of repairs, each raced by a Swapper: its object survives, its symlink's target is
    never written, and every regular file at either name is the stale spec or exactly ours."""
    rounds, budget = 3000, 20.0
    target = tmp_path / "victim.txt"
    target.write_bytes(b"not yours\n")
    rig = Reconciler(cdi_dir, interval=60.0)
    side = cdi_dir / "intruder"
    swapper = Swapper(rig.path, side)
    tally = {"rounds": 0, "ours_seen": 0}
    outcomes: Counter[str] = Counter()

    start = time.monotonic()
    for i in range(rounds):
        if time.monotonic() - start > budget:
            break
        # Our path holds a stale spec to repair and the object waits at the side name; or, for
        # "gap", the object is at our path.
        kind = ("symlink", "directory", "gap")[i % 3]
        for path in (rig.path, side):
            if path.is_symlink() or path.exists():
                _remove(path)
        if kind == "gap":
            rig.path.symlink_to(target)
        else:
            rig.path.write_bytes(STALE)
        if kind == "symlink":
            side.symlink_to(target)
        elif kind == "directory":
            side.mkdir()
            (side / "inside").write_bytes(b"x")
        its = state(rig.path if kind == "gap" else side)  # its object, and what is in it
        with swapper.racing(kind):  # halts it however the pass ends
            condition = await rig.rec.reconcile("race")
        tally["rounds"] += 1
        key = "ok" if condition.ok else condition.reason.split(" is ", 1)[-1].split(";")[0]
        outcomes[key] += 1
        assert its in (state(rig.path), state(side)), f"replaced in round {i}: {tally}, {outcomes}"
        assert temp_files(cdi_dir) == []
        for path in (rig.path, side):  # a regular file there is the stale spec or exactly ours
            if path.is_file() and not path.is_symlink():
                ours = spec_is_exact(path, DESIRED)
                assert ours or path.read_bytes() == STALE, path.read_bytes()
                tally["ours_seen"] += ours
    swapper.stop()
    print("race:", tally, "swaps:", swapper.swaps, "outcomes:", outcomes)
    assert target.read_bytes() == b"not yours\n"
    assert rig.refusals("write_failed") == 0, outcomes
    # At least 200 rounds even on a loaded machine; the old code lost the object in 4-6 % of them.
    assert tally["rounds"] >= 200 and tally["ours_seen"] > 0, tally


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
