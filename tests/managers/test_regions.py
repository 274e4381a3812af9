"""Regions: nesting, errors, threads and asyncio tasks, attribution in the tracker."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.managers.regions import current_region, region, region_ancestors
from gpumem.managers.tracker import AllocationTracker


def test_nesting_and_exit_on_error():
    assert current_region() is None
    with region("step") as path:
        assert path == "step"
        with region("forward") as inner:
            assert inner == current_region() == "step/forward"
        with pytest.raises(RuntimeError):
            with region("backward"):
                raise RuntimeError
        assert current_region() == "step"
    assert current_region() is None


@pytest.mark.parametrize("bad", ["", "  ", "a/b", None, 3])
def test_bad_names(bad):
    with pytest.raises(InvalidArgumentError):
        with region(bad):
            pass
    assert current_region() is None


def test_ancestors():
    assert region_ancestors("a/b/c") == ["a", "a/b", "a/b/c"]
    assert region_ancestors(None) == []


def test_threads_do_not_see_each_others_regions():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with region(name):
            barrier.wait()
            seen[name] = current_region()

    with region("main"):
        ts = [threading.Thread(target=worker, args=(n,)) for n in ("t1", "t2")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert current_region() == "main"
    assert seen == {"t1": "t1", "t2": "t2"}


def test_asyncio_tasks_are_isolated():
    tracker = AllocationTracker()

    async def task(name, n):
        with region(name):
            await asyncio.sleep(0)
            ids = [tracker.register(n) for _ in range(3)]
            await asyncio.sleep(0)
            assert current_region() == f"serve/{name}"
            return ids

    async def main():
        with region("serve"):
            return await asyncio.gather(task("a", 10), task("b", 100))

    asyncio.run(main())
    assert tracker.region_stats("serve/a").live_nbytes == 30
    assert tracker.region_stats("serve/b").live_nbytes == 300
    assert tracker.region_stats("serve").live_nbytes == 330
    assert current_region() is None
