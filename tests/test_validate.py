"""One argument rule at every entry point (issue 21, step 3; :mod:`gpumem.validate`).

Sizes, pointers, streams and alignments are checked by the same functions everywhere: any integer type
is accepted (``np.int64(7)``, an ``int`` subclass) and used as a plain int; ``bool``, floats, strings and
``None`` are refused, and so is a stream outside [0, 2**64) (2**64 + 1 used to pass ``event_record``
while the allocator refused it), each with :class:`InvalidArgumentError` naming the argument, and with
nothing changed. One parametrised test over every entry point and both allocator engines.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumem import sim, validate
from gpumem.allocator import CachingAllocator
from gpumem.allocator.bucket import BucketAllocator
from gpumem.native import load_engine
from gpumem.errors import InvalidArgumentError
from gpumem.allocator import make_allocator
from gpumem.managers.resource import AlignmentLayer, DeviceResource
from gpumem.units import MiB

np = pytest.importorskip("numpy")

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])


class Int(int):
    """An int subclass (what an IntEnum or a library's handle type is)."""


def _device() -> sim.SimDevice:
    return sim.SimDevice(sim.custom_profile("args-384mb", 384 * MiB, context_nbytes=32 * MiB))


@dataclasses.dataclass
class Entry:
    """An entry point: ``make()`` builds what it is called on, ``call(obj, value)`` passes ``value`` in
    the argument under test, ``state(obj)`` is what must not change when the value is refused."""

    name: str
    make: Callable[[], Any]
    call: Callable[[Any, Any], Any]
    state: Callable[[Any], Any]


def _dev_state(d) -> Any:
    return (d.n_allocations, d.mapping_ranges(), d.stats.calls.get("event_record", 0), d.mem_info())


def _alloc_state(a) -> Any:
    return (a.snapshot_stats().as_dict(), sorted(a.live_blocks()))


def _res_state(r) -> Any:
    # an AlignmentLayer over an allocator (issue 21 step 2): its upstream's figures
    inner = getattr(r, "upstream", None)
    held = r.outstanding() if hasattr(r, "outstanding") else _alloc_state(inner)
    return (held, r.device.mem_info())


def _allocators(prefix: str, call: Callable[[Any, Any], Any]) -> list[Entry]:
    out = [Entry(f"CachingAllocator[{e}].{prefix}", lambda e=e: CachingAllocator(_device(), engine=e), call,
                 _alloc_state) for e in ENGINES]
    out.append(Entry(f"BucketAllocator.{prefix}", lambda: BucketAllocator(_device()), call, _alloc_state))
    return out


def _resources(prefix: str, call: Callable[[Any, Any], Any]) -> list[Entry]:
    return [Entry(f"DeviceResource.{prefix}", lambda: DeviceResource(_device()), call, _res_state),
            Entry(f"AlignmentLayer(allocator).{prefix}", lambda: AlignmentLayer(make_allocator(_device())), call,
                  _res_state)]


def _dealloc(r, **kw):
    p = r.allocate(4096)
    args = {"ptr": p, "nbytes": 4096, "alignment": 256, "stream": 0, **kw}
    return r.deallocate(args["ptr"], args["nbytes"], args["alignment"], args["stream"])


def _free_own(obj, wrap):
    """Frees a block of ``obj`` passing its pointer through ``wrap`` (int -> the type under test)."""
    p = obj.allocate(4096)
    return obj.free(wrap(p))


STREAMS = [
    Entry("Device.event_record", _device, lambda d, s: d.event_record(s), _dev_state),
    Entry("Device.stream_synchronize", _device, lambda d, s: d.stream_synchronize(s), _dev_state),
    Entry("Device.stream_wait_event", _device, lambda d, s: d.stream_wait_event(s, d.event_record(0)),
          lambda d: d.n_allocations),
    Entry("SimDevice.launch", _device, lambda d, s: d.launch(s, 1e-3), _dev_state),
    *_allocators("allocate(stream)", lambda a, s: a.allocate(4096, s)),
    *_resources("allocate(stream)", lambda r, s: r.allocate(4096, 256, s)),
    *_resources("deallocate(stream)", lambda r, s: _dealloc(r, stream=s)),
]
STREAMS += [Entry(f"CachingAllocator[{e}].record_stream", lambda e=e: CachingAllocator(_device(), engine=e),
                  lambda a, s: a.record_stream(a.allocate(4096), s), lambda a: a.snapshot_stats().num_allocs)
            for e in ENGINES]
SIZES = [
    Entry("Device.malloc", _device, lambda d, n: d.malloc(n), _dev_state),
    Entry("Device.read(nbytes)", _device, lambda d, n: d.read(d.malloc(2 * MiB), n), lambda d: d.n_allocations),
    Entry("Device.mem_create", _device, lambda d, n: d.mem_create(n), _dev_state),
    *_allocators("allocate(nbytes)", lambda a, n: a.allocate(n)),
    *_resources("allocate(nbytes)", lambda r, n: r.allocate(n)),
]
POINTERS = [
    Entry("Device.free", _device, lambda d, w: _free_own(_DeviceAsAllocator(d), w), lambda d: d.mem_info()),
    *_allocators("free", lambda a, w: _free_own(a, w)),
    *_resources("deallocate(ptr)", lambda r, w: r.deallocate(w(r.allocate(4096)), 4096)),
]
POINTERS += [Entry(f"CachingAllocator[{e}].block_size", lambda e=e: CachingAllocator(_device(), engine=e),
                   lambda a, w: a.block_size(w(a.allocate(4096))), lambda a: a.snapshot_stats().num_allocs)
             for e in ENGINES]
ALIGNMENTS = [
    *_resources("allocate(alignment)", lambda r, a: r.allocate(4096, a)),
    Entry("Device.address_reserve(alignment)", _device, lambda d, a: d.address_reserve(4 * MiB, a), _dev_state),
]


class _DeviceAsAllocator:
    """Device.malloc/free under the allocators' names, for the pointer table."""

    def __init__(self, d) -> None:
        self.allocate, self.free = d.malloc, d.free


def _ids(entries: list[Entry]) -> list[str]:
    return [e.name for e in entries]


INTEGER_TYPES = [int, Int, np.int64, np.uint64, np.int32]
NOT_INTEGERS = [True, False, 7.0, np.float64(7.0), "7", None, [7]]


@pytest.mark.parametrize("entry", STREAMS, ids=_ids(STREAMS))
@pytest.mark.parametrize("kind", INTEGER_TYPES, ids=lambda t: t.__name__)
def test_a_stream_of_any_integer_type_is_accepted_everywhere(entry, kind):
    entry.call(entry.make(), kind(7))


@pytest.mark.parametrize("entry", STREAMS, ids=_ids(STREAMS))
@pytest.mark.parametrize("bad", NOT_INTEGERS + [-1, np.int64(-1), 2**64, 2**64 + 1], ids=repr)
def test_a_bad_stream_is_refused_everywhere_and_changes_nothing(entry, bad):
    obj = entry.make()
    before = entry.state(obj)
    with pytest.raises(InvalidArgumentError, match="stream must be an int"):
        entry.call(obj, bad)
    if entry.name.startswith(("Device.", "SimDevice.")) or ".allocate(stream)" in entry.name:
        assert entry.state(obj) == before


@pytest.mark.parametrize("entry", SIZES, ids=_ids(SIZES))
@pytest.mark.parametrize("kind", INTEGER_TYPES, ids=lambda t: t.__name__)
def test_a_size_of_any_integer_type_is_accepted_everywhere(entry, kind):
    entry.call(entry.make(), kind(2 * MiB))  # a granularity multiple: mem_create takes it too


@pytest.mark.parametrize("entry", SIZES, ids=_ids(SIZES))
@pytest.mark.parametrize("bad", NOT_INTEGERS + [-2 * MiB, np.int64(-1)], ids=repr)
def test_a_bad_size_is_refused_everywhere_and_changes_nothing(entry, bad):
    obj = entry.make()
    before = entry.state(obj)
    with pytest.raises(InvalidArgumentError, match="nbytes must"):
        entry.call(obj, bad)
    if "read" not in entry.name:
        assert entry.state(obj) == before


@pytest.mark.parametrize("entry", POINTERS, ids=_ids(POINTERS))
@pytest.mark.parametrize("kind", INTEGER_TYPES[:3], ids=lambda t: t.__name__)
def test_a_pointer_of_any_integer_type_is_accepted_everywhere(entry, kind):
    entry.call(entry.make(), kind)


@pytest.mark.parametrize("entry", POINTERS, ids=_ids(POINTERS))
@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=repr)
def test_a_pointer_that_is_no_integer_is_refused_everywhere(entry, bad):
    with pytest.raises(InvalidArgumentError, match="ptr must be an int"):
        entry.call(entry.make(), lambda p: bad)


