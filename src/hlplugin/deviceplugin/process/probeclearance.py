"""Stopping without failing a readiness probe.

The kubelet keeps probing a terminating pod's readiness, and a probe that finds the port closed
(the daemon stopped, its container not yet seen as exited) is a Warning event for a rollout that
went right. So the HTTP server's stop() leaves the port open until the next probe when that is
due within PROBE_CLEARANCE seconds, at most PROBE_SLACK past its due time, and the process exits
just after answering it: the kubelet then has a whole period (5 s) to see the exit before it
probes again. (A clearance of 1.5 s, counting on the kubelet to see an exit within that, still
let 3 of 44 real-cluster terminations on a busy machine find the port closed.) Only a regular
probe counts: two /readyz requests PROBE_PERIODS apart (the manifests probe every 5 s; a test
polling in a loop is no probe, and a daemon nobody probes stops at once), or one from the kubelet
(User-Agent kube-probe/...), whose next is then due MANIFEST_PERIOD later. The one is needed for a
pod stopped before its second probe: on the real cluster, a pod of a rollout rolled back at once
got SIGTERM 4.9 s after its first readiness probe, closed its port within 90 ms, and the probe due
0.1 s later met it closed ("connection refused", 1 of 40 terminations under two busy loops).
A kubelet probe overdue is the kubelet restarted: its new prober's first probe comes within a
period of its start, so the port stays open for a period from now.
"""

from __future__ import annotations

import asyncio

PROBE_CLEARANCE = 6.0  # > the manifests' 5 s period: every regular probe is waited for
PROBE_SLACK = 0.5
PROBE_PERIODS = (1.0, 30.0)
# The manifests' readinessProbe.periodSeconds (tests/test_chart.py checks that they agree).
MANIFEST_PERIOD = 5.0
KUBELET_PROBE = "kube-probe/"  # how the kubelet's HTTP prober names itself in User-Agent


class ProbeClearance:
    def __init__(self) -> None:
        self._probes: list[float] = []  # loop times of the latest two /readyz requests
        self._kubelet = False  # the latest came from the kubelet's prober
        self._probed = asyncio.Event()

    def seen(self, user_agent: str = "") -> None:
        """A /readyz request, on the event loop, with its User-Agent."""
        self._probes = [*self._probes[-1:], asyncio.get_running_loop().time()]
        self._kubelet = user_agent.startswith(KUBELET_PROBE)
        self._probed.set()

    async def wait(self) -> None:
        """Return once the next probe was answered, or at once when none is due soon."""
        if len(self._probes) == 2:
            period = self._probes[1] - self._probes[0]
        elif self._probes and self._kubelet:
            period = MANIFEST_PERIOD
        else:
            return
        loop = asyncio.get_running_loop()
        due = self._probes[-1] + period
        if self._kubelet and due + PROBE_SLACK < loop.time():
            # Overdue: the kubelet restarted meanwhile. Its prober starts on a phase of its own,
            # the first probe within a period of its start, so the next is due within a period
            # of now (on the real cluster a daemon stopped 7 s after a kubelet restart closed its
            # port at once, and the new kubelet's first probe met it closed).
            due = loop.time() + period
        if not PROBE_PERIODS[0] <= period <= PROBE_PERIODS[1] or due - loop.time() > PROBE_CLEARANCE:
            return
        self._probed.clear()
        limit = due + PROBE_SLACK - loop.time()
        if limit > 0:
            try:
                async with asyncio.timeout(limit):
                    await self._probed.wait()
            except TimeoutError:
                return
            await asyncio.sleep(0.05)  # a margin for its answer to be written, not an event
