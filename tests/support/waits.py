"""The only two ways a test lets time pass, so each is greppable intent, never a wait for an event
(that is harness.wait_until's): one turn of the event loop, or a bounded quiet window with its
reason (a watch for something that must not happen, or the pace of a load or of the world)."""

from __future__ import annotations

import asyncio
import time


async def loop_turn() -> None:
    """One turn of the event loop: every task already scheduled runs to its next await."""
    await asyncio.sleep(0)


async def quiet(seconds: float, why: str) -> None:
    """Let ``seconds`` pass on the event loop, for ``why``: a bounded watch for what must not
    happen, or the pace of a load. Never to wait for an event."""
    assert why, "say why the time passes"
    await asyncio.sleep(seconds)


def quiet_blocking(seconds: float, why: str) -> None:
    """``quiet`` in a thread that stands for the world (a writer, a flapping device, a pacing
    sender): it blocks its own thread only."""
    assert why, "say why the time passes"
    time.sleep(seconds)