@pytest.mark.parametrize("entry", ALIGNMENTS, ids=_ids(ALIGNMENTS))
@pytest.mark.parametrize("kind", INTEGER_TYPES, ids=lambda t: t.__name__)
def test_an_alignment_of_any_integer_type_is_accepted(entry, kind):
    # a granularity multiple for address_reserve; a base resource honours up to 256 B and refuses more
    # (Note [Alignment is a layer]), so an AlignmentLayer over an allocator takes 2 MiB
    value = 256 if entry.name.startswith("DeviceResource") else 2 * MiB
    entry.call(entry.make(), kind(value))


@pytest.mark.parametrize("entry", ALIGNMENTS, ids=_ids(ALIGNMENTS))
@pytest.mark.parametrize("bad", NOT_INTEGERS + [-256, 3 * 256], ids=repr)
def test_a_bad_alignment_is_refused(entry, bad):
    obj = entry.make()
    before = entry.state(obj)
    with pytest.raises(InvalidArgumentError, match="alignment"):
        entry.call(obj, bad)
    assert entry.state(obj) == before


# -- the module itself -------------------------------------------------------------------------------
@given(st.integers(-2**70, 2**70))
def test_check_stream_accepts_exactly_0_to_2_pow_64(n):
    if 0 <= n < 2**64:
        assert validate.check_stream(n) == n and validate.check_stream(np.uint64(n) if n < 2**64 else n) == n
    else:
        with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
            validate.check_stream(n)


