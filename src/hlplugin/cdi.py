"""The CDI spec that tells container runtimes how to hand /dev/<hypervisor> to a workload.

We own exactly one file, ``<cdi_dir>/hyperlight.json``. The reconciler keeps it byte-identical to
the desired content (mode 0644, owned by us), replacing it atomically so a runtime reading it at
any moment sees the whole old or the whole new spec. Anything that is not a regular file at our
path (or a mount point) is not ours: we refuse to touch it and report unhealthy until someone
removes it, even if it is swapped in while we write (renameat2 RENAME_EXCHANGE: we inspect what we
displaced and put back what is not ours). Nothing else in the directory is modified, and the spec
is never deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import difflib
import errno
import functools
import itertools
import json
import logging
import os
import platform
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from hlplugin.deviceplugin.bounded import CheckFailed
from hlplugin.deviceplugin.conditions import Condition, HealthTracker
from hlplugin.deviceplugin.files import kind_of
from hlplugin.deviceplugin.producer import Producer
from hlplugin.deviceplugin.watch import FILE_EVENTS, DirWatcher
from hlplugin.dirs import not_a_directory
from hlplugin.metrics import Metrics
from hlplugin.names import HYPERVISOR_RESOURCE

log = logging.getLogger(__name__)

SPEC_FILE = "hyperlight.json"
TEMP_PREFIX = ".hyperlight.json.tmp-"
KIND = HYPERVISOR_RESOURCE
MODE = 0o644
CONDITION = "cdi"
# Far larger than any spec we write; bounds what a foreign file can make us read or diff.
_MAX_READ = 1 << 20
# How long one pass (read, compare, write, two fsyncs) may take before the condition fails.
DEFAULT_BUDGET = 5.0
# How long the pass's helper thread waits for the next read: one per Allocate needs no new thread.
_LINGER = 1.0
# How long a right read is trusted while the directory's inotify watch is live and saw nothing:
# local changes always wake the watch; this bounds what it cannot see (a mount over the
# directory, a change made on another host of a network file system).
_TRUST_QUIET = 1.0


def qualified_name(hypervisor: str) -> str:
    """The fully qualified CDI device name that runtimes resolve, e.g. for Allocate."""
    return f"{KIND}={hypervisor}"


# --- desired content -----------------------------------------------------------------------------


# Consumers reject a cdiVersion newer than they know (podman 4.3 rejects 0.6.0) and one older than
# the fields a spec uses need. Every field we write (fileMode included) is in the spec since its
# first tagged release, 0.3.0. test_cdi_version_covers_every_field_we_write and the podman tests
# (podman 4.3.1 resolves our spec) guard this.
CDI_VERSION = "0.3.0"
# The mode of the node *in the container* (the host's node is untouched). Stated because runtimes
# disagree when it is missing: runc, under podman, makes it 0666; containerd 2.x copies the host's
# mode (0600 or 0660 root:kvm), so a workload whose UID is not DEVICE_UID gets EACCES. 0666 lets
# any UID in the container open the one device it was allocated: the container's /dev is its own,
# the device cgroup admits this node only, and nothing else becomes reachable.
DEVICE_FILE_MODE = 0o666


def desired_spec(hypervisor: str, uid: int, gid: int) -> dict[str, Any]:
    """One device, ``<hypervisor>``: its node (owned by uid/gid, mode 0666), and two env vars."""
    device_path = f"/dev/{hypervisor}"
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": hypervisor,
            "containerEdits": {
                # JSON has no octal: fileMode is Go's os.FileMode, a decimal number (438).
                "deviceNodes": [{"path": device_path, "type": "c", "permissions": "rw",
                                 "fileMode": DEVICE_FILE_MODE, "uid": uid, "gid": gid}],
                "env": [f"HYPERLIGHT_HYPERVISOR={hypervisor}",
                        f"HYPERLIGHT_DEVICE_PATH={device_path}"],
            },
        }],
    }


def render_spec(hypervisor: str, uid: int, gid: int) -> bytes:
    """Deterministic bytes (fixed key order, indent 2, trailing newline): equal means unchanged."""
    return (json.dumps(desired_spec(hypervisor, uid, gid), indent=2) + "\n").encode()


# --- reading without trusting the path -----------------------------------------------------------


class NotRegular(Exception):
    """Something other than a regular file sits at the path; ``str()`` says what."""


def _read(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """Up to ``limit`` bytes and the fstat of a regular file; None when missing.

    lstat first, then O_NOFOLLOW|O_NONBLOCK and fstat: never follows a symlink, never blocks on a
    FIFO, and a swap between the two checks is still caught.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(kind_of(st.st_mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(kind_of(st.st_mode))
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def check_file(path: Path, desired: bytes) -> tuple[bool, str]:
    """(True, "") when ``path`` holds exactly ``desired``; else (False, what differs).

    Content only: mode and owner depend on who runs the check.
    """
    try:
        found = _read(path, _MAX_READ)
    except NotRegular as exc:
        return False, f"{path} is not a regular file ({exc})"
    except OSError as exc:
        return False, f"{path} cannot be read: {exc.strerror}"
    if found is None:
        return False, f"{path} is missing"
    content, _ = found
    if content == desired:
        return True, ""
    diff = difflib.unified_diff(
        desired.decode(errors="replace").splitlines(keepends=True),
        content.decode(errors="replace").splitlines(keepends=True),
        fromfile="desired", tofile=str(path))
    return False, "".join(diff) or f"{path} differs from the desired content"


# --- classification ------------------------------------------------------------------------------


def _list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) for v in value)


