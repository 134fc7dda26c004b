"""What the CDI reconciler's tests share (tests/test_cdi*.py): a reconciler in process on real
files, the spec it must keep, and how to look at what lies at a path without following it."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401  (to_thread's, imported before any fork)
import ctypes
import os
import stat
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from harness import spec_is_exact, split_settings

from hlplugin.cdi import CdiReconciler
from hlplugin.cdi_spec import SPEC_FILE, render_spec
from hlplugin.deviceplugin.health.conditions import Condition, HealthTracker
from hlplugin.metrics import Metrics
from hlplugin.settings import CdiSettings

DESIRED = render_spec("kvm", 65534, 65534)
STALE = render_spec("kvm", 1000, 1000)  # well-formed, another uid/gid


class Reconciler:
    """A reconciler in process, wired to a real tracker and metrics registry (harness.Rig is the
    daemon's, on a kubelet)."""

    def __init__(self, cdi_dir: Path, **kwargs: Any) -> None:
        self.tracker = HealthTracker(required=("cdi",))
        self.metrics = Metrics()
        settings, rest = split_settings(CdiSettings, kwargs, dir=cdi_dir)
        self.rec = CdiReconciler(settings, DESIRED, tracker=self.tracker, metrics=self.metrics.proofs,
                                 **rest)
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


CAUSES = ("missing", "malformed", "stale", "metadata")


def forked(prepare: Callable[[], None], scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
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


LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE = 1


def exchange(a: Path, b: Path, flags: int = 2) -> None:
    """renameat2(RENAME_EXCHANGE, or RENAME_NOREPLACE with flags=1), written here apart from
    the code under test."""
    if LIBC.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), flags) != 0:  # AT_FDCWD
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a))
