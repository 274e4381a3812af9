"""Built-in and custom device profiles."""

from __future__ import annotations

import pytest

import gpumem
from gpumem import sim
from gpumem import DeviceNotFoundError, GiB, InvalidArgumentError, MiB
from gpumem.sim import BUILTIN_PROFILES, DeviceProfile, SimDevice, custom_profile, get_profile, profile_names

H200_TOTAL = 150_109_880_320
H200_FREE_AFTER_CONTEXT = 149_557_477_376


def test_there_are_enough_profiles_covering_the_range():
    assert len(BUILTIN_PROFILES) >= 13
    totals = [p.total_nbytes for p in BUILTIN_PROFILES]
    assert min(totals) <= 2 * GiB
    assert max(totals) >= 80 * 10**9
    assert "h200-141gb" in profile_names()
    assert len(set(profile_names())) == len(BUILTIN_PROFILES)
    assert any(p.unified_memory and not p.vmm_supported for p in BUILTIN_PROFILES)


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_opens_and_reports_its_total(name):
    profile = get_profile(name)
    with gpumem.open_device(f"sim:{name}") as dev:
        props = dev.properties()
        assert props.total_nbytes == profile.total_nbytes
        assert props.name == profile.display_name
        assert dev.spec == f"sim:{name}" == profile.spec
        info = dev.mem_info()
        assert info.total_nbytes == profile.total_nbytes
        assert info.free_nbytes == profile.total_nbytes - profile.context_nbytes - profile.host_reserved_nbytes
        assert 0 < info.free_nbytes < info.total_nbytes
        assert props.granularity_nbytes == 2 * MiB
        assert props.vmm_supported == profile.vmm_supported
        assert props.unified_memory == profile.unified_memory


def test_h200_matches_the_measured_card():
    with gpumem.open_device("sim:h200-141gb") as dev:
        props = dev.properties()
        assert props.name == "NVIDIA H200"
        assert props.total_nbytes == H200_TOTAL
        assert props.compute_capability == (9, 0)
        assert props.multiprocessor_count == 132
        assert props.vmm_supported and not props.unified_memory
        assert dev.mem_info().free_nbytes == H200_FREE_AFTER_CONTEXT


def test_profile_lookup():
    assert get_profile("h200").name == "h200-141gb"
    assert get_profile("  H100-80GB ").name == "h100-80gb"
    assert get_profile("t4").name == "t4-16gb"
    for ambiguous in ("a100", "rtx", "jetson-nano"):
        with pytest.raises(DeviceNotFoundError):
            get_profile(ambiguous)
    with pytest.raises(DeviceNotFoundError) as info:
        get_profile("no-such-card")
    assert "h200-141gb" in str(info.value)  # the message lists the known profiles
    with pytest.raises(InvalidArgumentError):
        get_profile(7)


def test_custom_profile():
    p = custom_profile("my-card-8gb", 8 * GiB, compute_capability=(8, 6), context_nbytes=100 * MiB)
    assert p.total_nbytes == 8 * GiB and p.compute_capability == (8, 6)
    assert p.display_name == "my-card-8gb"
    base = get_profile("a100-80gb")
    assert p.multiprocessor_count == base.multiprocessor_count
    with gpumem.open_device("sim:custom", profile=p) as dev:
        assert dev.spec == "sim:my-card-8gb"
        assert dev.mem_info().free_nbytes == 8 * GiB - 100 * MiB
        assert dev.properties().compute_capability == (8, 6)
    q = custom_profile("edge-1gb", 1 * GiB, base="jetson-nano-2gb", context_nbytes=0, host_reserved_nbytes=0,
                       display_name="Edge Board")
    assert q.unified_memory and not q.vmm_supported and q.display_name == "Edge Board"
    assert SimDevice(q).mem_info().free_nbytes == 1 * GiB
    r = custom_profile("fine-grained", 64 * MiB, base=q, granularity_nbytes=64 * 1024)
    dev = SimDevice(r)
    before = dev.mem_info().free_nbytes
    dev.malloc(2 * MiB + 1)
    assert before - dev.mem_info().free_nbytes == 2 * MiB + 64 * 1024


@pytest.mark.parametrize("kwargs", [
    dict(name="My Card", total_nbytes=GiB),
    dict(name="UPPER", total_nbytes=GiB),
    dict(name="", total_nbytes=GiB),
    dict(name="x", total_nbytes=0),
    dict(name="x", total_nbytes=-GiB),
    dict(name="x", total_nbytes=1.5 * GiB),
    dict(name="x", total_nbytes=True),
    dict(name="x", total_nbytes=GiB, context_nbytes=GiB),
    dict(name="x", total_nbytes=GiB, context_nbytes=-1),
    dict(name="x", total_nbytes=GiB, context_nbytes=1.5),
    dict(name="x", total_nbytes=GiB, context_nbytes=GiB // 2, host_reserved_nbytes=GiB // 2),
    dict(name="x", total_nbytes=GiB, host_reserved_nbytes=-5),
    dict(name="x", total_nbytes=GiB, granularity_nbytes=3 * MiB),
    dict(name="x", total_nbytes=GiB, granularity_nbytes=0),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items() if k != "name" or v != "x"))
def test_device_profile_validation(kwargs):
    full = dict(display_name="X", context_nbytes=0, compute_capability=(8, 0), multiprocessor_count=1,
                memory_bandwidth_gbps=1.0)
    full.update(kwargs)
    with pytest.raises(InvalidArgumentError):
        DeviceProfile(**full)


def test_custom_profile_errors():
    with pytest.raises(InvalidArgumentError):
        custom_profile("Bad Name", GiB)
    with pytest.raises(InvalidArgumentError):
        custom_profile("tiny", 100 * MiB)  # the a100's 420 MiB context does not fit
    with pytest.raises(InvalidArgumentError):
        custom_profile("x-1gb", GiB, no_such_field=1)
    with pytest.raises(DeviceNotFoundError):
        custom_profile("x-1gb", GiB, base="no-such-base")
    with pytest.raises(InvalidArgumentError):
        gpumem.open_device("sim:custom", profile="a100-80gb")


def test_profiles_are_values():
    p = get_profile("t4-16gb")
    assert p == get_profile("t4-16gb")
    with pytest.raises(AttributeError):
        p.total_nbytes = 1  # frozen
    assert sim.get_profile("t4-16gb").properties() == SimDevice(p).properties()


def test_unknown_profile_points_at_custom_profile():
    """The advice names the function that exists (review of issue 6: it named sim.DeviceProfile)."""
    with pytest.raises(DeviceNotFoundError, match=r"gpumem\.sim\.custom_profile\(") as err:
        get_profile("no-such-card")
    assert "no-such-card" in str(err.value)
