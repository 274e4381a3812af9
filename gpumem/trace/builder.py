"""From address-keyed events to id-keyed ops, and back to replayable addresses.

Allocator logs name allocations by address: ``alloc 0x7f..00 (4096 B)`` and later
``free 0x7f..00``. :func:`build_ops` pairs them up in one pass:

* an alloc at an address gives a new dense id (0, 1, 2, ...);
* a free of an address gives the id of the allocation live there, which ends;
* a free of an address with no live allocation (allocated before the trace
  window opened, or a foreign pointer) is skipped and counted as *unmatched*;
* an alloc at an address that is still live means events were lost: the trace is
  malformed and :class:`AddressReuseError` names the offending event;
* a free of an address whose allocation in the window was freed already, with no alloc there since (a
  second free), means, in a file (``refuse_second_free``: PyTorch snapshots, RMM logs), that events were
  lost just as well (the alloc between the two frees): the trace is malformed and :class:`SecondFreeError`
  (an :class:`AddressReuseError`, so that every reader refuses it as it refuses the other) names the second
  free and the first. gpumem's own recorders keep a free before the engine judges it, so their history
  holds a program's double free, which the engine refused: there it is skipped, with a warning of its own
  (it is not an unmatched free either, whose allocation was made before the window opened);
* with ``free_sizes`` (:func:`build_trace`: sources whose frees carry their allocation's size, PyTorch's
  snapshots and RMM's logs), a free whose size differs from its allocation's is counted and logged in one
  warning, naming the first; the allocation's size is the one kept (a free's size is redundant: the
  replay frees the block);
* with ``use_code``, an event of that code is a stream use (``record_stream``) of the allocation
  live at its address, kept as a :class:`~gpumem.trace.model.StreamUse` at its place among the ops;
  a use of an address with no live allocation (allocated before the window opened) is skipped and
  counted, as an unmatched free is;
* with ``wait_code``, an event of that code is a stream wait (``wait_stream``): its stream waits for the
  stream in its address field, kept as a :class:`~gpumem.trace.model.StreamWait` at its place;
* with ``plan_code``, an event of that code is a step-plan event, its kind (a
  :class:`~gpumem.trace.model.PlanEventKind` value) in its size field, kept as a
  :class:`~gpumem.trace.model.PlanEvent` at its place.

The loop touches only a dict and two list appends per event, so a million events
take well under a second; all per-op columns are gathered afterwards with numpy.

:func:`replay_addresses` goes the other way, for writers of address-keyed formats.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .model import OpKind, PlanEvent, PlanEventKind, StreamUse, StreamWait, Trace

__all__ = ["AddressReuseError", "SecondFreeError", "build_ops", "build_trace", "replay_addresses", "USE_CODE",
           "WAIT_CODE", "PLAN_CODE"]

log = logging.getLogger(__name__)

#: Event codes understood by :func:`build_ops`; any other code is ignored.
ALLOC_CODE = 0
FREE_CODE = 1
#: The code gpumem's recorders give a stream use (``record_stream``); :func:`build_trace` reads it as one
#: only when asked (``use_code``): other sources give 2 another meaning (an RMM allocation failure).
USE_CODE = 2
#: The code gpumem's recorders give a stream wait (``wait_stream``; the awaited stream in the address
#: field); read as one only when asked (``wait_code``).
WAIT_CODE = 3
#: The code gpumem.torch's recorder gives a step-plan event (a mark, the warm-up begun or stopped; its kind in
#: the size field); read as one only when asked (``plan_code``).
PLAN_CODE = 4


class AddressReuseError(Exception):
    """An alloc at an address that is still live; ``index`` is the event's position in the input."""

    def __init__(self, index: int, addr: int) -> None:
        super().__init__(f"alloc at {addr:#x}, which is already allocated and not freed")
        self.index = index
        self.addr = addr


class SecondFreeError(AddressReuseError):
    """A second free of an address: its allocation in the trace window was freed already (at event
    ``first_free``) and nothing was allocated there since. ``index`` is the second free's position in the
    input. A subclass of :class:`AddressReuseError`: both say that events of the address were lost, and
    every reader refuses both alike, naming the event (:meth:`describe` names the first free as the reader
    numbers its events)."""

    def __init__(self, index: int, addr: int, first_free: int) -> None:
        Exception.__init__(self, self.describe(f"event {first_free}", addr))
        self.index = index
        self.addr = addr
        self.first_free = first_free

    @staticmethod
    def describe(first: str, addr: int) -> str:
        """The message, the first free named ``first`` (``"entry 12"``, ``"line 14"``)."""
        return (f"second free of {addr:#x}: its allocation in the trace window was already freed ({first}) and "
                "nothing was allocated there since, so events were lost or the trace is damaged (a free of an "
                "address allocated before the window opened is skipped instead)")