@given(st.integers(-2**70, 2**70), st.integers(-5, 5), st.one_of(st.none(), st.integers(-5, 2**66)))
def test_check_int_in_range_names_the_range(n, lo, hi):
    if n >= lo and (hi is None or n <= hi):
        assert validate.check_int_in_range(np.int64(n) if -2**63 <= n < 2**63 else n, "x", lo, hi) == n
    else:
        with pytest.raises(InvalidArgumentError, match=r"x must be an int (in \[|in >=)"):
            validate.check_int_in_range(n, "x", lo, hi)


@pytest.mark.parametrize("lo, hi, text", [(0, 2**63 - 1, "[0, 2**63)"), (1, 2**62, "[1, 2**62]"),
                                          (0.0, 1.0, "[0.0, 1.0]"), (0, None, ">= 0"), (3, 10, "[3, 10]")])
def test_range_text(lo, hi, text):
    assert validate.range_text(lo, hi) == text


def test_real_ranges_refuse_bools_nan_and_huge_ints():
    assert validate.check_real_in_range(1, "f", 0.0, 1.0) == 1.0
    for bad in (True, float("nan"), float("inf"), 10**400, "0.5", None, 1.5):
        with pytest.raises(InvalidArgumentError, match=r"f must be a (finite )?number in \[0.0, 1.0\]"):
            validate.check_real_in_range(bad, "f", 0.0, 1.0)


class _Index:
    """An object whose ``__index__`` does what the test says."""

    def __init__(self, index: Callable[[], Any]) -> None:
        self._index = index

    def __index__(self) -> Any:
        return self._index()


class _FakeInt:
    """An object that says its class is ``int`` (attacker 45, F4: stored as it was by the Python engine)."""

    __class__ = int   # type: ignore[assignment]

    def __ge__(self, other: object) -> bool:
        return True

    def __le__(self, other: object) -> bool:
        return True


def _raise(exc: BaseException) -> Any:
    raise exc


@pytest.mark.parametrize("bad", [_Index(lambda: _raise(ValueError("no"))), _Index(lambda: _raise(OverflowError())),
                                 _FakeInt()],
                         ids=["index-raises-ValueError", "index-raises-OverflowError", "fake-int"])
def test_as_int_refuses_what_only_looks_like_an_int(bad):
    """``as_int``: an ``__index__`` that raises ValueError or OverflowError, and an object that fakes ``__class__``,
    are InvalidArgumentError naming the argument, not an escaped error or a stored object."""
    with pytest.raises(InvalidArgumentError, match="early_leave_steps"):
        validate.as_int(bad, "early_leave_steps")

