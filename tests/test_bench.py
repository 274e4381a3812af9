"""benchmarks/replay_bench.py: every trace of a folder, errors for folders without traces, and each peer
allocator in its own process, a failed peer reported as failed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gpumem.trace import Trace, save_trace
from gpumem.units import MiB

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("replay_bench", REPO / "benchmarks" / "replay_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("replay_bench", None)


def tiny(name: str, n: int = 30) -> Trace:
    ops = []
    for i in range(n):
        ops.append((0, i, (i % 5 + 1) * MiB + 512 * i, 0, 2.0 * i, 0x100000 * (i + 1)))
        if i % 3 == 2:
            ops.append((1, i - 1, ((i - 1) % 5 + 1) * MiB + 512 * (i - 1), 0, 2.0 * i + 1, 0x100000 * i))
    return Trace.from_ops(name, "gpumem", ops)


def test_defaults_to_the_shipped_traces(bench):
    assert bench.default_traces_dir() == REPO / "data" / "traces"
    found = [p.name for p in bench.find_trace_files(bench.default_traces_dir())]
    assert found == list(bench.TRACE_FILES)  # every shipped trace, in docs/allocator.md's order


def test_every_trace_file_of_a_folder(bench, tmp_path, capsys):
    save_trace(tiny("alpha"), tmp_path / "alpha.gmt")
    save_trace(tiny("beta"), tmp_path / "my-own-name.gmt.gz")
    (tmp_path / "notes.txt").write_text("not a trace")
    out_json = tmp_path / "rows.json"
    code = bench.main(["--traces", str(tmp_path), "--device", "sim:t4-16gb", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    n = f"{tiny('x').n_ops:,}"
    assert f"| alpha (gpumem) | {n} |" in out and f"| beta (gpumem) | {n} |" in out
    assert "failed" not in out
    rows = json.loads(out_json.read_text())
    overhead = [r for r in rows if r["table"] == "overhead"]
    assert sorted((r["trace"], r["policy"]) for r in overhead) == sorted(
        (t, p) for t in ("alpha", "beta") for p in bench.SIM_POLICIES)
    assert {r["trace"] for r in rows if r["table"] == "speed"} == {"alpha", "beta"}


@pytest.mark.parametrize("setup, words", [
    (lambda d: None, "no trace file"),  # empty
    (lambda d: (d / "README.md").write_text("x"), "found README.md"),  # files, but no trace
    (lambda d: (d / "broken.gmt").write_text("garbage\n"), "cannot read"),  # only unreadable traces
    (lambda d: save_trace(Trace.empty(), d / "empty.gmt"), "no allocation"),
])
def test_folder_without_traces_is_an_error(bench, tmp_path, capsys, setup, words):
    setup(tmp_path)
    assert bench.main(["--traces", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert words in err and "## Overhead" not in out


def test_missing_folder_is_an_error(bench, tmp_path, capsys):
    assert bench.main(["--traces", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_an_unreadable_trace_beside_good_ones_fails_the_run(bench, tmp_path, capsys):
    save_trace(tiny("alpha"), tmp_path / "alpha.gmt")
    (tmp_path / "broken.csv").write_text("Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,zz,nan,0\n")
    code = bench.main(["--traces", str(tmp_path), "--device", "sim:t4-16gb", "--skip-sim"])
    assert code == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_failed_peer_is_reported_not_a_crash(bench, tmp_path, capsys, monkeypatch):
    save_trace(tiny("alpha"), tmp_path / "alpha.gmt")
    monkeypatch.setattr(bench, "SIM_POLICIES", ("gpumem", "no-such-policy"))
    code = bench.main(["--traces", str(tmp_path), "--device", "sim:t4-16gb"])
    out, err = capsys.readouterr()
    assert code == 0, err  # gpumem completed; the peer's failure is a result
    row = next(line for line in out.splitlines() if line.startswith("| alpha"))
    assert row.split(" | ")[3:5] == [row.split(" | ")[3], "failed"] and "%" in row.split(" | ")[3]
    assert "- no-such-policy failed on alpha: InvalidArgumentError: unknown allocator policy" in out


def test_gpumem_failing_is_exit_1(bench, tmp_path, capsys, monkeypatch):
    save_trace(tiny("alpha"), tmp_path / "alpha.gmt")
    monkeypatch.setattr(bench, "SIM_POLICIES", ("gpumem",))
    code = bench.main(["--traces", str(tmp_path), "--device", "sim:t4-16gb", "--peer-timeout", "0.01"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "- gpumem failed on alpha: timed out after 0.01 s" in out


def test_run_peer_survives_a_dying_process(bench, tmp_path):
    path = str(save_trace(tiny("alpha"), tmp_path / "alpha.gmt"))
    res = bench.run_peer({"kind": "no-such-kind", "traces": [path]}, timeout_s=120)
    assert res["results"] == {} and res["unavailable"] is None
    assert res["errors"][path].startswith("the process exited with status 1: ValueError: unknown worker kind")
    res = bench.run_peer({"kind": "cuda", "peer": "no-such-peer-lib", "traces": [path]}, timeout_s=120)
    assert path in res["errors"]


def test_a_missing_gpu_library_is_a_skipped_column(bench, tmp_path):
    import importlib.util

    path = str(save_trace(tiny("alpha"), tmp_path / "alpha.gmt"))
    res = bench.run_peer({"kind": "cuda", "peer": "rmm-pool", "traces": [path], "repeat": 1}, timeout_s=120)
    if importlib.util.find_spec("rmm") is None:
        assert res["unavailable"] and "rmm" in res["unavailable"] and res["errors"] == {} == res["results"]
    else:  # pragma: no cover - a GPU machine with RMM
        assert path in res["results"] or path in res["errors"]


def test_time_ops_frees_everything_and_skips_zero_byte_allocations(bench):
    trace = Trace.from_ops("z", "gpumem", [(0, 0, 0, 0, 0.0, 0x1000), (0, 1, 512, 0, 1.0, 0x2000),
                                           (0, 2, 1024, 0, 2.0, 0x3000), (1, 1, 512, 0, 3.0, 0x2000)])
    live: set[int] = set()
    counter = iter(range(1, 100))

    def alloc(n):
        assert n > 0
        p = next(counter)
        live.add(p)
        return p

    us = bench._time_ops(trace, alloc, live.remove)
    assert us > 0 and live == set()  # the one left live at the end is freed too


def test_help_is_plain_text(bench, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "**" not in out and "``" not in out and ":data:" not in out and "::" not in out
    assert "1. Overhead (peak reserved / peak live - 1)" in out and "(BEST_PEER)" in out
    assert "python benchmarks/replay_bench.py [--traces DIR]" in out
