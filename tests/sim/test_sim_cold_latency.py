"""Note [A cold VMM call costs more]: a VMM call made long after the previous one costs more, by the latency
model's cold term; off by default (every figure as before), and the idle twin, which does not price it, refuses
a device that has it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumem import InvalidArgumentError, MiB
from gpumem.errors import UnsupportedOperationError
from gpumem.sim import LatencyModel
from gpumem.sim.latency import MEASURED_COLD_VMM_US

from tests.sim.test_sim_busy_latency import US, _cost_us, _device

GRAN = 2 * MiB


def test_off_by_default_and_the_measured_term():
    lat = LatencyModel()
    assert lat.cold_vmm_us == 0.0 and lat.cold_vmm_cost_us(1e6) == 0.0
    on = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US)
    assert on.cold_vmm_gap_us == 150.0
    assert on.cold_vmm_cost_us(150.0) == pytest.approx(18.0 * math.log(2.0))
    assert on.cold_vmm_cost_us(0.0) == on.cold_vmm_cost_us(-5.0) == on.cold_vmm_cost_us(math.nan) == 0.0
    assert math.isfinite(on.cold_vmm_cost_us(math.inf))


@given(a=st.floats(0.0, 1e9), b=st.floats(0.0, 1e9))
def test_a_longer_gap_never_costs_less(a, b):
    lat = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US)
    lo, hi = sorted((a, b))
    assert 0.0 <= lat.cold_vmm_cost_us(lo) <= lat.cold_vmm_cost_us(hi)


@pytest.mark.parametrize("knob,bad", [("cold_vmm_us", -0.1), ("cold_vmm_us", math.nan), ("cold_vmm_us", math.inf),
                                      ("cold_vmm_us", True), ("cold_vmm_us", "18"), ("cold_vmm_us", 1e12),
                                      ("cold_vmm_gap_us", 0.5), ("cold_vmm_gap_us", math.inf),
                                      ("cold_vmm_gap_us", None)])
def test_bad_terms_are_refused(knob, bad):
    with pytest.raises(InvalidArgumentError, match=knob):
        LatencyModel(**{knob: bad})


def test_the_device_prices_a_call_by_the_gap_since_the_last_vmm_call_ended():
    lat = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US)
    dev = _device(lat)
    price = lat.mem_create_cost_us(GRAN)
    first = _cost_us(dev, lambda: dev.mem_create(GRAN))   # no VMM call before: no gap to price
    assert first == pytest.approx(price)
    warm = _cost_us(dev, lambda: dev.mem_create(GRAN))    # right after the previous one
    assert warm == pytest.approx(price)
    dev.advance(0.010)                                      # 10 ms of the program's own work
    cold = _cost_us(dev, lambda: dev.mem_create(GRAN))
    assert cold == pytest.approx(price + lat.cold_vmm_cost_us(10_000.0))
    dev.mem_info()                                          # not a VMM call: its time is part of the gap
    after = _cost_us(dev, lambda: dev.mem_create(GRAN))
    assert after == pytest.approx(price + lat.cold_vmm_cost_us(lat.mem_get_info_us))


def test_off_the_calls_cost_what_they_did():
    dev, plain = _device(LatencyModel(cold_vmm_us=0.0)), _device(LatencyModel())
    for d in (dev, plain):
        d.mem_create(GRAN)
        d.advance(0.5)
    assert _cost_us(dev, lambda: dev.mem_create(GRAN)) == _cost_us(plain, lambda: plain.mem_create(GRAN))


def test_the_idle_twin_refuses_a_device_with_the_cold_term():
    dev = _device(LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US))
    with pytest.raises(UnsupportedOperationError, match="cold"):
        dev.attach_idle_twin(lambda: None)
    assert not dev._twins   # noqa: SLF001 - nothing attached
    _device(LatencyModel()).attach_idle_twin(lambda: None)


def test_a_numpy_or_subclassed_term_is_kept_as_a_plain_float():
    np = pytest.importorskip("numpy")

    class Odd(float):
        def __mul__(self, other):
            return math.nan

    for value in (np.float32(18), np.float16(18), Odd(18.0)):
        lat = LatencyModel(cold_vmm_us=value)
        assert type(lat.cold_vmm_us) is float and lat.cold_vmm_us == 18.0
    dev = _device(LatencyModel(cold_vmm_us=np.float32(18)))
    dev.mem_create(GRAN)
    dev.advance(3600.0)
    dev.mem_create(GRAN)
    assert type(dev.now_s) is float and math.isfinite(dev.stats.busy_us)


@pytest.mark.parametrize("bad", [None, "100", True, [1.0]])
def test_a_gap_that_is_not_a_number_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="gap_us"):
        LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US).cold_vmm_cost_us(bad)


def test_a_calls_own_wait_for_the_device_is_not_a_pause():
    lat = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US, waits_for_device=frozenset({"mem_map"}))
    dev = _device(lat)
    h = dev.mem_create(GRAN)
    va = dev.address_reserve(GRAN)
    dev.launch(0, 0.010)
    dev.mem_map(va, GRAN, h, 0)
    assert dev.stats.cost_us["mem_map"] == pytest.approx(lat.mem_map_us + lat.cold_vmm_cost_us(lat.launch_us))


def test_the_term_is_added_after_the_busy_factor():
    lat = LatencyModel.as_measured(cold_vmm_us=MEASURED_COLD_VMM_US)
    dev = _device(lat)
    dev.mem_create(GRAN)
    dev.launch(0, 1.0)
    dev.advance(0.05)
    cost = _cost_us(dev, lambda: dev.mem_create(GRAN))
    assert cost == pytest.approx(lat.mem_create_cost_us(GRAN) * lat.busy_factor(0)
                                 + lat.cold_vmm_cost_us(0.05e6 + lat.launch_us))


def test_every_cost_is_kept_as_a_plain_float_and_a_bad_one_refused():
    np = pytest.importorskip("numpy")
    lat = LatencyModel(mem_map_us=np.float32(2.5), mem_create_points=((2 * MiB, np.float32(10.5)),))
    assert type(lat.mem_map_us) is float and type(lat.mem_create_points[0][1]) is float
    dev = _device(lat)
    h = dev.mem_create(GRAN)
    va = dev.address_reserve(GRAN)
    dev.mem_map(va, GRAN, h, 0)
    assert type(dev.now_s) is float
    for knob, bad in (("mem_map_us", "2.1"), ("mem_map_us", -5.0), ("mem_map_us", math.nan), ("malloc_share", 1.5),
                      ("mem_create_points", ((2 * MiB, -1.0),)), ("mem_create_points", ()), ("launch_us", True)):
        with pytest.raises(InvalidArgumentError, match=knob):
            LatencyModel(**{knob: bad})


def test_a_float_that_will_not_convert_is_refused():
    class Raising(float):
        def __float__(self):
            raise RuntimeError("no")

    with pytest.raises(InvalidArgumentError, match="cold_vmm_us"):
        LatencyModel(cold_vmm_us=Raising(1.0))
    with pytest.raises(InvalidArgumentError, match="gap_us"):
        LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US).cold_vmm_cost_us(Raising(1.0))


def test_a_gap_past_any_float_is_capped():
    on = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US)
    assert on.cold_vmm_cost_us(10**400) == on.cold_vmm_cost_us(math.inf) > 0
    assert on.cold_vmm_cost_us(-(10**400)) == 0.0
    assert LatencyModel().cold_vmm_cost_us(10**400) == 0.0


def test_an_interrupted_wait_is_not_a_pause_before_the_retry():
    lat = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US, waits_for_device=frozenset({"mem_map"}))
    dev = _device(lat)
    env = dev.env
    h = dev.mem_create(GRAN)
    va = dev.address_reserve(GRAN)

    def fails_midway():
        yield env.timeout(0.005)
        raise RuntimeError("a foreign process fails mid-wait")

    env.process(fails_midway())
    dev.launch(0, 0.010)
    end_before = dev._vmm_end_s   # noqa: SLF001
    start = dev.now_s
    with pytest.raises(RuntimeError, match="mid-wait"):
        dev.mem_map(va, GRAN, h, 0)
    assert dev.stats.device_waits == 1 and dev.stats.device_wait_s > 0
    dev.mem_map(va, GRAN, h, 0)
    assert dev.stats.cost_us["mem_map"] == pytest.approx(
        lat.mem_map_us + lat.cold_vmm_cost_us((start - end_before) / US))


def test_a_create_past_the_card_costs_no_more_than_one_of_the_card():
    from gpumem.errors import OutOfMemoryError

    dev = _device(LatencyModel())
    with pytest.raises(OutOfMemoryError):
        dev.mem_create(2**62)
    assert dev.now_s < 1.0
