"""Hypothesis stateful tests of SimDevice against a model.

The model knows what the program allocated, mapped and wrote, and predicts:

* where a small ``malloc`` lands (first fit, 512-B aligned, in the shared 2 MiB pages in the
  order they were created) and how many pages any call takes or gives back;
* whether a VMM call succeeds or which error it raises (overlap, outside a reservation,
  released handle, mappings left...);
* that an out-of-memory error is either injected (a FAULT_INJECTED event) or real (the
  device's free memory at that moment is below what the call needed).

After every step: allocations and mappings never overlap and match the model, used + free
= total, free >= 0, every live allocation and chunk still reads back what was last written
(pressure and faults never lose an allocation), ``check_invariants()``. A failed call
(any GpumemError) leaves the process accounting exactly as it was (tenants may act while a
call's simulated time passes, so their pages are compared only when no tenant runs).

Streams: the machine launches work on a few streams touching live memory, and predicts the
sanitizer: a ``free`` or ``mem_unmap`` of memory that unfinished work touches raises
``MemoryHazardError`` (and changes nothing), a launch on freed memory too. Invariant: no
unfinished work touches memory that is not allocated or mapped with access. One fault plan
fails every call type now and then (``CudaError``/``OutOfMemoryError`` with ``injected``).
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumem import sim
from gpumem import (
    DeviceClosedError,
    CudaError,
    DeviceLostError,
    DoubleFreeError,
    GpumemError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    MappingOverlapError,
    MemoryHazardError,
    MiB,
    OutOfMemoryError,
    TransientDeviceError,
    UnsupportedOperationError,
)
from gpumem.units import align_up
from gpumem.sim import CALL_NAMES, FaultPlan, MemoryEventKind, PeriodicSpikes, RandomArrivals, SimDevice, Step
from gpumem.sim.device import SMALL_MALLOC_ALIGNMENT, SMALL_MALLOC_MAX_NBYTES

GRAN = 2 * MiB

PROFILES = {
    # tiny cards make out-of-memory common; one without VMM; one real profile
    "tiny": sim.custom_profile("tiny-96mib", 96 * MiB, base="t4-16gb", context_nbytes=8 * MiB),
    "tiny-unified": sim.custom_profile("tiny-unified-64mib", 64 * MiB, base="jetson-nano-2gb",
                                       context_nbytes=4 * MiB, host_reserved_nbytes=4 * MiB),
    "t4": sim.get_profile("t4-16gb"),
}


def _pressure(name: str, total: int):
    return {
        "none": None,
        "step": Step(nbytes=total // 4, at_s=2e-4, until_s=3e-3),
        "spikes": PeriodicSpikes(nbytes=total // 5, period_s=1e-3, spike_s=3e-4),
        "random": RandomArrivals(rate_per_s=3000.0, mean_hold_s=1e-3, min_nbytes=total // 100,
                                 max_nbytes=total // 10),
        "two": [Step(nbytes=total // 8 + 1, at_s=1e-4), PeriodicSpikes(nbytes=total // 6, period_s=7e-4,
                                                                        spike_s=2e-4)],
    }[name]


FAULTS = {
    "none": None,
    "rate": FaultPlan(malloc_failure_rate=0.2),
    "calls": FaultPlan(fail_allocation_calls={2, 5, 9}, transient_error_calls={3, 4, 12}),
    "lost": FaultPlan(device_lost_at_s=2e-2),
    "percall": FaultPlan(call_failure_rates={name: 0.08 for name in CALL_NAMES}),
}

SIZES = st.one_of(
    st.integers(1, 4096),
    st.sampled_from([1, 511, 512, 513, 64 * 1024, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1, 2 * MiB, 2 * MiB + 512,
                     3 * MiB, 5 * MiB]),
    st.integers(1, 24 * MiB),
)


class _Alloc:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.sig: bytes | None = None  # written at offset 0 right after malloc
        self.last: tuple[int, bytes] | None = None  # the last random write (offset, data)


class _Chunk:
    def __init__(self, handle) -> None:
        self.handle = handle
        self.released = False
        self.maps = 0
        self.last: tuple[int, bytes] | None = None  # (offset in chunk, data)


class _Mapping:
    def __init__(self, va: int, nbytes: int, chunk: _Chunk, offset: int, res_va: int) -> None:
        self.va, self.nbytes, self.chunk, self.offset, self.res_va = va, nbytes, chunk, offset, res_va
        self.accessible = False


class SimDeviceMachine(RuleBasedStateMachine):
    dev: SimDevice

    @initialize(profile=st.sampled_from(sorted(PROFILES)), pressure=st.sampled_from(["none", "step", "spikes",
                                                                                     "random", "two"]),
                faults=st.sampled_from(sorted(FAULTS)), seed=st.integers(0, 2**16))
    def open(self, profile, pressure, faults, seed):
        prof = PROFILES[profile]
        self.dev = SimDevice(prof, pressure=_pressure(pressure, prof.total_nbytes), faults=FAULTS[faults],
                             seed=seed)
        self.has_tenants = pressure != "none"
        self.rng = random.Random(seed)
        self.allocs: dict[int, _Alloc] = {}
        self.freed: set[int] = set()
        self.pages: dict[int, set[int]] = {}  # small page start -> ptrs, in creation order
        self.chunks: dict[int, _Chunk] = {}
        self.reservations: dict[int, int] = {}
        self.mappings: dict[int, _Mapping] = {}
        self.works: list = []  # launched sim.Work, unfinished ones matter

    # -- helpers ---------------------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        return self.dev._lost  # noqa: SLF001 - sim internals are fair game in tests/sim

    def _snapshot(self):
        acc = self.dev.accounting()
        return (acc[0], acc[2], None if self.has_tenants else acc[1],
                sorted(self.dev.allocation_ranges()), sorted(self.dev.mapping_ranges()))

    def _failed(self, before, exc: GpumemError, *allowed: type) -> None:
        """A call raised: the class is one it may raise, and nothing changed."""
        if isinstance(exc, DeviceLostError):
            assert self.lost, exc
        elif isinstance(exc, CudaError):
            assert exc.injected and exc.error_name == "CUDA_ERROR_UNKNOWN", exc
        else:
            assert not self.lost or isinstance(exc, (InvalidArgumentError,)), f"lost device raised {exc!r}"
            assert isinstance(exc, allowed), f"unexpected {type(exc).__name__}: {exc}"
        assert self._snapshot() == before, f"a failed call changed the state: {exc!r}"

    def _expect_lost_or(self, fn, *allowed: type):
        """Run fn; return its result, or None after checking a failure is allowed and changed nothing."""
        before = self._snapshot()
        faults_before = self.dev.stats.injected_faults
        try:
            return fn(), False
        except GpumemError as exc:
            if isinstance(exc, OutOfMemoryError) and exc.injected:
                assert self.dev.stats.injected_faults > faults_before, "injected=True but no fault was injected"
            if isinstance(exc, (OutOfMemoryError, TransientDeviceError)):
                injected = self.dev.stats.injected_faults > faults_before
                if isinstance(exc, TransientDeviceError):
                    assert injected, "a transient error that was not injected"
                self._last_injected = injected
            self._failed(before, exc, *allowed)
            return exc, True

    def _small_prediction(self, nbytes: int) -> int | None:
        """Where the sim must put a small malloc: first fit in the live small pages, in creation order."""
        span = align_up(nbytes, SMALL_MALLOC_ALIGNMENT)
        for start, ptrs in self.pages.items():
            cursor = start
            for p in sorted(ptrs):
                if p - cursor >= span:
                    return cursor
                cursor = p + align_up(self.allocs[p].nbytes, SMALL_MALLOC_ALIGNMENT)
            if start + GRAN - cursor >= span:
                return cursor
        return None

    def _expected_process_pages(self) -> int:
        pages = len(self.pages)
        pages += sum(align_up(a.nbytes, GRAN) // GRAN for a in self.allocs.values()
                     if a.nbytes > SMALL_MALLOC_MAX_NBYTES)
        pages += sum(c.handle.nbytes // GRAN for c in self.chunks.values())
        return pages

    # -- malloc / free ------------------------------------------------------------------------------------
    @rule(nbytes=SIZES)
    def malloc(self, nbytes):
        small = nbytes <= SMALL_MALLOC_MAX_NBYTES
        predicted = self._small_prediction(nbytes) if small else None
        need = (0 if predicted is not None else GRAN) if small else align_up(nbytes, GRAN)
        pages_before = self.dev.process_used_nbytes
        self._last_injected = False
        result, failed = self._expect_lost_or(lambda: self.dev.malloc(nbytes), OutOfMemoryError,
                                              TransientDeviceError)
        if failed:
            if isinstance(result, OutOfMemoryError) and not self._last_injected:
                assert need > self.dev._free_nbytes(), (need, self.dev._free_nbytes())  # noqa: SLF001
                assert result.requested_nbytes == nbytes
                assert result.free_nbytes == self.dev._free_nbytes()  # noqa: SLF001
            return
        ptr = result
        assert ptr % (SMALL_MALLOC_ALIGNMENT if small else GRAN) == 0
        assert self.dev.process_used_nbytes - pages_before == need
        if small:
            if predicted is not None:
                assert ptr == predicted, (hex(ptr), hex(predicted))
            page = ptr - ptr % GRAN
            self.pages.setdefault(page, set()).add(ptr)
        a = self.allocs[ptr] = _Alloc(ptr, nbytes)
        self.freed.discard(ptr)
        sig = self.rng.randbytes(min(nbytes, 16))
        try:
            self.dev.write(ptr, sig)
            a.sig = sig
        except DeviceLostError:
            assert self.lost

    def _pick_alloc(self, data) -> _Alloc:
        return self.allocs[data.draw(st.sampled_from(sorted(self.allocs)))]

    @precondition(lambda self: self.allocs)
    @rule(data=st.data())
    def free(self, data):
        a = self._pick_alloc(data)
        used_before = self.dev.process_used_nbytes
        if self._touched(a.ptr, a.nbytes):
            result, failed = self._expect_lost_or(lambda: self.dev.free(a.ptr), MemoryHazardError)
            assert failed, "free under unfinished work did not raise"
            return
        _, failed = self._expect_lost_or(lambda: self.dev.free(a.ptr))
        if failed:
            return
        del self.allocs[a.ptr]
        self.freed.add(a.ptr)
        if a.nbytes <= SMALL_MALLOC_MAX_NBYTES:
            page = a.ptr - a.ptr % GRAN
            self.pages[page].discard(a.ptr)
            returned = 0
            if not self.pages[page]:
                del self.pages[page]
                returned = GRAN
        else:
            returned = align_up(a.nbytes, GRAN)
        assert used_before - self.dev.process_used_nbytes == returned

    # -- misuse: one rule, so that bad calls are a small share of the steps ---------------------------------------
    @rule(data=st.data(), kind=st.sampled_from(["malloc_bad", "double_free", "free_inside", "read_past_end",
                                                "vmm_unsupported"]))
    def misuse(self, data, kind):
        if kind == "malloc_bad":
            nbytes = data.draw(st.sampled_from([-1, 0, 1.5, "10", True, None]))
            _, failed = self._expect_lost_or(lambda: self.dev.malloc(nbytes), InvalidArgumentError)
        elif kind == "double_free" and self.freed:
            ptr = data.draw(st.sampled_from(sorted(self.freed)))  # never live: malloc takes reused ones out
            _, failed = self._expect_lost_or(lambda: self.dev.free(ptr), DoubleFreeError)
        elif kind == "free_inside" and self.allocs:
            a, delta = self._pick_alloc(data), data.draw(st.integers(1, 511))
            _, failed = self._expect_lost_or(lambda: self.dev.free(a.ptr + delta), InvalidPointerError)
        elif kind == "read_past_end" and self.allocs:
            a, extra = self._pick_alloc(data), data.draw(st.integers(1, 4096))
            _, failed = self._expect_lost_or(lambda: self.dev.read(a.ptr, a.nbytes + extra), InvalidPointerError)
        elif kind == "vmm_unsupported" and not self.dev.vmm_supported:
            _, failed = self._expect_lost_or(lambda: self.dev.address_reserve(GRAN), UnsupportedOperationError)
            assert failed
            _, failed = self._expect_lost_or(lambda: self.dev.mem_create(GRAN), UnsupportedOperationError)
        else:
            return
        assert failed, f"{kind} did not raise"

    # -- data ----------------------------------------------------------------------------------------------
    @precondition(lambda self: self.allocs)
    @rule(data=st.data())
    def write_read(self, data):
        a = self._pick_alloc(data)
        if a.nbytes <= 16:
            return  # all signature
        offset = data.draw(st.integers(16, a.nbytes - 1))  # the first 16 bytes keep the signature
        length = data.draw(st.integers(1, min(a.nbytes - offset, 8192)))
        payload = self.rng.randbytes(length)
        _, failed = self._expect_lost_or(lambda: self.dev.write(a.ptr + offset, payload))
        if failed:
            return
        a.last = (offset, payload)
        back, failed = self._expect_lost_or(lambda: self.dev.read(a.ptr + offset, length))
        if not failed:
            assert back == payload

    # -- virtual memory management ----------------------------------------------------------------------------
    @precondition(lambda self: self.dev.vmm_supported)
    @rule(n_gran=st.integers(1, 8))
    def reserve(self, n_gran):
        va, failed = self._expect_lost_or(lambda: self.dev.address_reserve(n_gran * GRAN))
        if not failed:
            assert va % GRAN == 0
            self.reservations[va] = n_gran * GRAN

    @precondition(lambda self: self.dev.vmm_supported)
    @rule(n_gran=st.integers(1, 6))
    def create(self, n_gran):
        self._last_injected = False
        used_before = self.dev.process_used_nbytes
        h, failed = self._expect_lost_or(lambda: self.dev.mem_create(n_gran * GRAN), OutOfMemoryError,
                                         TransientDeviceError)
        if failed:
            if isinstance(h, OutOfMemoryError) and not self._last_injected:
                assert n_gran * GRAN > self.dev._free_nbytes()  # noqa: SLF001
            return
        assert h.nbytes == n_gran * GRAN
        assert self.dev.process_used_nbytes - used_before == n_gran * GRAN
        self.chunks[h.handle] = _Chunk(h)

    @precondition(lambda self: self.dev.vmm_supported and self.reservations and self.chunks)
    @rule(data=st.data())
    def map(self, data):
        res_va = data.draw(st.sampled_from(sorted(self.reservations)))
        res_n = self.reservations[res_va]
        chunk = self.chunks[data.draw(st.sampled_from(sorted(self.chunks)))]
        size = chunk.handle.nbytes
        offset = data.draw(st.sampled_from(range(0, size, GRAN)))
        most = size - offset if size - offset <= res_n or data.draw(st.integers(0, 4)) == 0 else res_n
        nbytes = data.draw(st.sampled_from(range(GRAN, most + 1, GRAN)))
        if nbytes <= res_n and data.draw(st.integers(0, 4)):  # mostly a slot where it fits
            slot = data.draw(st.integers(0, (res_n - nbytes) // GRAN))
        else:
            slot = data.draw(st.integers(0, res_n // GRAN))  # the last slot is past the end
        va = res_va + slot * GRAN  # the last slot lies past the end (perhaps in the next reservation)
        home = next((r for r, n in self.reservations.items() if r <= va < r + n), None)
        if chunk.released:
            expected = InvalidPointerError
        elif home is None or va + nbytes > home + self.reservations[home]:
            expected = MappingError
        elif any(m.res_va == home and m.va < va + nbytes and va < m.va + m.nbytes for m in self.mappings.values()):
            expected = MappingOverlapError
        else:
            expected = None
        if expected is None:
            _, failed = self._expect_lost_or(lambda: self.dev.mem_map(va, nbytes, chunk.handle, offset))
            if not failed:
                self.mappings[va] = _Mapping(va, nbytes, chunk, offset, home)
                chunk.maps += 1
        else:
            result, failed = self._expect_lost_or(lambda: self.dev.mem_map(va, nbytes, chunk.handle, offset),
                                                  expected)
            assert failed
            if not isinstance(result, DeviceLostError):
                assert type(result) is expected, (result, expected)

    def _pick_mapping(self, data) -> _Mapping:
        return self.mappings[data.draw(st.sampled_from(sorted(self.mappings)))]

    @precondition(lambda self: self.mappings)
    @rule(data=st.data())
    def set_access(self, data):
        m = self._pick_mapping(data)
        _, failed = self._expect_lost_or(lambda: self.dev.mem_set_access(m.va, m.nbytes))
        if not failed:
            m.accessible = True

    @precondition(lambda self: self.mappings)
    @rule(data=st.data())
    def unmap(self, data):
        m = self._pick_mapping(data)
        used_before = self.dev.process_used_nbytes
        if self._touched(m.va, m.nbytes):
            _, failed = self._expect_lost_or(lambda: self.dev.mem_unmap(m.va, m.nbytes), MemoryHazardError)
            assert failed, "unmap under unfinished work did not raise"
            return
        _, failed = self._expect_lost_or(lambda: self.dev.mem_unmap(m.va, m.nbytes))
        if failed:
            return
        del self.mappings[m.va]
        m.chunk.maps -= 1
        returned = 0
        if m.chunk.released and m.chunk.maps == 0:
            del self.chunks[m.chunk.handle.handle]
            returned = m.chunk.handle.nbytes
        assert used_before - self.dev.process_used_nbytes == returned

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def release(self, data):
        chunk = self.chunks[data.draw(st.sampled_from(sorted(self.chunks)))]
        used_before = self.dev.process_used_nbytes
        if chunk.released:
            _, failed = self._expect_lost_or(lambda: self.dev.mem_release(chunk.handle), InvalidPointerError)
            assert failed
            return
        _, failed = self._expect_lost_or(lambda: self.dev.mem_release(chunk.handle))
        if failed:
            return
        chunk.released = True
        returned = 0
        if chunk.maps == 0:
            del self.chunks[chunk.handle.handle]
            returned = chunk.handle.nbytes
        assert used_before - self.dev.process_used_nbytes == returned

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def address_free(self, data):
        va = data.draw(st.sampled_from(sorted(self.reservations)))
        busy = any(m.res_va == va for m in self.mappings.values())
        if busy:
            _, failed = self._expect_lost_or(lambda: self.dev.address_free(va, self.reservations[va]), MappingError)
            assert failed
            return
        _, failed = self._expect_lost_or(lambda: self.dev.address_free(va, self.reservations[va]))
        if not failed:
            del self.reservations[va]

    @precondition(lambda self: any(m.accessible for m in self.mappings.values()))
    @rule(data=st.data())
    def vmm_write_read(self, data):
        m = self.mappings[data.draw(st.sampled_from(sorted(v for v, m in self.mappings.items() if m.accessible)))]
        start = data.draw(st.integers(0, m.nbytes - 1))
        length = data.draw(st.integers(1, min(m.nbytes - start, 8192)))
        payload = self.rng.randbytes(length)
        _, failed = self._expect_lost_or(lambda: self.dev.write(m.va + start, payload))
        if failed:
            return
        m.chunk.last = (m.offset + start, payload)
        back, failed = self._expect_lost_or(lambda: self.dev.read(m.va + start, length))
        if not failed:
            assert back == payload

    # -- streams and the sanitizer ------------------------------------------------------------------------------
    def _touched(self, va: int, nbytes: int) -> bool:
        """Whether unfinished work touches ``[va, va + nbytes)`` (what the sanitizer must refuse)."""
        return any(not w.done and p < va + nbytes and va < p + n for w in self.works for p, n in w.touches)

    def _live_ranges(self) -> list[tuple[int, int]]:
        """Where work may touch: live allocations and mappings with access."""
        return ([(a.ptr, a.nbytes) for a in self.allocs.values()]
                + [(m.va, m.nbytes) for m in self.mappings.values() if m.accessible])

    @precondition(lambda self: self.allocs or any(m.accessible for m in self.mappings.values()))
    @rule(data=st.data(), stream=st.integers(0, 3), duration_us=st.integers(0, 5000), n_touches=st.integers(1, 3))
    def launch(self, data, stream, duration_us, n_touches):
        live = sorted(self._live_ranges())
        touches = []
        for _ in range(n_touches):
            start, n = data.draw(st.sampled_from(live))
            off = data.draw(st.integers(0, n - 1))
            touches.append((start + off, data.draw(st.integers(1, n - off))))
        work, failed = self._expect_lost_or(lambda: self.dev.launch(stream, duration_us * 1e-6, touches))
        if not failed:
            assert work.touches == tuple(touches)
            self.works.append(work)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def launch_on_freed_memory(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.freed)))
        if any(a.ptr <= ptr < a.ptr + a.nbytes for a in self.allocs.values()) or any(
                m.va <= ptr < m.va + m.nbytes for m in self.mappings.values()):
            return  # the address was handed out again
        before_tail = self.dev.streams.tail(1)
        _, failed = self._expect_lost_or(lambda: self.dev.launch(1, 1e-3, [(ptr, 8)]), MemoryHazardError)
        assert failed
        assert self.dev.streams.tail(1) is before_tail

    @rule(how=st.sampled_from(["event", "stream", "device", "query"]), stream=st.integers(0, 3))
    def wait(self, how, stream):
        dev = self.dev
        if how == "device":
            _, failed = self._expect_lost_or(dev.synchronize)
            if not failed:
                assert all(w.done for w in self.works)
            return
        if how == "stream":
            _, failed = self._expect_lost_or(lambda: dev.stream_synchronize(stream))
            if not failed:
                assert all(w.done for w in self.works if w.stream == stream)
            return
        event, failed = self._expect_lost_or(lambda: dev.event_record(stream))
        if failed:
            return
        pending = [w for w in self.works if w.stream == stream and not w.done]
        if how == "event":
            _, failed = self._expect_lost_or(lambda: dev.event_synchronize(event))
            if not failed:
                assert all(w.done for w in pending)
        else:
            complete, failed = self._expect_lost_or(lambda: dev.event_query(event))
            if not failed:
                assert complete == all(w.done for w in pending)
        self._expect_lost_or(lambda: dev.event_destroy(event))

    # -- time, pressure and the end ------------------------------------------------------------------------------
    @rule(dt_us=st.integers(0, 3000))
    def advance(self, dt_us):
        # the advance that crosses the loss time succeeds; after a loss advance raises DeviceLostError
        self._expect_lost_or(lambda: self.dev.advance(dt_us * 1e-6))

    @rule()
    def mem_info(self):
        info, failed = self._expect_lost_or(self.dev.mem_info)
        if not failed:
            assert info.free_nbytes == self.dev._free_nbytes()  # noqa: SLF001

    # -- invariants --------------------------------------------------------------------------------------------
    @invariant()
    def ranges_do_not_overlap_and_match_the_model(self):
        allocs = sorted(self.dev.allocation_ranges())
        for (a, na), (b, _) in zip(allocs, allocs[1:]):
            assert a + na <= b
        assert allocs == sorted((a.ptr, a.nbytes) for a in self.allocs.values())
        maps = sorted(self.dev.mapping_ranges())
        for (a, na, _), (b, _, _) in zip(maps, maps[1:]):
            assert a + na <= b
        assert maps == sorted((m.va, m.nbytes, m.chunk.handle.handle) for m in self.mappings.values())
        for va, n, _ in maps:  # mappings live inside their reservations, which no malloc overlaps
            assert not any(p < va + n and va < p + pn for p, pn in allocs)

    @invariant()
    def unfinished_work_touches_only_live_memory(self):
        self.works = [w for w in self.works if not w.done]
        live = self._live_ranges()
        for w in self.works:
            for p, n in w.touches:
                assert any(s <= p and p + n <= s + sn for s, sn in live), (w, hex(p), n)

    @invariant()
    def used_plus_free_is_total(self):
        dev, prof = self.dev, self.dev.profile
        free = dev._free_nbytes()  # noqa: SLF001
        assert free >= 0
        assert dev.tenant_nbytes == sum(t._held_pages for t in dev._tenants) * GRAN  # noqa: SLF001
        assert (free + dev.process_used_nbytes + dev.tenant_nbytes + prof.context_nbytes
                + prof.host_reserved_nbytes) == prof.total_nbytes
        assert dev.process_used_nbytes == self._expected_process_pages() * GRAN
        acc = dev.accounting()
        assert acc[0] * GRAN == dev.process_used_nbytes and acc[1] * GRAN == dev.tenant_nbytes
        assert acc[2] == len(self.allocs) + len(self.chunks)
        dev.check_invariants()

    @invariant()
    def nothing_is_lost(self):
        try:
            self._check_contents()
        except DeviceLostError:  # the reads themselves took the clock past device_lost_at_s
            assert self.lost

    def _check_contents(self) -> None:
        if self.lost:
            return
        for a in self.allocs.values():
            if a.sig is not None:
                assert self.dev.read(a.ptr, len(a.sig)) == a.sig
            if a.last is not None:
                off, payload = a.last
                assert self.dev.read(a.ptr + off, len(payload)) == payload
        for chunk in self.chunks.values():
            if chunk.last is None:
                continue
            off, payload = chunk.last
            for m in self.mappings.values():
                if m.chunk is chunk and m.accessible and m.offset <= off and off + len(payload) <= m.offset + m.nbytes:
                    assert self.dev.read(m.va + off - m.offset, len(payload)) == payload

    def teardown(self):
        dev = getattr(self, "dev", None)
        if dev is None:
            return
        dev.close()
        assert dev.process_used_nbytes == 0 and dev.n_allocations == 0 and dev.mapping_ranges() == []
        try:
            dev.mem_info()
        except DeviceClosedError:
            pass
        else:
            raise AssertionError("mem_info after close did not raise")


# Examples are cheap (a few ms each) and Hypothesis enables a random subset of the rules in each one
# (swarm testing), so long VMM sequences need many examples: 20 times the profile's max_examples
# (about 6 s with the "dev" profile, 20 s with "ci").
SimDeviceMachine.TestCase.settings = settings(max_examples=20 * settings.default.max_examples,
                                              stateful_step_count=60)
TestSimDevice = SimDeviceMachine.TestCase


def test_event_kinds_cover_the_machine():
    """The machine's scenarios publish the tenant events it relies on (a smoke test of the set-up)."""
    prof = PROFILES["tiny"]
    dev = SimDevice(prof, pressure=_pressure("spikes", prof.total_nbytes), faults=FAULTS["rate"], seed=1)
    for _ in range(30):
        try:
            dev.malloc(4 * MiB)
        except OutOfMemoryError:
            pass
        dev.advance(5e-4)
    kinds = {e.kind for e in dev.events.history}
    assert {MemoryEventKind.TENANT_TOOK, MemoryEventKind.TENANT_RETURNED, MemoryEventKind.FAULT_INJECTED} <= kinds
