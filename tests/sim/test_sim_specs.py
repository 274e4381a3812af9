"""open_device for simulated devices: spec options and keyword arguments."""

from __future__ import annotations

import pytest
import simpy

import gpumem
from gpumem import DeviceKind, DeviceLostError, GiB, InvalidArgumentError, MiB, parse_spec
from gpumem.sim import FaultPlan, PeriodicSpikes, SimDevice, Step, custom_profile


def test_spec_with_every_option():
    dev = gpumem.open_device("sim:h200-141gb?pressure=spikes&seed=3&fail_rate=0.1&lost_at_s=2")
    assert isinstance(dev, SimDevice)
    assert dev.spec == "sim:h200-141gb?pressure=spikes&seed=3&fail_rate=0.1&lost_at_s=2"
    assert dev.seed == 3
    plan = dev.faults.plan
    assert plan.malloc_failure_rate == 0.1 and plan.device_lost_at_s == 2.0
    total = dev.properties().total_nbytes
    dev.advance(0.001)  # inside the first spike: a fifth of the device
    assert dev.tenant_nbytes == -(-(total // 5) // (2 * MiB)) * 2 * MiB
    dev.advance(0.005)
    assert dev.tenant_nbytes == 0
    dev.advance(2.0)
    with pytest.raises(DeviceLostError):
        dev.mem_info()


def test_spec_options_are_repeatable():
    def failures(spec):
        dev = gpumem.open_device(spec)
        out = []
        for i in range(40):
            try:
                dev.free(dev.malloc(4096))
            except gpumem.OutOfMemoryError:
                out.append(i)
        return out

    a = failures("sim:t4-16gb?fail_rate=0.25&seed=11")
    assert a == failures("sim:t4-16gb?fail_rate=0.25&seed=11") and a
    assert a != failures("sim:t4-16gb?fail_rate=0.25&seed=12")


@pytest.mark.parametrize("name", ["step", "ramp", "spikes", "random"])
def test_pressure_presets_by_spec(name):
    dev = gpumem.open_device(f"sim:a100-80gb?pressure={name}&seed=1")
    before = dev.profile.total_nbytes - dev.profile.context_nbytes  # spikes start at once
    lowest = before
    for _ in range(60):
        dev.advance(0.002)
        lowest = min(lowest, dev.mem_info().free_nbytes)
    assert lowest < before


def test_keyword_arguments_take_precedence():
    dev = gpumem.open_device("sim:t4-16gb?seed=3&fail_rate=0.5", seed=4, faults=FaultPlan(),
                             pressure=Step(nbytes=GiB, at_s=0.0))
    assert dev.seed == 4 and not dev.faults.plan.injects_anything
    dev.advance(0.001)
    assert dev.tenant_nbytes == GiB


def test_custom_profile_and_shared_environment():
    env = simpy.Environment()
    a = gpumem.open_device("sim:custom", profile=custom_profile("card-a", 4 * GiB), env=env)
    b = gpumem.open_device("sim:t4-16gb", env=env, pressure=PeriodicSpikes(nbytes=GiB, period_s=0.01,
                                                                          spike_s=0.005))
    assert a.spec == "sim:card-a" and b.spec == "sim:t4-16gb"
    a.advance(0.001)
    assert b.now_s == pytest.approx(0.001)
    assert b.tenant_nbytes == GiB  # b's tenant ran while a's clock moved
    a.malloc(GiB)
    assert b.process_used_nbytes == 0


def test_canonical_specs():
    assert gpumem.open_device("SIM:T4-16GB").spec == "sim:t4-16gb"
    assert gpumem.open_device("sim:h200").spec == "sim:h200-141gb"
    assert gpumem.open_device("  sim:h100  ").spec == "sim:h100-80gb"
    parsed = parse_spec("sim:h200-141gb?seed=3&pressure=step")
    assert parsed.kind is DeviceKind.SIM and parsed.target == "h200-141gb"
    assert parsed.options == {"seed": "3", "pressure": "step"}
    assert str(parsed) == "sim:h200-141gb?seed=3&pressure=step"
    cuda = parse_spec("cuda:1")
    assert cuda.kind is DeviceKind.CUDA and cuda.index == 1 and str(cuda) == "cuda:1"


@pytest.mark.parametrize("kwargs", [dict(bogus=1), dict(seed="x"), dict(profile=42)])
def test_bad_keyword_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        gpumem.open_device("sim:t4-16gb", **kwargs)


@pytest.mark.parametrize("spec", ["sim:a100-80gb?seed=" + "9" * 5000, "sim:a100-80gb?fail_rate=" + "x" * 5000,
                                  "sim:a100-80gb?" + "k" * 5000 + "=1", "bogus:" + "z" * 5000])
def test_spec_errors_never_echo_a_huge_spec_whole(spec):
    with pytest.raises(InvalidArgumentError) as err:
        gpumem.open_device(spec)
    assert len(str(err.value)) < 700
