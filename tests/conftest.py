"""Test-wide hooks: the harness is importable, and ``async def`` tests run on their own loop."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import faultreport
from harness import Gate
from support.clusterfixtures import cluster, installed, release  # noqa: F401  (fixtures)
from support.loopstate import ProcessState

# A guard, not a timing assertion: a test that hangs fails with its stack instead of stalling CI.
ASYNC_GUARD_SECONDS = 90.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "guard(seconds): the async test's guard timeout (default 90 s)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real cluster's tests run after all others, so its daemons (session-scoped, stopped at
    the session's end) never load the machine under another test; its destructive ones
    (reboot, uninstall, teardown) run last of all (tests/support/clusterfixtures.py)."""
    items.sort(key=lambda item: (item.get_closest_marker("cluster") is not None,
                                 item.get_closest_marker("cluster_last") is not None))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an ``async def`` test with ``asyncio.run`` and a guard timeout: no ``body()`` wrapper."""
    function = pyfuncitem.obj
    if not inspect.iscoroutinefunction(function):
        return None
    marker = pyfuncitem.get_closest_marker("guard")
    guard = float(marker.args[0]) if marker else ASYNC_GUARD_SECONDS
    # The arguments the test names (pytest's own default runner passes the same): funcargs also
    # holds autouse fixtures the test does not take.
    kwargs = {name: pyfuncitem.funcargs[name] for name in inspect.signature(function).parameters}

    async def guarded() -> None:
        async with asyncio.timeout(guard):
            await function(**kwargs)

    asyncio.run(guarded())
    return True


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each module gives back the threads, sockets and signal handlers it found: what one leaves
    changes the process under every module after it (fd numbers shifted by another module once
    turned an emulator race into a failure of an unrelated test in every full run). The real
    cluster's modules share session fixtures that live on by design, and are not checked."""
    if request.node.get_closest_marker("cluster"):
        yield
        return
    before = ProcessState.now()
    yield
    left = ProcessState.settled(before).left_since(before)
    assert not left, f"{request.node.name} left behind: {'; '.join(left)}"


@pytest.fixture(scope="session")
def fault_report(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fault matrix's table, once the session's rows ran (tests/test_faults*.py use it)."""
    yield
    faultreport.write(request)


@pytest.fixture
def gate() -> Iterator[Gate]:
    """A Gate (tests/harness.py), released after the test: no helper is left stuck past it."""
    g = Gate()
    yield g
    g.release.set()
