"""find_max_batch's search with the gallop skipped (Note [Gallop skipped]) against the search that replays every
size it asks (``skip_gallop=False``): the same answers, on random probes and on real replays."""

import dataclasses

import pytest
from hypothesis import given, strategies as st

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, find_max_batch
from gpumem.estimate.fit import FitTry, ReservedEstimate, _Probes, _search, replay_inference, usable_memory
from gpumem.progress import NoProgress
from gpumem.specs import open_device

TINY = ModelShape(512, 1376, 4, 8000, 8, 8)
WIDE = ModelShape(1024, 2048, 1, 1000, 8, 8)


@dataclasses.dataclass
class _Trace:
    peak_nbytes: int


class FakeReplays:
    """Probes answered from tables: ``fits[lim][v]``; a replay that fits reports ``lim`` as its peak reserved (so a
    fit under the lower limit is shared with the higher, as Note [Probes share replays] has it)."""

    def __init__(self, fits: dict[int, list[bool]], alloc_per_size: int) -> None:
        self.fits = fits
        self.alloc_per_size = alloc_per_size
        self.replayed: list[tuple[int, int]] = []
        self.built: set[int] = set()  # the sizes whose workload was built

    def probes(self, usable: int, tries: list[FitTry]) -> _Probes:
        def replay(w: _Trace, v: int, room: int) -> ReservedEstimate:
            self.replayed.append((v, room))
            ok = self.fits[room][v]
            return ReservedEstimate("fake", "fake", w.peak_nbytes, room if ok else room + 1, ok)

        def workload(v: int) -> _Trace:
            self.built.add(v)
            return _Trace(v * self.alloc_per_size)

        return _Probes(workload, replay, lambda v, r: AssertionError(v),
                       usable, False, NoProgress(), tries)


@st.composite
def fake_searches(draw):
    """Random answers under two limits that meet what the search relies on: the live bytes bound (a size whose
    peak allocated passes the limit does not fit), a fit under the margin's limit is one under the usable memory
    (Note [Probes share replays]), and Note [Gallop skipped]'s assumption under each limit; nothing else (not
    monotone near the answer)."""
    max_value = draw(st.integers(1, 300))
    per = 10
    limit = draw(st.integers(1, 320)) * per  # 0 is read as the usable memory (only ever when both are 0)
    usable = limit + draw(st.integers(0, 80)) * per
    n = max_value + 1
    fit_l = [False] + [draw(st.booleans()) and v * per <= limit for v in range(1, n)]
    fit_u = [False] + [(fit_l[v] or draw(st.booleans())) and v * per <= usable for v in range(1, n)]
    # a size far above the answer that fits is what the gallop meets too: make some runs of fits long
    cut_l, cut_u = draw(st.integers(0, n)), draw(st.integers(0, n))
    for v in range(1, n):
        fit_l[v] = fit_l[v] or (v <= cut_l and v * per <= limit)
        fit_u[v] = fit_u[v] or fit_l[v] or (v <= cut_u and v * per <= usable)
    for fits in (fit_l, fit_u):  # Note [Gallop skipped]: powers of two below one that fits fit
        top = max((1 << k for k in range(n.bit_length()) if (1 << k) < n and fits[1 << k]), default=0)
        for k in range(top.bit_length()):
            fits[1 << k] = True
    for v in range(1, n):
        fit_u[v] = fit_u[v] or fit_l[v]
    start = draw(st.none() | st.integers(0, 2 * max_value))
    return max_value, limit, usable, per, fit_l, fit_u, start


def fake_tables(max_value: int, limit: int, usable: int, fit_l: list[bool], fit_u: list[bool]) -> dict:
    """FakeReplays' tables of a :func:`fake_searches` case: the usable memory's answers past ``max_value`` too (a
    halving retry may start above it), one table where the two limits are one."""
    pad = [False] * (2 * max_value + 2)
    if limit == usable:
        return {limit: [a or b for a, b in zip(fit_l + pad, fit_u + pad)]}
    return {limit: fit_l + pad, usable: fit_u + pad}


