"""The freshness primitive every Allocate gate uses (deviceplugin/health/fresh.py): answered by a
run that began after the caller arrived, shared by the callers that arrive before it begins."""

from __future__ import annotations

import asyncio

import pytest
from support.waits import loop_turn

from hlplugin.deviceplugin.health.fresh import Fresh


class World:
    """A check whose runs the test releases one by one; each answers the world as it was when
    the run began (what a real check reads)."""

    def __init__(self) -> None:
        self.state = True
        self.runs: list[asyncio.Event] = []
        self.error: Exception | None = None

    async def check(self) -> bool:
        seen = self.state
        self.runs.append(release := asyncio.Event())
        await release.wait()
        if self.error is not None:
            raise self.error
        return seen

    async def started(self, n: int) -> None:
        while len(self.runs) < n:
            await loop_turn()

    def release(self, n: int) -> None:
        self.runs[n - 1].set()


async def test_a_burst_shares_one_run_and_a_caller_arriving_mid_run_gets_the_next() -> None:
    world = World()
    fresh = Fresh(world.check)
    burst = [asyncio.create_task(fresh.fresh()) for _ in range(20)]
    await world.started(1)
    world.state = False  # a fault lands after the first run looked
    late = asyncio.create_task(fresh.fresh())
    await loop_turn()
    world.release(1)
    assert [await t for t in burst] == [True] * 20
    await world.started(2)  # the late caller's own run, begun after it arrived
    assert not late.done()
    world.release(2)
    assert await late is False
    assert len(world.runs) == 2


async def test_settles_answers_a_mid_run_caller_from_a_failure_but_never_a_success() -> None:
    world = World()
    fresh = Fresh(world.check, settles=lambda ok: not ok)
    world.state = False
    first = asyncio.create_task(fresh.fresh())
    await world.started(1)
    mid = asyncio.create_task(fresh.fresh())
    await loop_turn()
    world.release(1)
    assert (await first, await mid) == (False, False)
    assert len(world.runs) == 1  # the failure stood for both: refusing on it is safe
    world.state = True
    second = asyncio.create_task(fresh.fresh())
    await world.started(2)
    mid = asyncio.create_task(fresh.fresh())
    await loop_turn()
    world.release(2)
    assert await second is True
    await world.started(3)  # a success that began before it arrived is not trusted
    world.release(3)
    assert await mid is True and len(world.runs) == 3


async def test_vouch_lets_a_mid_run_caller_share_a_run_only_while_nothing_changed() -> None:
    world = World()
    changes = [0]
    fresh = Fresh(world.check, mark=lambda: changes[0], vouch=lambda mark: mark == changes[0])
    first = asyncio.create_task(fresh.fresh())
    await world.started(1)
    quiet_mid = asyncio.create_task(fresh.fresh())
    await loop_turn()
    world.release(1)
    assert (await first, await quiet_mid) == (True, True) and len(world.runs) == 1
    second = asyncio.create_task(fresh.fresh())
    await world.started(2)
    changed_mid = asyncio.create_task(fresh.fresh())
    await loop_turn()
    changes[0] += 1  # a change lands while the run reads
    world.release(2)
    assert await second is True
    await world.started(3)
    world.release(3)
    assert await changed_mid is True and len(world.runs) == 3  # answered by its own run


async def test_a_caller_that_gives_up_stops_nothing_and_errors_reach_the_callers() -> None:
    world = World()
    fresh = Fresh(world.check)
    quitter = asyncio.create_task(fresh.fresh())
    stayer = asyncio.create_task(fresh.fresh())
    await world.started(1)
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    world.release(1)
    assert await stayer is True  # the run went on without the caller that left
    world.error = OSError("the storage went away")
    failing = asyncio.create_task(fresh.fresh())
    await world.started(2)
    world.release(2)
    with pytest.raises(OSError, match="storage went away"):
        await failing
    assert not fresh.in_flight