def build_ops(codes: Sequence[int], addrs: Sequence[int], use_code: int | None = None,
              uses: list[tuple[int, int, int]] | None = None, wait_code: int | None = None,
              waits: list[tuple[int, int]] | None = None, plan_code: int | None = None,
              plans: list[tuple[int, int]] | None = None, *, refuse_second_free: bool = False,
              second_frees: list[int] | None = None) -> tuple[array[int], array[int], int]:
    """Pair allocs and frees by address.

    ``codes[i]`` is 0 (alloc), 1 (free) or anything else (ignored), ``addrs[i]`` the
    event's address. Returns ``(kept, ids, n_unmatched)``: the indices of the
    events that become ops, the alloc id of each, and the number of frees skipped
    because their address held no live allocation in the window. Raises
    :class:`AddressReuseError` for an alloc at a live address and, with ``refuse_second_free`` (the file
    readers), :class:`SecondFreeError` for a second free of an address allocated in the window (freed
    already, not allocated again); without it (gpumem's own recorders, whose history keeps a free the engine
    then refused: the program's double free) such a free is skipped, counted in ``n_unmatched`` and, where
    ``second_frees`` is given, its index appended there. With ``use_code``
    (not 0 or 1), each
    event of that code whose address is live is appended to ``uses`` as ``(at_op, alloc_id, index)``
    (those of addresses not live are skipped, and not counted in ``n_unmatched``). With ``wait_code``,
    each event of that code is appended to ``waits`` as ``(at_op, index)``, and with ``plan_code`` to
    ``plans``.
    """
    live: dict[int, int] = {}
    freed: dict[int, int] = {}   # address -> the event that freed the allocation there, until one is made again
    kept = array("q")  # compact: 8 bytes per event, where a list of ints takes ~40
    ids = array("q")
    keep = kept.append
    add_id = ids.append
    pop = live.pop
    next_id = 0
    n_unmatched = 0
    for i, (code, addr) in enumerate(zip(codes, addrs)):
        if code == ALLOC_CODE:
            if addr in live:
                raise AddressReuseError(i, addr)
            freed.pop(addr, None)
            live[addr] = next_id
            keep(i)
            add_id(next_id)
            next_id += 1
        elif code == FREE_CODE:
            aid = pop(addr, None)
            if aid is None:
                first = freed.get(addr)
                if first is not None:
                    if refuse_second_free:
                        raise SecondFreeError(i, addr, first)
                    if second_frees is not None:
                        second_frees.append(i)
                n_unmatched += 1
                continue
            freed[addr] = i
            keep(i)
            add_id(aid)
        elif code == use_code and uses is not None:
            aid = live.get(addr)
            if aid is not None:   # else allocated before the window opened: skipped (build_trace logs it)
                uses.append((len(kept), aid, i))
        elif code == wait_code and waits is not None:
            waits.append((len(kept), i))
        elif code == plan_code and plans is not None:
            plans.append((len(kept), i))
    return kept, ids, n_unmatched


