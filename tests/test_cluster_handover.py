"""The kubelet's per-name client rule on the real kubelet (issue 29 #1): which registration
orders of two instances survive. The scenario is tests/test_handover.py's (``second_survives``),
run against the real kubelet's device-plugin directory, with the outcome the emulator test
asserts, so the emulator cannot drift from the kubelet. (The upgrade guarantees themselves:
tests/test_cluster_upgrade.py.) Budget 15 s each on a busy 2-core machine; timeouts are guards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cluster import Cluster
from support.handover import second_survives

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

ORDER_RESOURCE = "example.com/handover-order"


def plugin_dir(cluster: Cluster) -> Path:
    """The kubelet's /var/lib/kubelet/device-plugins as the test process (outside the cluster's
    mount namespace) sees it: the run directory's kubelet/, which the cluster bind-mounts there."""
    return Path(cluster.run) / "kubelet" / "device-plugins"


@pytest.mark.parametrize("before", [True, False], ids=["registered-before", "registered-after"])
async def test_which_order_survives_on_the_real_kubelet(cluster: Cluster, before: bool) -> None:
    """A second instance on its own socket name that registers while the first still streams is
    disconnected when the first goes; one that registers only after the first's stream ended
    keeps its stream."""
    survived = await second_survives(plugin_dir(cluster), ORDER_RESOURCE, before=before, hold=3.0,
                                     prefix=f"order-{'before' if before else 'after'}")
    assert survived is (not before), cluster.tail("kubelet", 20)
