"""FreeList.discard (Note [The hot path, read once] in gpumem/allocator/python_engine.py): ``in`` and ``remove`` in
one look-up, for both orders of equal sizes; and the engine's hot path takes the same arguments as before."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.allocator.backing import Segment
from gpumem.allocator.block import Block, FreeList, TopDownFreeList
from gpumem.errors import InternalError, InvalidArgumentError


def _blocks(top_down: bool) -> list[Block]:
    """Twelve blocks of three segments (the later ones ordered below the earlier ones when ``top_down``), sizes
    repeating so that equal sizes are ordered by place."""
    out = []
    for k in range(3):
        seg = Segment(0x10_0000 * (k + 1), 0x1_0000, False, 0)
        if top_down:
            seg.order = 0x1000_0000 - 0x10_0000 * (k + 1)  # below the ones made before, as new_segment orders them
        for j in range(4):
            out.append(Block(seg.base + j * 0x1000, 512 * (1 + (j + k) % 3), 0, seg))
    return out


def _key(fl: FreeList, b: Block) -> tuple[int, int]:
    return TopDownFreeList._key(b) if isinstance(fl, TopDownFreeList) else (b.size, b.addr)


@settings(max_examples=200, deadline=None)
@given(top_down=st.booleans(), ops=st.lists(st.tuples(st.sampled_from(["add", "discard", "remove"]),
                                                        st.integers(0, 11)), max_size=60))
def test_discard_is_in_then_remove(top_down, ops):
    blocks = _blocks(top_down)
    fl: FreeList = TopDownFreeList() if top_down else FreeList()
    model: set[int] = set()
    for op, k in ops:
        b = blocks[k]
        if op == "add":
            if k in model:
                continue  # a block is added once
            fl.add(b)
            model.add(k)
        elif op == "discard":
            assert fl.discard(b) is (k in model)
            model.discard(k)
        elif k in model:
            fl.remove(b)
            model.discard(k)
        else:
            with pytest.raises(InternalError):
                fl.remove(b)
        assert sorted(_key(fl, blocks[i]) for i in model) == fl._keys
        assert len(fl) == len(model) and fl.nbytes == sum(blocks[i].size for i in model)
        assert all((b2 in fl) is (i in model) for i, b2 in enumerate(blocks))
    for size in (1, 512, 513, 1024, 1025, 1536, 1537):
        fits = [i for i in model if blocks[i].size >= size]
        best = min(fits, key=lambda i: _key(fl, blocks[i])) if fits else None
        assert fl.best_fit(size) is (blocks[best] if best is not None else None)


def test_discard_of_a_block_whose_size_changed_in_the_list_raises():
    b = _blocks(False)[0]
    fl = FreeList()
    fl.add(b)
    b.size += 512
    with pytest.raises(InternalError):
        fl.discard(b)


@pytest.mark.parametrize("policy", ["pytorch", "expandable"])
def test_the_hot_path_takes_and_refuses_what_the_checks_did(policy):
    dev = open_device("sim:h200-141gb")
    a = CachingAllocator(dev, policy, engine="python")
    try:
        p = a.allocate(np.int64(1000), np.uint64(0))  # any integer type, as before
        assert a.block_size(p) == 1024
        a.free(np.int64(p))
        for bad in (0, -1, True, 1.5, "8"):
            with pytest.raises(InvalidArgumentError):
                a.allocate(bad)
        for bad in (-1, 1 << 64, True):
            with pytest.raises(InvalidArgumentError):
                a.allocate(512, bad)
        with pytest.raises(InvalidArgumentError):
            a.free(1.0)
        assert a.snapshot_stats().allocated_nbytes == 0
        a.check_consistency()
    finally:
        a.close()
        dev.close()
