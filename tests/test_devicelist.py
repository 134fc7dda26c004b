"""The device list a ListAndWatch stream sends: serialized once, the same bytes protobuf would
write for the whole message, shared by every registration of the main plugin."""

from __future__ import annotations

import pytest
from harness import healthy_tracker

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.deviceplugin.health.conditions import HealthState
from hlplugin.deviceplugin.kubelet.deviceplugin.devicelist import CHUNK, DeviceList, NumberedIds
from hlplugin.plugin import HypervisorPlugin, slots


def test_numbered_ids_hold_exactly_the_spellings_they_list() -> None:
    ids = NumberedIds("kvm", 2500)
    assert len(ids) == 2500
    assert list(ids) == [f"kvm-{i}" for i in range(2500)]
    assert {"kvm-0", "kvm-9", "kvm-2499"} <= ids
    for outsider in ("kvm-2500", "kvm-01", "kvm--1", "kvm-+1", "kvm- 1", "kvm-\u0663", "kvm-",
                     "mshv-0", "kvm0", "", 0):
        assert outsider not in ids, outsider


@pytest.mark.parametrize("serialized", [True, False])
@pytest.mark.parametrize("count", [1, CHUNK, 2 * CHUNK + 7])
def test_the_wire_bytes_are_the_whole_message_serialized(count: int, serialized: bool) -> None:
    """At once, or (serialized=False, as the main daemon's start does) at the first use."""
    ids = [f"dev-{i}" for i in reversed(range(count))]  # any order, kept
    listed = DeviceList(ids, serialized=serialized)
    for ok, health in ((True, "Healthy"), (False, "Unhealthy")):
        whole = pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=health) for i in ids])
        assert listed.wire(ok) == whole.SerializeToString()
    assert listed.ids == frozenset(ids)


def test_a_list_serialized_later_is_serialized_once() -> None:
    listed = DeviceList(NumberedIds("kvm", 3), serialized=False)
    listed.serialize()
    healthy = listed.wire(True)
    listed.serialize()
    assert listed.wire(True) is healthy  # the same bytes object: built once


def test_every_registration_shares_one_device_list() -> None:
    """The lifecycle builds a servicer per registration: serve() hands each the one list it made,
    which every servicer sends as it is (the lists are built once, not each time)."""
    async def gate() -> HealthState:
        raise AssertionError("not called")

    devices = slots("kvm", 3000)
    first, again = (HypervisorPlugin("kvm", devices, healthy_tracker(), gate) for _ in range(2))
    assert first.devices is devices and again.devices is devices
    assert "kvm-2999" in again.device_ids and "kvm-3000" not in again.device_ids