def build_trace(
    name: str,
    source: str,
    codes: Sequence[int] | np.ndarray,
    addrs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    streams: Sequence[int] | np.ndarray,
    times_us: Sequence[float] | np.ndarray,
    *,
    origin: str = "",
    n_failed_allocs: int = 0,
    use_code: int | None = None,
    wait_code: int | None = None,
    plan_code: int | None = None,
    gpu_times_us: Sequence[float] | np.ndarray | None = None,
    live_reserved_nbytes: Sequence[int] | np.ndarray | None = None,
    free_sizes: bool = False,
    event_name: Callable[[int], str] | None = None,
    refuse_second_free: bool = False,
) -> Trace:
    """Turn parallel address-keyed event columns into a :class:`Trace`.

    ``sizes`` matter for allocs only: a free's size is taken from its allocation. With ``free_sizes``
    (the source's frees carry their allocation's size: PyTorch snapshots, RMM logs), frees whose size
    differs are counted and one warning names the first (module docstring). ``origin`` (usually the file
    name) prefixes the warnings logged once when frees were skipped or sizes differ; ``event_name`` names an
    event by its input position in them (default ``"event N"``; readers pass ``"entry N"``, ``"line N"``).
    Raises :class:`AddressReuseError` (and, with ``refuse_second_free``, :class:`SecondFreeError`) as
    :func:`build_ops` does. Events
    of ``use_code`` (gpumem's recorders: :data:`USE_CODE`) are stream uses
    (:attr:`Trace.stream_uses`); a use of an address not live is skipped (logged, not counted in
    ``n_unmatched_frees``). Events of ``wait_code`` (:data:`WAIT_CODE`) are stream waits
    (:attr:`Trace.stream_waits`): the event's stream waits for the stream in its ``addrs`` field. Events of
    ``plan_code`` (:data:`PLAN_CODE`) are step-plan events (:attr:`Trace.plan_events`), their
    :class:`PlanEventKind` in ``sizes``; another kind raises :class:`InvalidArgumentError`. ``gpu_times_us``
    (one per event; NaN where unknown): the GPU clock of the events that become ops (:attr:`Trace.gpu_times_us`);
    ``live_reserved_nbytes`` (one per event; -1 where not recorded): the live engine's reserve after each
    (:attr:`Trace.live_reserved_nbytes`).
    """
    if live_reserved_nbytes is not None:
        given = np.asarray(live_reserved_nbytes)
        if given.ndim != 1 or len(given) != len(codes) or (len(given) and given.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"build_trace: live_reserved_nbytes must be one int per event ({len(codes)}), "
                                       f"got {given.dtype} of shape {given.shape}")
    if use_code in (ALLOC_CODE, FREE_CODE):
        raise InvalidArgumentError(f"build_trace: use_code {use_code} is the code of an alloc or a free")
    if wait_code in (ALLOC_CODE, FREE_CODE) or (wait_code is not None and wait_code == use_code):
        raise InvalidArgumentError(f"build_trace: wait_code {wait_code} is the code of an alloc, a free or a use")
    if plan_code in (ALLOC_CODE, FREE_CODE) or (plan_code is not None and plan_code in (use_code, wait_code)):
        raise InvalidArgumentError(f"build_trace: plan_code {plan_code} is the code of an alloc, a free, a use or a wait")
    codes_list = codes.tolist() if isinstance(codes, np.ndarray) else codes
    addrs_list = addrs.tolist() if isinstance(addrs, np.ndarray) else addrs
    raw_uses: list[tuple[int, int, int]] = []
    raw_waits: list[tuple[int, int]] = []
    raw_plans: list[tuple[int, int]] = []
    second: list[int] = []
    kept, ids, n_unmatched = build_ops(codes_list, addrs_list, use_code, raw_uses if use_code is not None else None,
                                       wait_code, raw_waits if wait_code is not None else None,
                                       plan_code, raw_plans if plan_code is not None else None,
                                       refuse_second_free=refuse_second_free, second_frees=second)
    n_unmatched_uses = 0
    if use_code is not None:
        n_unmatched_uses = sum(1 for c in codes_list if c == use_code) - len(raw_uses)
    if n_unmatched - len(second):
        log.warning(
            "%s: skipped %d free(s) of addresses never allocated in the trace window",
            origin or name, n_unmatched - len(second),
        )
    name_of = event_name or (lambda i: f"event {i}")
    if second:
        log.warning("%s: skipped %d second free(s) of addresses freed already in the trace window (the first: %s)",
                    origin or name, len(second), name_of(second[0]))
    if n_unmatched_uses:
        log.warning("%s: skipped %d stream use(s) of addresses not allocated in the trace window",
                    origin or name, n_unmatched_uses)
    idx = np.asarray(kept, dtype=np.int64)
    alloc_ids = np.asarray(ids, dtype=np.int64)
    kinds = np.asarray(codes, dtype=np.int8)[idx] if len(idx) else np.zeros(0, np.int8)
    nbytes = np.asarray(sizes, dtype=np.int64)[idx] if len(idx) else np.zeros(0, np.int64)
    is_free = kinds == OpKind.FREE
    if is_free.any():
        alloc_nbytes = nbytes[~is_free]  # ordered by id: ids are handed out in alloc order
        from_alloc = alloc_nbytes[alloc_ids[is_free]]
        if free_sizes:
            _warn_free_sizes(origin or name, idx[is_free], nbytes[is_free], from_alloc, addrs_list, name_of)
        nbytes[is_free] = from_alloc

    def pick(col: Sequence[float] | np.ndarray, dtype: type) -> np.ndarray:
        return np.asarray(col, dtype=dtype)[idx] if len(idx) else np.zeros(0, dtype)

    return Trace(
        name,
        source,
        kinds,
        alloc_ids,
        nbytes,
        pick(streams, np.int64),
        pick(times_us, np.float64),
        pick(addrs, np.int64),
        n_unmatched_frees=n_unmatched,
        n_failed_allocs=n_failed_allocs,
        stream_uses=_stream_uses(raw_uses, streams, times_us),
        stream_waits=_stream_waits(raw_waits, addrs_list, streams, times_us),
        plan_events=_plan_events(raw_plans, sizes, times_us),
        gpu_times_us=None if gpu_times_us is None else pick(gpu_times_us, np.float64),
        live_reserved_nbytes=None if live_reserved_nbytes is None else pick(live_reserved_nbytes, np.int64),
    )