@given(fake_searches())
def test_skipping_the_gallop_keeps_every_answer_where_its_assumption_holds(case):
    max_value, limit, usable, per, fit_l, fit_u, start = case
    tables = fake_tables(max_value, limit, usable, fit_l, fit_u)
    plain, skip = FakeReplays(tables, per), FakeReplays(tables, per)
    plain_tries: list[FitTry] = []
    skip_tries: list[FitTry] = []
    want = _search(plain.probes(usable, plain_tries), limit, usable, max_value, start, False)
    got = _search(skip.probes(usable, skip_tries), limit, usable, max_value, start, True)
    assert got == want
    # the sizes it asked are the plain search's, in its order, with the same answers (assumed ones marked)
    assert _path(skip_tries) == _path(plain_tries)
    asked = [t for t in skip_tries if t.rule != "estimate"]
    # and nothing it took as fitting was replayed
    assumed = {(t.value, limit if t.rule.startswith("simulated") else usable) for t in asked
               if t.rule.endswith("assumed")}
    assert not assumed & set(skip.replayed)
    # and it built no workload the plain search did not build (a size past the device may be one the builder
    # refuses: Note [Gallop skipped])
    assert skip.built <= plain.built


def test_an_assumed_size_is_a_power_of_two_below_one_replayed_to_fit():
    tables = {100: [v <= 5 for v in range(40)], 200: [v <= 9 for v in range(40)]}
    fake = FakeReplays(tables, 10)
    tries: list[FitTry] = []
    assert _search(fake.probes(200, tries), 100, 200, 16, None, True) == (5, 16, 16, 8, 9)
    assumed = [(t.value, t.rule) for t in tries if t.rule.endswith("assumed")]
    assert assumed == [(1, "simulated, assumed"), (2, "simulated, assumed"), (1, "binary_search, assumed"),
                       (2, "binary_search, assumed"), (4, "binary_search, assumed")]
    # found downwards from 8 (16's live bytes pass 100): 8 does not fit, 4 does; within 200, 16 does not, 8 does
    assert fake.replayed[:2] == [(8, 100), (4, 100)]
    assert (1, 100) not in fake.replayed and (2, 100) not in fake.replayed


def _path(tries):
    """The sizes a search asked, its own powers-of-two probes left out and assumed answers read as answers."""
    return [(t.value, t.fits, t.rule.removesuffix(", assumed")) for t in tries if not t.rule.endswith("power of two")]


def _answers(r):
    return dataclasses.replace(r, tries=[])


MATRIX = [
    pytest.param(TINY, dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=2, max_value=512), id="tiny"),
    pytest.param(TINY, dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=2, max_value=512,
                            policy="gpumem"), id="tiny-gpumem"),
    pytest.param(TINY, dict(device="sim:gtx-1050-2gb", prompt_len=256, new_tokens=70, max_value=512,
                            policy="expandable"), id="tiny-expandable-70"),
    pytest.param(WIDE, dict(device="sim:gtx-1050-2gb", prompt_len=600, new_tokens=120, max_value=4096),
                 id="wide-not-monotone"),
    pytest.param(WIDE, dict(device="sim:gtx-1050-2gb", prompt_len=600, new_tokens=120, max_value=100,
                            margin=0.0), id="wide-margin-0-capped"),
    pytest.param(WIDE, dict(device="sim:gtx-1050-2gb", prompt_len=600, new_tokens=20, max_value=4096,
                            margin=0.3, start=1000), id="wide-margin-30-start"),
    pytest.param(TINY, dict(device="sim:gtx-1050-2gb", prompt_len=128, training=True, max_value=64),
                 id="training"),
    pytest.param(TINY, dict(device="sim:gtx-1050-2gb", search="seq_len", batch_size=64, new_tokens=8,
                            max_value=8192), id="seq-len"),
    pytest.param(ModelShape(8192, 28672, 8, 128000, 64, 8), dict(device="sim:gtx-1050-2gb", prompt_len=16,
                                                                 new_tokens=1, max_value=8), id="nothing-fits"),
]


@pytest.mark.parametrize("shape, kw", MATRIX)
def test_fit_answers_as_the_search_that_replays_every_size(shape, kw):
    got = find_max_batch(shape, 2, **kw)
    want = find_max_batch(shape, 2, skip_gallop=False, **kw)
    assert _answers(got) == _answers(want)
    # it asked what the plain search asked, in its order, and got the same answers (some without a replay)
    assert _path(got.tries) == _path(want.tries)


@pytest.mark.parametrize("shape, kw", [MATRIX[0], MATRIX[3], MATRIX[6]])
def test_fit_answers_as_the_reference_every_probe_replayed_in_full(shape, kw):
    assert _answers(find_max_batch(shape, 2, **kw)) == _answers(find_max_batch(shape, 2, full_replay=True,
                                                                               skip_gallop=False, **kw))


