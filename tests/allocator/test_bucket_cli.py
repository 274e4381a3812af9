"""``gpumem replay --policy bucket``: the size-bucket pool on the command line."""

from __future__ import annotations

import json

import pytest

from gpumem.cli import EXIT_OK, EXIT_OOM, EXIT_USAGE, main
from gpumem.trace import Trace, save_trace
from gpumem.units import GiB, KiB, MiB


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def trace_file(tmp_path):
    sizes = [1, 700, 4 * KiB, 300 * KiB, 1 * MiB + 1, 3 * MiB, 24 * MiB]
    ops, t = [], 0.0
    for i in range(40):
        ops.append((0, i, sizes[i % len(sizes)], 0, t, 0x1000 * (i + 1)))
        t += 1
        if i % 2:
            ops.append((1, i - 1, sizes[(i - 1) % len(sizes)], 0, t, 0x1000 * i))
            t += 1
    return save_trace(Trace.from_ops("tiny", "gpumem", ops), tmp_path / "tiny.gmt")


def test_replay_bucket_json(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--policy", "bucket", "--device", "sim:t4-16gb", "--json",
                         "--summary")
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert data["policy"] == "bucket" and data["engine"] == "python" and data["ooms"] == 0
    assert data["completed_ops"] == data["n_ops"] == 60
    assert data["peak_reserved_bytes"] >= data["peak_live_bytes"] == data["trace_peak_live_bytes"]
    assert data["cache_hits"] + data["cache_misses"] == data["n_allocs"] == 40
    assert "policy 'bucket'" in data["summary"] and "hit rate" in data["summary"]


def test_replay_bucket_text_and_limit_oom(capsys, trace_file):
    code, out, _ = run(capsys, "replay", str(trace_file), "--policy", "bucket")
    assert code == EXIT_OK and "policy         bucket" in out
    code, out, err = run(capsys, "replay", str(trace_file), "--policy", "bucket", "--limit", "16MiB")
    assert code == EXIT_OOM and "out of memory" in err and "replayed" in out


def test_replay_bucket_refuses_export_and_leaves_no_file(capsys, trace_file, tmp_path):
    target = tmp_path / "out.pickle"
    code, _, err = run(capsys, "replay", str(trace_file), "--policy", "bucket", "--export-snapshot", str(target))
    assert code == EXIT_USAGE and "does not record" in err
    assert not target.exists()


def test_policy_choices_list_bucket(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out, _ = capsys.readouterr()
    text = " ".join(out.split())
    assert "bucket: size-" in text and "power-of-two buckets" in text
    with pytest.raises(SystemExit) as info:
        main(["replay", "x.gmt", "--policy", "buckets"])
    assert info.value.code == EXIT_USAGE
