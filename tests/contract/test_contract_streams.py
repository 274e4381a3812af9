"""Contract: streams and events, and bad stream and event arguments (specific error, nothing changed).

Only streams from ``stream_create`` and the default stream 0 are used here: on a real
GPU any other id would be a wild ``cudaStream_t``.
"""

from __future__ import annotations

import pytest

import gpumem
from gpumem import DeviceKind, Event, InvalidArgumentError

BAD_STREAMS = [-1, 1.5, "0", True, None, b"\0", [0]]


def test_default_stream_event_round_trip(device):
    e = device.event_record()
    assert isinstance(e, Event) and e.stream == 0
    device.event_synchronize(e)
    assert device.event_query(e) is True
    device.stream_synchronize(0)
    device.synchronize()
    device.event_destroy(e)


def test_created_streams(device):
    streams = [device.stream_create() for _ in range(3)]
    assert all(isinstance(s, int) and s > 0 for s in streams)
    assert len(set(streams)) == 3
    a, b = streams[0], streams[1]
    ea = device.event_record(a)
    device.stream_wait_event(b, ea)
    eb = device.event_record(b)
    device.event_synchronize(eb)
    assert device.event_query(ea) and device.event_query(eb)
    for s in streams:
        device.stream_synchronize(s)
        device.stream_destroy(s)
    for e in (ea, eb):
        device.event_destroy(e)


def test_many_events_are_cheap_to_record_and_destroy(device):
    s = device.stream_create()
    for _ in range(500):
        device.event_destroy(device.event_record(s))
    device.stream_destroy(s)


@pytest.mark.parametrize("stream", BAD_STREAMS, ids=repr)
def test_bad_stream_ids(device, canary, stream):
    e = device.event_record(0)
    for call in (device.event_record, device.stream_synchronize, device.stream_destroy):
        with pytest.raises(InvalidArgumentError):
            call(stream)
    with pytest.raises(InvalidArgumentError):
        device.stream_wait_event(stream, e)
    device.event_destroy(e)
    canary.assert_unchanged()


def test_streams_that_cannot_be_destroyed(device, canary):
    with pytest.raises(InvalidArgumentError):
        device.stream_destroy(0)
    s = device.stream_create()
    device.stream_destroy(s)
    with pytest.raises(InvalidArgumentError):
        device.stream_destroy(s)
    canary.assert_unchanged()


def test_bad_events(device, device_spec, canary):
    destroyed = device.event_record(0)
    device.event_destroy(destroyed)
    with gpumem.open_device(device_spec) as other:
        foreign = other.event_record(0)
        bad = [None, 0, "event", object(), destroyed, foreign, Event(device, 0)]
        for event in bad:
            for call in (device.event_query, device.event_synchronize, device.event_destroy):
                with pytest.raises(InvalidArgumentError):
                    call(event)
            with pytest.raises(InvalidArgumentError):
                device.stream_wait_event(0, event)
        other.event_destroy(foreign)
    canary.assert_unchanged()


def test_simulated_contract_devices_run_the_sanitizer(device):
    if device.kind is DeviceKind.SIM:
        assert device.sanitizer == "raise"


def test_a_closed_device_refuses_before_looking_up_streams_and_events(device_spec):
    """One order on every device (Note [Validation before any device call]): argument types, then a
    closed or lost device, then lookups (review of issue 6: lookups came first for some calls)."""
    dev = gpumem.open_device(device_spec)
    s = dev.stream_create()
    e = dev.event_record(0)
    dead = dev.event_record(0)
    dev.event_destroy(dead)
    dev.close()
    calls = [
        lambda: dev.stream_destroy(77), lambda: dev.stream_destroy(s), lambda: dev.event_query(dead),
        lambda: dev.event_query(e), lambda: dev.event_synchronize(dead), lambda: dev.event_destroy(dead),
        lambda: dev.stream_wait_event(0, dead),
    ]
    for call in calls:
        with pytest.raises(gpumem.DeviceClosedError):
            call()
    with pytest.raises(InvalidArgumentError):
        dev.event_query("not an event")
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(-1)
