"""What a test sees of the code from outside it: how often a method ran, and which TCP connections
a server still holds (as the kernel sees them). src keeps no counter that only tests read."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any


class Calls:
    """Counts the calls of ``owner.name`` (a method, plain or ``async``) from now on, by shadowing
    it on that one instance: ``began`` when a call starts running, ``ended`` when it returns or
    raises. Callers that look the method up when they call see the count; one that took a bound
    method earlier does not."""

    def __init__(self, owner: object, name: str) -> None:
        self.began = 0
        self.ended = 0
        original = getattr(owner, name)
        if inspect.iscoroutinefunction(original):
            async def counted(*args: Any, **kwargs: Any) -> Any:
                self.began += 1
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.ended += 1
        else:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.began += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self.ended += 1
        setattr(owner, name, counted)


_HELD = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT (the peer closed; the server has not yet)


def held_connections(port: int) -> int:
    """The TCP connections to the server listening on ``port`` that it has not closed, from the
    kernel's tables (this network namespace): established (accepted, or still in its listen
    queue) or closed by the peer only. One the server closed is in FIN_WAIT or TIME_WAIT, or gone."""
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                held += int(local.rpartition(":")[2], 16) == port and state in _HELD
    return held
