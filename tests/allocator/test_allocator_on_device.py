"""The caching allocator on whatever device ``--gpumem-device`` names (simulated by default,
``cuda:0`` on a GPU runner): every live block keeps its own pattern through churn."""

from __future__ import annotations

import random

import pytest

from gpumem.allocator import CachingAllocator
from gpumem.units import KiB, MiB


def _pattern(tag: int, nbytes: int) -> bytes:
    head = tag.to_bytes(8, "little") * 8
    return (head * (nbytes // len(head) + 1))[:nbytes]


@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
def test_patterns_survive_churn(device, policy):
    rng = random.Random(1234)
    sizes = [rng.choice([1, 100, 512, 3000, 64 * KiB, 700 * KiB, 1 * MiB + 1, 3 * MiB, 9 * MiB]) for _ in range(600)]
    with CachingAllocator(device, policy) as alloc:
        live: dict[int, tuple[int, int]] = {}
        tag = 0

        def new(n: int) -> None:
            nonlocal tag
            tag += 1
            p = alloc.allocate(n)
            assert p not in live
            device.write(p, _pattern(tag, n))
            live[p] = (tag, n)

        for n in sizes[:200]:
            new(n)
        for round_ in range(4):
            victims = rng.sample(sorted(live), len(live) // 2)
            for p in victims:
                del live[p]
                alloc.free(p)
            if round_ == 2:
                alloc.empty_cache()
            for n in rng.sample(sizes, 100):
                new(n)
            for p, (t, n) in live.items():
                assert device.read(p, n) == _pattern(t, n), f"block {p:#x} lost its data ({policy}, round {round_})"
        blocks = sorted(alloc.live_blocks())
        for (a, na), (b, _) in zip(blocks, blocks[1:]):
            assert a + na <= b, "live blocks overlap"
        for p in list(live):
            alloc.free(p)
        alloc.empty_cache()
        assert alloc.reserved_nbytes == 0