def _edits_well_formed(edits: Any) -> bool:
    if not isinstance(edits, dict) or not _list_of(edits.get("env", []), str):
        return False
    if not all(_list_of(edits.get(k, []), dict)
               for k in ("deviceNodes", "mounts", "hooks", "netDevices")):
        return False
    for node in edits.get("deviceNodes", []):
        if not isinstance(node.get("path"), str):
            return False
        if any(k in node and not isinstance(node[k], str)
               for k in ("type", "permissions", "hostPath")):
            return False
        if any(k in node and type(node[k]) is not int for k in ("uid", "gid", "major", "minor", "fileMode")):
            return False
    return True


def _well_formed(content: bytes) -> bool:
    """Enough of the CDI shape to tell a stale spec from garbage (only for the repair metric)."""
    try:
        doc = json.loads(content)
    except ValueError:
        return False
    if not isinstance(doc, dict) or not isinstance(doc.get("cdiVersion"), str):
        return False
    if not isinstance(doc.get("kind"), str) or not _list_of(doc.get("devices"), dict):
        return False
    if not all(isinstance(d.get("name"), str) and _edits_well_formed(d.get("containerEdits"))
               for d in doc["devices"]):
        return False
    return "containerEdits" not in doc or _edits_well_formed(doc["containerEdits"])


# --- renameat2 -----------------------------------------------------------------------------------

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# The kernel says EINVAL when a filesystem lacks the flags (FUSE without rename2, ...); ENOSYS
# when the kernel lacks renameat2 (before 3.15) or libc lacks a way to call it.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
_MAX_INSTALL_ATTEMPTS = 100
# renameat2's system call number, for a libc without the wrapper (glibc before 2.28).
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "armv7l": 382, "armv8l": 382,
                  "i686": 353, "i386": 353, "ppc64le": 357, "ppc64": 357, "s390x": 347}
_Renameat2 = Callable[[int, bytes, int, bytes, int], int]


def _load_renameat2() -> _Renameat2 | None:
    libc = ctypes.CDLL(None, use_errno=True)
    func = getattr(libc, "renameat2", None)
    if func is not None:
        func.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint)
        func.restype = ctypes.c_int
        return cast(_Renameat2, func)
    number = _SYS_RENAMEAT2.get(platform.machine())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long

    def via_syscall(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(old),
                           ctypes.c_int(newdirfd), ctypes.c_char_p(new), ctypes.c_uint(flags)))

    return via_syscall


_renameat2 = _load_renameat2()


