"""A bounded way to run a blocking check: a helper thread, and a budget after which we give up.

Standard library only, like the device prober that uses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Callable[[], T], "concurrent.futures.Future[T]"]


class CheckFailed(Exception):
    """A check failed or overran: at which ``step``, and a short ``reason`` (a metric label)."""

    def __init__(self, message: str, *, step: str, reason: str = "error") -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.reason = reason

    def __str__(self) -> str:
        return self.message


class BoundedRunner:
    """Runs a blocking check in a helper thread and gives up on it after a budget.

    A thread, not a process: forking after grpc has started is unsafe, and a process stuck in an
    uninterruptible ioctl cannot be killed any more than a thread can; an idle runner costs nothing.
    A helper that overruns is abandoned, not killed (nothing can kill it), so at most one is ever
    outstanding: a call first waits, within its own budget, for the previous helper; if that one
    is still stuck the call fails without starting another. The budget bounds the whole call,
    waiting included. Daemon threads, so a stuck helper never blocks process exit.

    With ``linger`` (seconds), a helper that finished waits that long for the next call instead
    of ending, so frequent short checks (one per Allocate) do not each start a thread; an idle
    runner still costs nothing once it has lingered. Such a helper runs ``after`` (if set) once
    each call's result is out, before it takes the next call: cleanup off the caller's path, and
    a helper stuck in it is stuck as in a call (the next call waits for it within its budget).
    """

    def __init__(self, budget: float = 2.0, name: str = "bounded-check",
                 linger: float = 0.0) -> None:
        self.budget = budget
        self.name = name
        self.linger = linger
        self.after: Callable[[], object] | None = None
        self.threads_started = 0
        self._lock = threading.Lock()
        self._current: concurrent.futures.Future[object] | None = None
        self._idle: queue.SimpleQueue[_Job[Any]] | None = None  # a lingering helper's inbox

    @property
    def busy(self) -> bool:
        """A helper is still running (possibly abandoned by a caller that gave up)."""
        current = self._current
        return current is not None and not current.done()

    async def run(self, fn: Callable[[], T], budget: float | None = None) -> T:
        budget = self.budget if budget is None else budget
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        while True:
            with self._lock:
                previous = self._current
                if previous is None or previous.done():
                    helper: concurrent.futures.Future[T] = concurrent.futures.Future()
                    # Running from the start: a cancelled waiter can never cancel it.
                    helper.set_running_or_notify_cancel()
                    self._current = helper  # type: ignore[assignment]
                    if self._idle is not None:
                        self._idle.put((fn, helper))
                        self._idle = None
                        break
                    self.threads_started += 1
                    name = f"{self.name}-{self.threads_started}"
                    if self.linger > 0:
                        inbox: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
                        threading.Thread(target=self._serve, args=(inbox, (fn, helper)),
                                         daemon=True, name=name).start()
                    else:
                        threading.Thread(target=_work, args=(fn, helper), daemon=True,
                                         name=name).start()
                    break
            if not await _wait(previous, deadline - loop.time()):
                raise CheckFailed(
                    f"the previous check is still stuck after {seconds_text(budget)}s; not starting another",
                    step="budget", reason="budget")
        if not await _wait(helper, deadline - loop.time()):
            raise CheckFailed(f"check timed out after {seconds_text(budget)}s", step="timeout",
                             reason="timeout")
        return helper.result()

    def _serve(self, inbox: queue.SimpleQueue[_Job[Any]], job: _Job[Any]) -> None:
        """A lingering helper: run ``job``, then the next one handed over within ``linger``."""
        while True:
            fn, helper = job
            try:
                result, error = fn(), None
            except BaseException as exc:
                result, error = None, exc
            with self._lock:  # offered before the result is out, so the next call finds it
                self._idle = inbox
            if error is not None:
                helper.set_exception(error)
            else:
                helper.set_result(result)
            if self.after is not None:
                with contextlib.suppress(Exception):
                    self.after()
            try:
                job = inbox.get(timeout=self.linger)
                continue
            except queue.Empty:
                pass
            with self._lock:
                if self._idle is inbox:
                    self._idle = None
                    return
            job = inbox.get()  # handed over just as it gave up waiting


def seconds_text(seconds: float) -> str:
    """``seconds`` to one decimal unless that would round it ("0.25", never "0.2" or "0.0")."""
    text = f"{seconds:.1f}"
    return text if float(text) == seconds else f"{seconds:g}"


def _work(fn: Callable[[], T], helper: concurrent.futures.Future[T]) -> None:
    try:
        result = fn()
    except BaseException as exc:
        helper.set_exception(exc)
    else:
        helper.set_result(result)


async def _wait(helper: concurrent.futures.Future[T], seconds: float) -> bool:
    """Wait up to ``seconds`` for ``helper``; True when it finished. Never disturbs the helper."""
    if helper.done():
        return True
    if seconds <= 0:
        return False
    waiter = asyncio.wrap_future(helper)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                with contextlib.suppress(Exception):  # the helper's own: its caller reads it
                    await waiter  # cancelling this wrapper never cancels the running helper
        return helper.done()
    finally:
        # Detach: a cancelled waiter makes the helper's callback a no-op even after loop close.
        if not waiter.done():
            waiter.cancel()
        elif not waiter.cancelled():
            waiter.exception()  # the caller reads it from ``helper``; keep asyncio from warning