def _warn_free_sizes(origin: str, events: np.ndarray, given: np.ndarray, from_alloc: np.ndarray,
                     addrs: Sequence[int], event_name: Callable[[int], str]) -> None:
    """One warning when frees (input positions ``events``) carry a size (``given``) other than their
    allocation's (``from_alloc``): how many, and the first."""
    differ = np.flatnonzero(given != from_alloc)
    if not len(differ):
        return
    k = int(differ[0])
    log.warning("%s: %d free(s) carry a size other than their allocation's (the first, %s, frees %#x with size "
                "%d, allocated with %d): the allocation's size is kept", origin, len(differ),
                event_name(int(events[k])), int(addrs[int(events[k])]), int(given[k]), int(from_alloc[k]))


def _at_events(events: list[int], ints: Sequence[int] | np.ndarray,
               times_us: Sequence[float] | np.ndarray) -> tuple[list[int], list[float]]:
    """``ints`` and ``times_us`` at the event indices ``events``, as lists."""
    idx = np.asarray(events, dtype=np.int64)
    return np.asarray(ints, dtype=np.int64)[idx].tolist(), np.asarray(times_us, dtype=np.float64)[idx].tolist()


def _stream_uses(raw: list[tuple[int, int, int]], streams: Sequence[int] | np.ndarray,
                 times_us: Sequence[float] | np.ndarray) -> tuple[StreamUse, ...]:
    """:class:`StreamUse` objects of :func:`build_ops`' ``(at_op, alloc_id, event index)`` triples."""
    if not raw:
        return ()
    s, t = _at_events([r[2] for r in raw], streams, times_us)
    return tuple(StreamUse(at, aid, si, ti) for (at, aid, _), si, ti in zip(raw, s, t))


def _stream_waits(raw: list[tuple[int, int]], addrs: Sequence[int], streams: Sequence[int] | np.ndarray,
                  times_us: Sequence[float] | np.ndarray) -> tuple[StreamWait, ...]:
    """:class:`StreamWait` objects of :func:`build_ops`' ``(at_op, event index)`` pairs (the awaited stream
    in the event's address)."""
    if not raw:
        return ()
    s, t = _at_events([r[1] for r in raw], streams, times_us)
    return tuple(StreamWait(at, si, int(addrs[i]), ti) for (at, i), si, ti in zip(raw, s, t))


def _plan_events(raw: list[tuple[int, int]], sizes: Sequence[int] | np.ndarray,
                 times_us: Sequence[float] | np.ndarray) -> tuple[PlanEvent, ...]:
    """:class:`PlanEvent` objects of :func:`build_ops`' ``(at_op, event index)`` pairs (the kind in the size)."""
    if not raw:
        return ()
    kinds, t = _at_events([r[1] for r in raw], sizes, times_us)
    bad = [k for k in kinds if k not in PlanEventKind._value2member_map_]
    if bad:
        raise InvalidArgumentError(f"plan event kind {bad[0]} is not one of "
                                   f"{', '.join(f'{int(k)} ({k.name})' for k in PlanEventKind)}")
    return tuple(PlanEvent(at, PlanEventKind(k), ti) for (at, _), k, ti in zip(raw, kinds, t))


def replay_addresses(trace: Trace) -> np.ndarray:
    """Addresses under which ``trace`` can be written to an address-keyed format.

    Returns ``trace.addrs`` when no two live allocations share an address. When
    every address is 0 (unknown), invents distinct ones: a bump pointer from
    ``0x7f0000000000``, 512-byte aligned, never reused. Otherwise raises
    ``InvalidArgumentError``: such a trace would not read back as the same ops.
    """
    addrs = trace.addrs
    if trace.n_ops and not addrs.any():
        alloc_sizes = trace.nbytes[trace.kinds == OpKind.ALLOC]
        steps = (np.maximum(alloc_sizes, 1) + 511) // 512 * 512
        bases = 0x7F00_0000_0000 + np.concatenate(([0], np.cumsum(steps)[:-1])).astype(np.int64)
        return bases[trace.alloc_ids] if len(bases) else addrs
    live: set[int] = set()
    for i, (kind, addr) in enumerate(zip(trace.kinds.tolist(), addrs.tolist())):
        if kind == OpKind.ALLOC:
            if addr in live:
                raise InvalidArgumentError(
                    f"{trace.name}: op {i} allocates at {addr:#x} while an allocation there is live; "
                    "an address-keyed format cannot represent that"
                )
            live.add(addr)
        else:
            live.discard(addr)
    return addrs
