"""The same calls on the simulator and on CudaDevice (over fakes) end the same way.

The contract suite checks this against a real GPU; this table keeps the two
implementations' checks in step on every machine. Each scenario gets a fresh
device and returns what it observed (values that do not depend on addresses) or
raises; the exception types must be identical.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from gpumem import sim
from gpumem import PhysicalHandle

G = 2 * 2**20


def _mapped(dev, n_chunks: int = 2, access: bool = True) -> tuple[int, list[PhysicalHandle]]:
    va = dev.address_reserve(8 * G)
    hs = [dev.mem_create(G) for _ in range(n_chunks)]
    for i, h in enumerate(hs):
        dev.mem_map(va + i * G, G, h)
    if access:
        dev.mem_set_access(va, n_chunks * G)
    return va, hs


def _roundtrip(dev):
    p = dev.malloc(1000)
    dev.write(p + 10, b"abc")
    return dev.read(p + 10, 3)


def _across_mappings(dev):
    va, _ = _mapped(dev)
    dev.write(va + G - 1, b"xy")
    return dev.read(va + G - 1, 2)


def _unmap_two_at_once(dev):
    va, hs = _mapped(dev)
    dev.mem_unmap(va, 2 * G)
    for h in hs:
        dev.mem_release(h)
    dev.address_free(va, 8 * G)
    return dev.mapping_ranges()


def _released_while_mapped(dev):
    va, hs = _mapped(dev)
    dev.mem_release(hs[0])
    dev.write(va, b"ok")
    return dev.read(va, 2)


def _double_free(dev):
    p = dev.malloc(4096)
    dev.free(p)
    dev.free(p)


def _closed_malloc(dev):
    dev.close()
    dev.close()
    dev.malloc(64)


SCENARIOS: dict[str, Callable[[Any], Any]] = {
    "roundtrip": _roundtrip,
    "across_mappings": _across_mappings,
    "unmap_two_at_once": _unmap_two_at_once,
    "released_while_mapped": _released_while_mapped,
    "malloc_zero": lambda d: d.malloc(0),
    "malloc_float": lambda d: d.malloc(64.0),
    "free_unknown": lambda d: d.free(d.malloc(4096) + 0x4000_0000),
    "free_interior": lambda d: d.free(d.malloc(4096) + 512),
    "double_free": _double_free,
    "read_past_end": lambda d: d.read(d.malloc(1000) + 999, 2),
    "read_just_after_end": lambda d: d.read(d.malloc(1000) + 1000, 1),
    "read_negative": lambda d: d.read(d.malloc(1000), -1),
    "write_text": lambda d: d.write(d.malloc(1000), "abc"),
    "write_empty_anywhere": lambda d: d.write(123, b""),
    "reserve_not_granular": lambda d: d.address_reserve(G + 512),
    "reserve_bad_alignment": lambda d: d.address_reserve(G, 3 * G),
    "create_not_granular": lambda d: d.mem_create(G // 2),
    "map_overlap": lambda d: d.mem_map(_mapped(d)[0] + G, G, d.mem_create(G)),
    "map_past_reservation": lambda d: d.mem_map(d.address_reserve(2 * G) + G, 2 * G, d.mem_create(2 * G)),
    "map_into_malloc": lambda d: d.mem_map((d.malloc(8 * G) // G + 1) * G, G, d.mem_create(G)),
    "map_int_handle": lambda d: d.mem_map(d.address_reserve(2 * G), G, 1),
    "map_offset_too_big": lambda d: d.mem_map(d.address_reserve(2 * G), G, d.mem_create(G), G),
    "map_unaligned_va": lambda d: d.mem_map(d.address_reserve(2 * G) + 4096, G, d.mem_create(G)),
    "map_forged_handle": lambda d: d.mem_map(d.address_reserve(2 * G), G, PhysicalHandle(999, G)),
    "map_released": lambda d: (lambda h: (d.mem_release(h), d.mem_map(d.address_reserve(G), G, h)))(d.mem_create(G)),
    "release_twice": lambda d: (lambda h: (d.mem_release(h), d.mem_release(h)))(d.mem_create(G)),
    "unmap_part": lambda d: (lambda va: (d.mem_map(va, 2 * G, d.mem_create(2 * G)), d.mem_unmap(va, G)))(
        d.address_reserve(4 * G)),
    "unmap_unmapped": lambda d: d.mem_unmap(d.address_reserve(4 * G), G),
    "set_access_unmapped": lambda d: d.mem_set_access(_mapped(d)[0] + 2 * G, G),
    "read_no_access": lambda d: d.read(_mapped(d, access=False)[0], 1),
    "read_into_hole": lambda d: d.read(_mapped(d)[0] + G, G + 1),
    "free_reservation_mapped": lambda d: d.address_free(_mapped(d)[0], 8 * G),
    "free_reservation_wrong_size": lambda d: d.address_free(d.address_reserve(2 * G), G),
    "free_reservation_not_base": lambda d: d.address_free(d.address_reserve(2 * G) + G, G),
    "closed_malloc": _closed_malloc,
    "closed_mem_info": lambda d: (d.close(), d.mem_info()),
    "closed_reserve": lambda d: (d.close(), d.address_reserve(G)),
    "closed_reserve_bad_size": lambda d: (d.close(), d.address_reserve(G + 1)),
    "closed_malloc_bad_size": lambda d: (d.close(), d.malloc(0)),
    "closed_free": lambda d: (lambda p: (d.close(), d.free(p)))(d.malloc(64)),
    "closed_free_bad_pointer": lambda d: (d.close(), d.free(0)),
    "closed_read": lambda d: (lambda p: (d.close(), d.read(p, 1)))(d.malloc(64)),
    "closed_read_empty": lambda d: (d.close(), d.read(4096, 0)),
    "closed_write_empty": lambda d: (d.close(), d.write(4096, b"")),
    "closed_map": lambda d: (lambda va, h: (d.close(), d.mem_map(va, G, h)))(d.address_reserve(G), d.mem_create(G)),
    "closed_unmap": lambda d: (lambda va: (d.close(), d.mem_unmap(va, G)))(_mapped(d)[0]),
    "closed_set_access": lambda d: (lambda va: (d.close(), d.mem_set_access(va, G)))(_mapped(d, access=False)[0]),
    "closed_release": lambda d: (lambda h: (d.close(), d.mem_release(h)))(d.mem_create(G)),
    "closed_address_free": lambda d: (lambda va: (d.close(), d.address_free(va, G)))(d.address_reserve(G)),
    "closed_synchronize": lambda d: (d.close(), d.synchronize()),
}


def _stream_round_trip(dev):
    s = dev.stream_create()
    e = dev.event_record(s)
    dev.stream_wait_event(0, e)
    dev.event_synchronize(e)
    done = dev.event_query(e)
    dev.event_destroy(e)
    dev.stream_synchronize(s)
    dev.stream_destroy(s)
    return done


SCENARIOS.update({
    "stream_round_trip": _stream_round_trip,
    "stream_destroy_default": lambda d: d.stream_destroy(0),
    "stream_destroy_twice": lambda d: (lambda s: (d.stream_destroy(s), d.stream_destroy(s)))(d.stream_create()),
    "stream_negative": lambda d: d.event_record(-1),
    "stream_float": lambda d: d.stream_synchronize(0.0),
    "event_destroyed": lambda d: (lambda e: (d.event_destroy(e), d.event_query(e)))(d.event_record()),
    "event_not_an_event": lambda d: d.event_synchronize(object()),
    "event_wait_destroyed": lambda d: (lambda e: (d.event_destroy(e), d.stream_wait_event(0, e)))(d.event_record()),
    "closed_stream_create": lambda d: (d.close(), d.stream_create()),
    "closed_event_record": lambda d: (d.close(), d.event_record(0)),
    "closed_event_query": lambda d: (lambda e: (d.close(), d.event_query(e)))(d.event_record()),
    "closed_stream_synchronize": lambda d: (d.close(), d.stream_synchronize(0)),
})


def _outcome(dev, scenario) -> tuple[str, Any]:
    try:
        result = scenario(dev)
    except Exception as exc:  # noqa: BLE001 - the outcome is the point
        return "raises", type(exc)
    finally:
        dev.close()
    return "returns", result


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_outcome_as_the_simulator(name, fakes):
    expected = _outcome(sim.SimDevice(sim.get_profile("h200-141gb")), SCENARIOS[name])
    assert _outcome(fakes.open(), SCENARIOS[name]) == expected