def renameat2(dir_fd: int, old: str, new: str, flags: int) -> None:
    """Linux renameat2(2) within one directory; raises OSError like the os module does."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), old)
    if _renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old, None, new)


def _put_back(dir_fd: int, temp: str) -> None:
    """Return what an exchange displaced (now at ``temp``) to our path; what is there now (our
    file, normally) goes to ``temp``. If our path is empty meanwhile, a no-replace move."""
    error: OSError | None = None
    # Exchange; if our path emptied meanwhile (ENOENT), move; if it filled again (EEXIST), ...
    attempts = ((RENAME_EXCHANGE, errno.ENOENT), (RENAME_NOREPLACE, errno.EEXIST))
    for flags, again in itertools.islice(itertools.cycle(attempts), 2 * _MAX_INSTALL_ATTEMPTS):
        try:
            renameat2(dir_fd, temp, SPEC_FILE, flags)
            return
        except OSError as exc:
            error = exc
            if exc.errno != again:
                break
    log.warning("could not return what was at %s to its place; it is at %s: %s",
                SPEC_FILE, temp, error.strerror if error else "")


def _discard_temp(dir_fd: int, temp: str) -> None:
    """Remove our temp name if it holds a regular file: the file we wrote, or the old spec an
    exchange took from our path. Anything else (what an exchange took and could not put back)
    is not ours to delete, and stays."""
    try:
        st = os.stat(temp, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            os.unlink(temp, dir_fd=dir_fd)
        else:
            log.warning("left %s in place: it is %s, not ours", temp, kind_of(st.st_mode))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove our temp file %s: %s", temp, exc.strerror)


# --- the reconciler ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """What one pass found and did; applied to condition, tracker and metrics on the event loop."""

    condition: Condition
    repaired: str = ""  # the repair's cause, when we rewrote the file
    refused: str = ""  # "not_regular" or "write_failed"


class CdiReconciler:
    """Keeps ``<cdi_dir>/hyperlight.json`` equal to ``desired``; reports condition ``cdi``."""

    def __init__(
        self,
        cdi_dir: Path,
        desired: bytes,
        *,
        tracker: HealthTracker | None = None,
        metrics: Metrics | None = None,
        interval: float = 10.0,
        max_backoff: float = 10.0,
        budget: float = DEFAULT_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cdi_dir = cdi_dir
        self.path = cdi_dir / SPEC_FILE
        self.desired = desired
        self.interval = interval
        self.max_backoff = max_backoff
        self.condition = Condition(False, "not checked yet")
        self._tracker = tracker
        self._metrics = metrics
        # Passes run one at a time in the producer's runner (at most one helper thread, even
        # after a caller gave up), bounded by ``budget``: hung storage fails the condition.
        self.producer = Producer(
            "cdi", self._step, watch=[DirWatcher(cdi_dir, {SPEC_FILE, ""}, events=FILE_EVENTS)],
            interval=interval, max_backoff=max_backoff, budget=budget, linger=_LINGER,
            clock=clock)
        self._quick: asyncio.Task[bool] | None = None
        # When the latest read that found the spec right began (a quick read or a pass), and the
        # watch pulse taken just before it.
        self._verified: tuple[float, asyncio.Event] | None = None
        self._uid = os.geteuid()
        self._gid = os.getegid()
        self._warned_no_exchange = False

    def _is_right(self, content: bytes, st: os.stat_result) -> bool:
        return content == self.desired and self._metadata_right(st)

    def _metadata_right(self, st: os.stat_result) -> bool:
        return (stat.S_IMODE(st.st_mode) == MODE and st.st_uid == self._uid
                and st.st_gid == self._gid)

    @property
    def last_reconcile(self) -> float | None:
        """clock() when the last pass finished."""
        return self.producer.completed_at

    async def ensure(self) -> Condition:
        """Before every Allocate: a read and a byte compare when all is well, a repair if not.

        Off the event loop, within the budget. The answer rests on a read that began after the
        call arrived, or on an earlier one that inotify says nothing has changed since: a pass or
        read in flight is shared, then judged by that rule, so a change made while it ran is never
        answered with its stale result. While a helper stuck in hung storage holds the runner, the
        failing condition (naming the timeout) answers at once.
        """
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        for _ in range(3):  # a shared result, then our own read; the full pass below is the last word
            if self.condition.ok and self._still_right(arrived, loop.time()):
                return self.condition
            if self.producer.runner.busy and not self.condition.ok:
                return self.condition  # stuck (passes queued behind it would only wait their budget)
            if (in_flight := self.producer.in_flight) is not None:
                await asyncio.shield(in_flight)
                if not self.condition.ok:
                    return self.condition
                continue
            if not self.condition.ok:
                break
            quick = self._quick
            if quick is None or quick.done():  # concurrent Allocates share one read
                began, pulse = loop.time(), self.producer.wakeup.pulse()
                quick = self._quick = asyncio.create_task(
                    self.producer.runner.run(self._is_current), name="hlplugin-cdi-read")
                quick.add_done_callback(functools.partial(self._read_done, began, pulse))
            try:
                if not await asyncio.shield(quick):
                    break
            except CheckFailed as exc:
                if self.condition.ok:
                    self._publish(self._timed_out(exc), "allocate")
                return self.condition
        return await self.reconcile("allocate")

    def _still_right(self, arrived: float, now: float) -> bool:
        """The last right read began after ``arrived``, or recently with nothing changed since."""
        verified = self._verified
        return verified is not None and (
            verified[0] >= arrived
            or (now - verified[0] < _TRUST_QUIET
                and self.producer.wakeup.quiet_since(verified[1])))

    async def reconcile(self, trigger: str) -> Condition:
        """One full pass (inspect, repair if needed, publish the outcome), bounded."""
        await self.producer.check(trigger)
        return self.condition

    async def _step(self, trigger: str) -> bool:
        began, pulse = asyncio.get_running_loop().time(), self.producer.wakeup.pulse()
        try:
            outcome = await self.producer.runner.run(self._pass)
        except CheckFailed as exc:
            outcome = self._timed_out(exc)
        self._publish(outcome, trigger)
        if outcome.condition.ok:
            self._verify(began, pulse)
        return outcome.condition.ok

    def _timed_out(self, exc: CheckFailed) -> _Outcome:
        return _Outcome(Condition(False, f"cannot check {self.path}: {exc} (its storage does not "
                                         f"answer)"))

    def _read_done(self, began: float, pulse: asyncio.Event, task: asyncio.Task[bool]) -> None:
        if not task.cancelled() and task.exception() is None and task.result():
            self._verify(began, pulse)

    def _verify(self, began: float, pulse: asyncio.Event) -> None:
        """Record a right read that began at ``began``; a later one is never replaced by an
        earlier one finishing late."""
        if self._verified is None or began >= self._verified[0]:
            self._verified = (began, pulse)

    def _is_current(self) -> bool:
        with contextlib.suppress(OSError, NotRegular):
            found = _read(self.path, len(self.desired) + 1)
            return found is not None and self._is_right(*found)
        return False

    def _publish(self, outcome: _Outcome, trigger: str) -> None:
        """On the event loop: the pass's outcome to the condition, the tracker, metrics and log."""
        if outcome.repaired:
            log.info("repaired CDI spec %s (cause: %s, trigger: %s)", self.path,
                     outcome.repaired, trigger,
                     extra={"cause": outcome.repaired, "trigger": trigger})
            if self._metrics is not None:
                self._metrics.cdi_repairs.labels(cause=outcome.repaired).inc()
        if outcome.refused and self._metrics is not None:
            self._metrics.cdi_refusals.labels(reason=outcome.refused).inc()
        new = outcome.condition
        if self._tracker is not None:
            self._tracker.set_condition(CONDITION, new.ok, new.reason)
        elif not new.ok and new != self.condition:
            log.warning("CDI spec unhealthy: %s", new.reason)
        self.condition = new

    def _pass(self) -> _Outcome:
        """In the runner's thread (one at a time): inspect, and repair if needed."""
        try:
            cause = self._diagnose()
            if cause:
                self._replace()
        except NotRegular as exc:
            reason = f"{self.path} is {exc}; refusing to replace what we do not own"
            return _Outcome(Condition(False, reason), refused="not_regular")
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, "unknown error")
            problem = not_a_directory(self.cdi_dir) if exc.errno in (errno.EEXIST, errno.ENOTDIR) else ""
            reason = f"cannot write {self.path}: {problem or exc.strerror} ({name})"
            return _Outcome(Condition(False, reason), refused="write_failed")
        return _Outcome(Condition(True), repaired=cause)

    def _diagnose(self) -> str:
        """The repair cause, or "" when the file is right. Raises NotRegular."""
        try:
            found = _read(self.path, _MAX_READ)
        except PermissionError:
            return "metadata"  # a regular file we may not read: its mode or owner is wrong
        except OSError:
            return "malformed"  # unreadable (EIO, ...): rewriting is the best we can do
        if found is None:
            return "missing"
        content, st = found
        if content != self.desired:
            return "stale" if _well_formed(content) else "malformed"
        return "" if self._metadata_right(st) else "metadata"

    def _replace(self) -> None:
        """Atomically put the desired bytes at our path: temp file, fsync, swap in, fsync dir.

        All names are resolved in one directory fd, so every step acts on the same directory.
        """
        os.makedirs(self.cdi_dir, 0o755, exist_ok=True)
        dir_fd = os.open(self.cdi_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            temp = TEMP_PREFIX + secrets.token_hex(8)
            self._write_temp(dir_fd, temp)
            try:
                self._install(dir_fd, temp)
            finally:
                _discard_temp(dir_fd, temp)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _write_temp(self, dir_fd: int, name: str) -> None:
        """Create ``name`` with the desired bytes, mode and group, on disk."""
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC
        fd = os.open(name, flags, MODE, dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, MODE)  # against the umask
                st = os.fstat(fd)
                if st.st_gid != self._gid:  # a setgid directory passes its group on
                    os.fchown(fd, -1, self._gid)
                view = memoryview(self.desired)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise

    def _install(self, dir_fd: int, temp: str) -> None:
        """Move ``temp`` to our path without ever replacing what is not ours.

        Exchange, then look at what was displaced: a regular file (the old spec) stays at the
        temp name for _replace to remove; anything else is exchanged back and refused. No
        check-then-act window: what we inspect is what we took. With nothing at the path, a
        no-replace rename; if something appeared in between, exchange again.
        Raises NotRegular or OSError.
        """
        for _ in range(_MAX_INSTALL_ATTEMPTS):
            try:
                renameat2(dir_fd, temp, SPEC_FILE, RENAME_EXCHANGE)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    try:
                        renameat2(dir_fd, temp, SPEC_FILE, RENAME_NOREPLACE)
                        return
                    except OSError as again:
                        if again.errno == errno.EEXIST:
                            continue  # created meanwhile: exchange and look at it
                        exc = again
                if exc.errno in _UNSUPPORTED:
                    self._install_without_renameat2(dir_fd, temp)
                    return
                if exc.errno == errno.EBUSY:  # a mount point: renaming over it is refused anyway
                    raise NotRegular("a mount point") from None
                raise
            displaced = os.stat(temp, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(displaced.st_mode):
                return  # the old spec, now at our temp name, which _replace removes
            _put_back(dir_fd, temp)
            raise NotRegular(kind_of(displaced.st_mode))
        raise OSError(errno.EAGAIN, f"{SPEC_FILE} kept appearing and disappearing")

    def _install_without_renameat2(self, dir_fd: int, temp: str) -> None:
        """For filesystems without renameat2 flags (some FUSE): check, then rename.

        A non-regular file swapped in between the two steps is replaced; only someone who can
        write the directory can do that, and our spec is what takes its place.
        """
        if not self._warned_no_exchange:
            self._warned_no_exchange = True
            log.warning("the filesystem of %s does not support renameat2 with RENAME_EXCHANGE or "
                        "RENAME_NOREPLACE; replacing the spec with lstat and rename",
                        self.cdi_dir)
        with contextlib.suppress(FileNotFoundError):
            mode = os.stat(SPEC_FILE, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegular(kind_of(mode))
        try:
            os.rename(temp, SPEC_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise NotRegular("a mount point") from None
            raise

    def cleanup_leftovers(self) -> int:
        """Remove temp files a crash left behind (regular files with our prefix only)."""
        removed = 0
        try:
            names = os.listdir(self.cdi_dir)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = self.cdi_dir / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed += 1
                    log.info("removed leftover temp file %s", path)
        return removed

    async def run(self) -> None:
        """Reconcile on every change to our file or directory, every ``interval`` seconds, and,
        while failing, with capped exponential backoff (the first pass unless one already ran).
        Runs until cancelled."""
        try:
            await self.producer.runner.run(self.cleanup_leftovers)
        except CheckFailed as exc:
            log.warning("could not look for leftover temp files in %s: %s", self.cdi_dir, exc)
        await self.producer.run()
