"""The one freshness primitive: each caller is answered by a run of a check that began after it
arrived, and the callers that arrive while a run has not begun share that run.

Every gate before an Allocate uses it (the main daemon's device check and spec read, the
bootstrap's node check): a fault that lands just before an Allocate must refuse that Allocate, and
a burst of Allocates must cost one check, not one each.

Runs are numbered, so "began after" needs no clock. A run is its own task: a caller that gives
up never stops it, and the result is recorded by the check either way. Two ways to be answered
sooner, both safe, each optional:

- ``settles(result)``: a result that answers even a caller who arrived while that run was in
  flight (a failure: refusing on it is safe, and a stuck check then costs one budget, not two);
  with ``settles``, a run that raised answers them with its error too;
- ``mark()`` taken as a run begins and ``vouch(mark)`` when it ends: the run answers callers who
  arrived while it ran if nothing they could care about changed since it began (an inotify
  watch that stayed quiet).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Fresh(Generic[T]):
    """See the module docstring. A run begins when its task first runs, so every caller that
    arrived before then (the same loop turn included) shares it."""

    def __init__(self, check: Callable[[], Coroutine[Any, Any, T]], *, name: str = "fresh-check",
                 settles: Callable[[T], bool] | None = None,
                 mark: Callable[[], Any] | None = None,
                 vouch: Callable[[Any], bool] | None = None) -> None:
        self._check = check
        self._name = name
        self._settles = settles
        self._mark = mark
        self._vouch = vouch
        self._begun = 0  # runs begun so far: run n began after every caller that saw n - 1
        self._current: tuple[int, asyncio.Future[T], Any] | None = None  # (number, answers, mark)
        self._queued: asyncio.Future[T] | None = None  # the callers the next run answers
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> bool:
        return self._task is not None

    async def fresh(self) -> T:
        arrived = self._begun
        current = self._current
        if current is not None and (self._settles is not None or self._vouch is not None):
            _, answers, mark = current
            try:
                result = await asyncio.shield(answers)
            except Exception:
                if self._settles is not None:
                    raise  # an error settles as a failure does
            else:
                if self._settles is not None and self._settles(result):
                    return result
                if self._vouch is not None and self._vouch(mark):
                    return result
        return await self._after(arrived)

    async def _after(self, arrived: int) -> T:
        """The answer of the first run numbered above ``arrived``: in flight, or the next."""
        current = self._current
        if current is not None and current[0] > arrived:
            return await asyncio.shield(current[1])
        queued = self._queued
        if queued is None:
            self._queued = queued = asyncio.get_running_loop().create_future()
            # Read when every caller gave up, so asyncio has nothing to warn about.
            queued.add_done_callback(_retrieved)
            if self._task is None:
                self._task = asyncio.create_task(self._run(), name=self._name)
        return await asyncio.shield(queued)

    async def _run(self) -> None:
        answers, self._queued = self._queued, None  # everyone who arrived before this began
        assert answers is not None
        self._begun += 1
        self._current = (self._begun, answers, self._mark() if self._mark is not None else None)
        try:
            result = await self._check()
        except asyncio.CancelledError:
            answers.cancel()
            raise
        except Exception as exc:
            answers.set_exception(exc)
        else:
            answers.set_result(result)
        finally:
            self._current = None
            self._task = None
            if self._queued is not None:  # callers that arrived while this ran
                self._task = asyncio.create_task(self._run(), name=self._name)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
