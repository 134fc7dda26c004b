"""Whether this instance holds the plugin's socket, or stands by for another that does.

During a surge rollout the new pod starts while the old one still serves: the new instance waits
for the socket (endpoint.py) as a *standby*. It is Ready while it waits (once its own checks
pass), so the rollout can go on, but it changes nothing shared: no Allocate (it serves nothing
yet) and no write to a file both instances keep, which the two releases may render differently
and would rewrite in turn. The lifecycle flips the role; whatever owns shared state and
readiness read it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from hlplugin.deviceplugin.kubelet.endpoint import find_holder


class Role:
    """``standby`` while another live instance holds our socket; ``holder`` names it. Starts
    active: an instance alone on its node never waits for anyone."""

    def __init__(self) -> None:
        self.standby = False
        self.holder = ""
        self._taking_over: list[Callable[[], Awaitable[object]]] = []

    def on_take_over(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work()`` when a standby takes the socket over, before it registers: what it
        left alone while standing by is made right before the kubelet's first list."""
        self._taking_over.append(work)

    def look(self, path: Path) -> None:
        """Stand by at once if another live instance serves the socket at ``path``: called before
        anything that owns shared state starts, so a standby never writes it even once."""
        try:
            holder = find_holder(path)
        except OSError:
            return  # the lifecycle meets the same error and says so
        if holder is not None:
            holder.close()
            self.stand_by(holder.describe())

    def stand_by(self, holder: str) -> None:
        """Another instance (``holder``, described for a person) serves our socket."""
        self.standby, self.holder = True, holder

    async def activate(self) -> None:
        """We hold the socket now: from here on we own what is shared."""
        was = self.standby
        self.standby, self.holder = False, ""
        if was:
            for work in self._taking_over:
                await work()
