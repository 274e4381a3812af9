"""MemoryConfig: defaults, presets, the fluent builder, environment overrides, range checks."""

from __future__ import annotations

import dataclasses

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.managers.config import ENV_VARIABLES, MemoryConfig
from gpumem.units import GiB, MiB


def test_defaults():
    c = MemoryConfig()
    assert c.gpu_memory_fraction == 0.9
    assert c.min_free_bytes == 512 * 1000**2
    assert c.cpu_fallback_enabled is False and c.track_allocations is True


def test_presets_differ_sensibly():
    inf, train, small = MemoryConfig.for_inference(), MemoryConfig.for_training(), MemoryConfig.for_constrained()
    assert inf.gpu_memory_fraction > train.gpu_memory_fraction
    assert train.capture_stacks and train.min_free_bytes == GiB
    assert small.cpu_fallback_enabled and small.min_free_bytes < MemoryConfig().min_free_bytes
    assert inf.preallocate_nbytes


def test_fluent_builder_returns_new_configs():
    base = MemoryConfig()
    c = (base.with_gpu_memory_fraction(0.8).with_cpu_fallback(True).with_min_free_bytes("256MiB")
         .with_tracking(True, capture_stacks=True).with_max_pooled_per_bucket(4).with_preallocation(MiB, 2 * MiB)
         .with_pool_policy("bestfit").with_oom_forensics("out").with_leak_report_at_exit()
         .with_fragmentation_warning(0.5))
    assert base == MemoryConfig()                      # unchanged
    assert (c.gpu_memory_fraction, c.cpu_fallback_enabled, c.min_free_bytes) == (0.8, True, 256 * MiB)
    assert c.capture_stacks and c.max_pooled_per_bucket == 4 and c.preallocate_nbytes == (MiB, 2 * MiB)
    assert c.pool_policy == "bestfit" and c.oom_forensics_dir == "out" and c.leak_report_at_exit
    assert c.fragmentation_warning == 0.5
    assert c.with_oom_forensics(None).oom_forensics_dir is None


@pytest.mark.parametrize("field,value,range_text", [
    ("gpu_memory_fraction", 0.0, "(0, 1]"), ("gpu_memory_fraction", 1.01, "(0, 1]"),
    ("gpu_memory_fraction", float("nan"), "(0, 1]"), ("gpu_memory_fraction", True, "(0, 1]"),
    ("gpu_memory_fraction", "0.9", "(0, 1]"),
    ("min_free_bytes", -1, "[0, 2**50]"), ("min_free_bytes", 1.5, "[0, 2**50]"),
    ("max_pooled_per_bucket", -1, "[0, 1048576]"), ("cpu_fallback_enabled", 1, "a bool"),
    ("track_allocations", "yes", "a bool"), ("preallocate_nbytes", (0,), "ints > 0"),
    ("preallocate_nbytes", [MiB], "tuple"), ("pool_policy", "slab", "gpumem, bestfit"),
    ("oom_forensics_dir", "", "non-empty"), ("fragmentation_warning", 1.5, "[0, 1]"),
])
def test_out_of_range_is_rejected_naming_field_and_range(field, value, range_text):
    with pytest.raises(InvalidArgumentError, match=field) as err:
        MemoryConfig(**{field: value})
    assert range_text in str(err.value)
    base = MemoryConfig()
    with pytest.raises(InvalidArgumentError, match=field):
        dataclasses.replace(base, **{field: value})
    assert base == MemoryConfig()


def test_builder_rejects_too():
    with pytest.raises(InvalidArgumentError, match="gpu_memory_fraction"):
        MemoryConfig().with_gpu_memory_fraction(2)
    with pytest.raises(InvalidArgumentError):
        MemoryConfig().with_min_free_bytes("lots")


def test_from_env_reads_every_documented_variable():
    env = {
        "GPUMEM_GPU_MEMORY_FRACTION": "0.75", "GPUMEM_CPU_FALLBACK": "on", "GPUMEM_MIN_FREE_BYTES": "1GiB",
        "GPUMEM_TRACK_ALLOCATIONS": "0", "GPUMEM_CAPTURE_STACKS": "yes", "GPUMEM_MAX_POOLED_PER_BUCKET": "3",
        "GPUMEM_PREALLOCATE": "64MiB, 1GiB", "GPUMEM_POOL_POLICY": "cupy", "GPUMEM_OOM_FORENSICS_DIR": "/tmp/x",
        "GPUMEM_LEAK_REPORT_AT_EXIT": "true", "GPUMEM_FRAGMENTATION_WARNING": "0.4", "UNRELATED": "1",
    }
    assert set(env) - {"UNRELATED"} == set(ENV_VARIABLES)
    c = MemoryConfig.from_env(environ=env)
    assert c == MemoryConfig(gpu_memory_fraction=0.75, cpu_fallback_enabled=True, min_free_bytes=GiB,
                             track_allocations=False, capture_stacks=True, max_pooled_per_bucket=3,
                             preallocate_nbytes=(64 * MiB, GiB), pool_policy="cupy", oom_forensics_dir="/tmp/x",
                             leak_report_at_exit=True, fragmentation_warning=0.4)
    assert MemoryConfig.from_env(environ={}) == MemoryConfig()
    assert MemoryConfig.from_env(MemoryConfig.for_training(), environ={}) == MemoryConfig.for_training()
    assert MemoryConfig.from_env(environ={"GPUMEM_OOM_FORENSICS_DIR": ""}).oom_forensics_dir is None


def test_from_env_uses_os_environ(monkeypatch):
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "0.5")
    assert MemoryConfig.from_env().gpu_memory_fraction == 0.5


@pytest.mark.parametrize("var,value,match", [
    ("GPUMEM_GPU_MEMORY_FRACTION", "abc", "GPUMEM_GPU_MEMORY_FRACTION"),
    ("GPUMEM_GPU_MEMORY_FRACTION", "1.5", "gpu_memory_fraction must be a number in"),
    ("GPUMEM_GPU_MEMORY_FRACTION", "inf", "GPUMEM_GPU_MEMORY_FRACTION"),
    ("GPUMEM_CPU_FALLBACK", "maybe", "GPUMEM_CPU_FALLBACK"),
    ("GPUMEM_MIN_FREE_BYTES", "8G", "GPUMEM_MIN_FREE_BYTES"),
    ("GPUMEM_MAX_POOLED_PER_BUCKET", "2.5", "GPUMEM_MAX_POOLED_PER_BUCKET"),
    ("GPUMEM_POOL_POLICY", "slab", "pool_policy"),
    ("GPUMEM_PREALLOCATE", "64MiB,,1", r"GPUMEM_PREALLOCATE='64MiB,,1': entry 2 of 3 is empty"),
    ("GPUMEM_PREALLOCATE", "64MiB,", "entry 2 of 2 is empty"),
    # int() took these; only ASCII digits are an int here
    ("GPUMEM_MAX_POOLED_PER_BUCKET", "1_0", "ASCII digits"),
    ("GPUMEM_MAX_POOLED_PER_BUCKET", "\u0663", "ASCII digits"),
    # a blank directory was taken as the name of a folder
    ("GPUMEM_OOM_FORENSICS_DIR", "   ", "blank directory"),
    # accepted, then the manager failed with an out-of-memory error for 1 byte
    ("GPUMEM_GPU_MEMORY_FRACTION", "1e-300", "less than 1 MiB"),
])
def test_from_env_rejects_bad_values(var, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        MemoryConfig.from_env(environ={var: value})


def test_from_env_bad_base():
    with pytest.raises(InvalidArgumentError, match="base"):
        MemoryConfig.from_env({"a": 1}, environ={})