def test_a_replay_that_fit_only_through_retries_is_not_shared_with_a_higher_limit():
    """Note [Probes share replays]: batch 1152 of this GQA model fits under the margin's limit through out-of-memory
    retries and runs out of memory under the (higher) usable memory. Shared, binary_search answered 1212 where
    the reference, every probe replayed in full, answers 1144."""
    shape = ModelShape(1024, 2816, 4, 32000, 16, 4)
    kw = dict(device="sim:rtx-3060-12gb", prompt_len=256, new_tokens=100)
    got = find_max_batch(shape, 2, **kw)
    assert got.binary_search == 1144
    assert _answers(got) == _answers(find_max_batch(shape, 2, full_replay=True, **kw))


def test_each_probe_of_a_plain_device_spec_runs_on_a_device_of_its_own(monkeypatch):
    """Note [Each probe on a device of its own]: a spec opened by the fit and running alone is given to each
    replay (which opens it anew, so a virtual-memory engine makes its page moves in C++); a spec with faults,
    or a Device given, is shared; the answers are those of the shared device."""
    from gpumem.estimate import fit as fit_module
    from gpumem.specs import open_device

    seen = []
    real = fit_module.replay_inference
    monkeypatch.setattr(fit_module, "replay_inference", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    kw = dict(prompt_len=256, new_tokens=20, max_value=512, policy="gpumem")
    fresh = find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", **kw)
    assert seen and all(d == "sim:gtx-1050-2gb" for d in seen)
    seen.clear()
    dev = open_device("sim:gtx-1050-2gb")
    try:
        shared = find_max_batch(TINY, 2, device=dev, **kw)
    finally:
        dev.close()
    assert seen and all(d is dev for d in seen)
    assert _answers(fresh) == dataclasses.replace(_answers(shared), device=fresh.device)
    seen.clear()
    find_max_batch(TINY, 2, device="sim:gtx-1050-2gb?lost_at_s=1e9", **{**kw, "max_value": 8})  # a fault planned
    assert seen and all(not isinstance(d, str) for d in seen)


def test_the_not_monotone_case_keeps_the_plain_searchs_edge():
    # under the usable memory batch 108 runs out of memory where 112 runs: the binary search's answer is the
    # edge its bisection meets (112), which a search assuming a monotone probe near the answer misses
    kw = dict(prompt_len=600, new_tokens=120)
    dev = open_device("sim:gtx-1050-2gb")
    try:
        usable = usable_memory(dev)

        def fits(b):
            return replay_inference(WIDE, 2, ("pytorch",), dev, batch_size=b, limit=usable, **kw)[0].fits
        assert not fits(108) and fits(112) and not fits(113)
    finally:
        dev.close()
    r = find_max_batch(WIDE, 2, device="sim:gtx-1050-2gb", max_value=4096, **kw)
    assert r.binary_search == 112


@pytest.mark.slow
def test_a_decode_limited_not_monotone_case_answers_as_the_plain_search():
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=64, new_tokens=300, max_value=4096)
    got, want = find_max_batch(TINY, 2, **kw), find_max_batch(TINY, 2, skip_gallop=False, **kw)
    # 446 before the device placed segments as the driver does (2026-11-29); the search still agrees with the plain one
    assert _answers(got) == _answers(want) and got.simulated == 407


def test_skip_gallop_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="skip_gallop"):
        find_max_batch(TINY, 2, device="sim:gtx-1050-2gb", prompt_len=16, skip_gallop="yes")


@pytest.mark.parametrize("max_value", [2**40, 10**23])
def test_a_huge_max_answers_as_the_plain_search(max_value):
    # the powers of two were once found by halving from max_value: 2**40's workload has 371 allocations over
    # 2**63 - 1 bytes, which the builder refuses, and the whole search failed where the plain search answers
    kw = dict(device="sim:gtx-1050-2gb", prompt_len=64, new_tokens=2, max_value=max_value)
    got, want = find_max_batch(TINY, 2, **kw), find_max_batch(TINY, 2, skip_gallop=False, **kw)
    assert _answers(got) == _answers(want)
    assert (want.simulated, want.estimate, want.halving, want.binary_search) == (1119, 1290, 1024, 1131)
    assert _path(got.tries) == _path(want.tries)
    assert max(t.value for t in got.tries) <= max(t.value for t in want.tries)
