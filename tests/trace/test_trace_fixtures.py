"""The small traces in tests/trace/data (the first 2000 ops of the real ResNet-50 run) in every format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpumem.trace import (
    Trace,
    detect_format,
    load_trace,
    save_pytorch_snapshot,
    save_trace,
    write_rmm_log,
)

N_OPS = 2000


@pytest.fixture(scope="module")
def snapshot_head(data_dir: Path) -> Trace:
    return load_trace(data_dir / "resnet_head.snapshot.pickle.gz")


@pytest.mark.parametrize("name, fmt", [
    ("resnet_head.snapshot.pickle.gz", "pytorch-snapshot"),
    ("resnet_head.snapshot_export.pickle.gz", "pytorch-snapshot"),
    ("resnet_head.rmm_log.csv.gz", "rmm-log"),
    ("resnet_head.gmt.gz", "gpumem"),
])
def test_formats_are_detected(data_dir: Path, name: str, fmt: str) -> None:
    assert detect_format(data_dir / name) == fmt


def test_snapshot_head(snapshot_head: Trace) -> None:
    s = snapshot_head.summary()
    assert (s.name, s.source, s.n_ops, s.n_allocs, s.n_unmatched_frees) == ("resnet_head", "pytorch-snapshot",
                                                                            N_OPS, 1261, 0)
    assert s.peak_live_nbytes == snapshot_head.live_nbytes().max() > 2 * 2**30


def test_native_fixture_equals_the_snapshot_it_came_from(data_dir: Path, snapshot_head: Trace) -> None:
    assert load_trace(data_dir / "resnet_head.gmt.gz") == snapshot_head


def test_rmm_fixture_has_the_same_ops(data_dir: Path, snapshot_head: Trace) -> None:
    rmm = load_trace(data_dir / "resnet_head.rmm_log.csv.gz")
    assert rmm.source == "rmm-log" and rmm.name == "resnet_head"
    # RMM replayed the same requests through its own allocator: same ops, other addresses and clock
    assert rmm.ops_equal(snapshot_head, times=False, addrs=False)
    assert not np.array_equal(rmm.addrs, snapshot_head.addrs)
    assert (np.diff(rmm.times_us) >= 0).all()


@pytest.mark.parametrize("writer, suffix, exact", [
    (save_trace, ".gmt", True),
    (save_trace, ".gmt.gz", True),
    (save_pytorch_snapshot, ".pickle", False),
    (write_rmm_log, ".csv.gz", False),
])
def test_fixture_round_trips(tmp_path: Path, snapshot_head: Trace, writer, suffix: str, exact: bool) -> None:
    path = tmp_path / f"resnet_head{suffix}"
    writer(snapshot_head, path)
    back = load_trace(path)
    if exact:
        assert back == snapshot_head
    else:
        assert back.ops_equal(snapshot_head, times=suffix == ".pickle")


def test_as_lists_replay_matches_peak(snapshot_head: Trace) -> None:
    sizes: dict[int, int] = {}
    live = peak = 0
    for kind, aid, nbytes, _stream in zip(*snapshot_head.as_lists()):
        if kind == 0:
            sizes[aid] = nbytes
            live += nbytes
            peak = max(peak, live)
        else:
            live -= sizes.pop(aid)
    assert peak == snapshot_head.peak_live_nbytes and len(sizes) == snapshot_head.n_live_at_end
