"""The reserve rule (Note [The reserve rule] in gpumem.managers.reserve)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.device import MemInfo
from gpumem.errors import InvalidArgumentError, OutOfMemoryError
from gpumem.managers.reserve import Reserve, compute_reserve, emergency_nbytes, usable_nbytes
from gpumem.sim.profiles import BUILTIN_PROFILES, get_profile
from gpumem.units import GiB, MiB

PROFILES = [p.name for p in BUILTIN_PROFILES]


def _props(total: int, name: str = "gtx-1050-2gb"):
    return dataclasses.replace(get_profile(name).properties(), total_nbytes=total)


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_measured_at_start(name):
    with gpumem.open_device(f"sim:{name}") as dev:
        mem = dev.mem_info()
        r = compute_reserve(dev.properties(), mem)
        u = usable_nbytes(dev.properties(), mem)
    # the context is what the device showed used: already gone from free, counted once
    assert r.context_nbytes == mem.used_nbytes
    assert r.nbytes + u == mem.total_nbytes
    assert u == mem.free_nbytes - r.emergency_nbytes > 0
    assert r.emergency_nbytes <= mem.total_nbytes // 10
    assert 128 * MiB <= r.emergency_nbytes <= 2 * GiB


def test_two_gb_card_beats_the_seeds_rule():
    with gpumem.open_device("sim:gtx-1050-2gb") as dev:
        mem = dev.mem_info()
        r = compute_reserve(dev.properties(), mem)
    seeds = min(600 * 1000**2 + mem.total_nbytes // 10, 2 * 1000**3)
    assert r.nbytes < seeds / 3                       # 208 MiB instead of 772 MiB
    assert mem.total_nbytes - r.nbytes > 0.85 * mem.total_nbytes


def test_h200_keeps_about_two_and_a_half_gib():
    with gpumem.open_device("sim:h200-141gb") as dev:
        r = compute_reserve(dev.properties(), dev.mem_info())
    assert r.emergency_nbytes == 2 * GiB
    assert r.nbytes < 0.02 * dev.properties().total_nbytes


def test_min_free_bytes_raises_emergency_up_to_an_eighth():
    props = get_profile("a100-80gb").properties()
    mem = MemInfo(props.total_nbytes - 420 * MiB, props.total_nbytes)
    assert compute_reserve(props, mem, min_free_bytes=4 * GiB).emergency_nbytes == 4 * GiB
    small = get_profile("gtx-1050-2gb").properties()
    mem2 = MemInfo(small.total_nbytes - 80 * MiB, small.total_nbytes)
    assert compute_reserve(small, mem2, min_free_bytes=512 * 1000**2).emergency_nbytes == small.total_nbytes // 8


def test_nothing_used_means_context_estimated():
    props = get_profile("t4-16gb").properties()
    r = compute_reserve(props, MemInfo(props.total_nbytes, props.total_nbytes))
    assert 64 * MiB <= r.context_nbytes <= 512 * MiB


@pytest.mark.parametrize("bad", [
    dict(min_free_bytes=-1), dict(min_free_bytes=1.5), dict(min_free_bytes=True),
])
def test_bad_min_free(bad):
    props = get_profile("t4-16gb").properties()
    with pytest.raises(InvalidArgumentError, match="min_free_bytes"):
        compute_reserve(props, MemInfo(props.total_nbytes // 2, props.total_nbytes), **bad)


def test_bad_inputs():
    props = get_profile("t4-16gb").properties()
    with pytest.raises(InvalidArgumentError, match="properties"):
        compute_reserve("t4", MemInfo(1, 2))
    with pytest.raises(InvalidArgumentError, match="MemInfo"):
        compute_reserve(props, (1, 2))
    with pytest.raises(InvalidArgumentError, match="free <= total"):
        compute_reserve(props, MemInfo(3, 2))
    with pytest.raises(InvalidArgumentError, match="context_nbytes"):
        Reserve(-1, 0)


def test_full_device_has_nothing_usable():
    props = get_profile("t4-16gb").properties()
    with pytest.raises(OutOfMemoryError, match="Nothing is usable"):
        usable_nbytes(props, MemInfo(100 * MiB, props.total_nbytes))


totals = st.integers(min_value=256 * MiB, max_value=256 * GiB)
profile_names = st.sampled_from(PROFILES)


@settings(deadline=None)
@given(profile_names, totals, totals)
def test_monotone_in_total(name, t1, t2):
    lo, hi = sorted((t1, t2))
    p = get_profile(name)
    ctx_share = (p.context_nbytes + p.host_reserved_nbytes) / p.total_nbytes

    def measure(total):
        ctx = int(total * ctx_share)
        return _props(total, name), MemInfo(total - ctx, total)

    # the same context at both totals isolates the rule's dependence on the total
    ctx = int(lo * ctx_share)
    r_lo = compute_reserve(_props(lo, name), MemInfo(lo - ctx, lo))
    r_hi = compute_reserve(_props(hi, name), MemInfo(hi - ctx, hi))
    assert r_lo.emergency_nbytes <= r_hi.emergency_nbytes
    assert r_lo.nbytes <= r_hi.nbytes
    assert (usable_nbytes(_props(lo, name), MemInfo(lo - ctx, lo))
            <= usable_nbytes(_props(hi, name), MemInfo(hi - ctx, hi)))
    for total in (lo, hi):
        props, mem = measure(total)
        r = compute_reserve(props, mem)
        assert r.emergency_nbytes <= total // 10          # never more than a sane share
        assert r.context_nbytes == mem.used_nbytes
        assert usable_nbytes(props, mem) > 0


@settings(deadline=None)
@given(totals, st.integers(min_value=0, max_value=64 * GiB))
def test_min_free_never_past_an_eighth(total, min_free):
    e = emergency_nbytes(total, min_free_bytes=min_free)
    assert e <= max(total // 8, emergency_nbytes(total))
    assert e >= emergency_nbytes(total)
    assert e <= total // 8 or e == emergency_nbytes(total)


def test_the_documented_table_is_the_computed_one():
    """reports/reserve-rule.md (where Note [The reserve rule] sends the reader) shows reserve_table()."""
    import pathlib

    from gpumem.managers.reserve import reserve_table

    doc = (pathlib.Path(__file__).resolve().parents[2] / "reports" / "reserve-rule.md").read_text(encoding="utf-8")
    for line in reserve_table().splitlines():
        assert line + "\n" in doc


def test_the_managers_guide_gtx_1050_figures():
    """docs/managers.md: the GTX 1050 keeps 329.75 MiB and gives 1668.25 MiB by default, 208 and 1790
    MiB with for_constrained() (the guide once gave only the latter, as if it were the default)."""
    import pathlib

    from gpumem.managers import GpuMemoryManager, MemoryConfig

    MiB = 2**20
    guide = (pathlib.Path(__file__).parents[2] / "docs" / "managers.md").read_text()
    for config, reserved, usable in ((None, 329.75, 1668.25), (MemoryConfig.for_constrained(), 208, 1790)):
        with GpuMemoryManager("sim:gtx-1050-2gb", config=config) as m:
            assert m.total_memory == 1998 * MiB
            assert (m.reserved_memory / MiB, m.usable_memory / MiB) == (reserved, usable)
            assert f"{reserved:g} MiB (80 MiB context" in guide and f"| {usable:g} MiB |" in guide
