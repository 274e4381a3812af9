"""The live-vs-predicted table of the workloads probe (issue 18 point 2), on a tiny fake record: no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpumem.errors import TraceFormatError
from hil.probes import workloads as wl
from gpumem.torch import trace_from_words
from gpumem.trace import Trace, load_trace, save_trace
from gpumem.trace.pytorch_export import save_pytorch_snapshot

MiB = 2**20


def _words() -> list[int]:
    """A native trace buffer: three allocations (one freed, one freed before another is made), one free of
    a block allocated before tracing began."""
    ev = [(0, 0x10000, 3 * MiB, 0, 0), (0, 0x400000, 5 * MiB, 0, 1000), (1, 0x10000, 3 * MiB, 0, 2000),
          (1, 0x999000, 7, 0, 2500), (0, 0x10000, 2 * MiB, 7, 3000), (1, 0x400000, 5 * MiB, 0, 4000)]
    return [w for e in ev for w in e]


def test_trace_from_words_pairs_frees_and_skips_the_unknown_one() -> None:
    t = trace_from_words(_words(), name="fake")
    assert (t.n_allocs, t.n_unmatched_frees) == (3, 1)
    assert int(t.live_nbytes().max()) == 8 * MiB


@pytest.mark.parametrize("words, why", [([0, 1, 2, 3], "whole number"), ([5, 1, 2, 3, 4], "is not 0 .alloc."), ([4, 1, 7, 3, 4], "plan event kind 7")])
def test_trace_from_words_refuses_a_bad_buffer(words: list[int], why: str) -> None:
    with pytest.raises(TraceFormatError, match=why):
        trace_from_words(words)


def test_trace_from_words_keeps_stream_uses_and_skips_the_unknown_one() -> None:
    """Kind 2 is a record_stream (recorder.h): kept at its place among the ops; one of an address that
    holds no allocation of the trace (allocated before tracing began) is skipped."""
    a, b = 0x7F0000000000, 0x7F0000200000
    words = [0, a, 4096, 1, 1000, 2, a, 0, 9, 1500, 2, b, 0, 9, 1600, 2, a, 0, 1, 1700, 1, a, 4096, 1, 2000]
    t = trace_from_words(words, name="uses")
    assert t.n_ops == 2
    assert [(u.at_op, u.alloc_id, u.stream, u.time_us) for u in t.stream_uses] == [(1, 0, 9, 1.5), (1, 0, 1, 1.7)]


def test_trace_from_words_keeps_stream_waits() -> None:
    """Kind 3 is a wait_stream (recorder.h, gpumem.torch.trace_wait_stream): the stream in the stream word
    waits for the one in the address word, at its place among the ops (also before the first op and
    after the last)."""
    a = 0x7F0000000000
    words = [3, 5, 0, 9, 500, 0, a, 4096, 1, 1000, 3, 1, 0, 9, 1500, 1, a, 4096, 1, 2000, 3, 9, 0, 1, 2500]
    t = trace_from_words(words, name="waits")
    assert t.n_ops == 2 and t.stream_uses == ()
    assert [(w.at_op, w.stream, w.waited, w.time_us) for w in t.stream_waits] == [(0, 9, 5, 0.5), (1, 9, 1, 1.5),
                                                                                  (2, 1, 9, 2.5)]


def _fake_record(tmp_path: Path) -> dict:
    trace = trace_from_words(_words(), name="fake")
    save_trace(trace, tmp_path / wl.trace_file_name("fake", "gpumem"))
    save_pytorch_snapshot(trace, tmp_path / wl.trace_file_name("fake", "default"))
    base = {"workload": "fake", "mean_step_ms": 1.5, "peak_allocated_bytes": 8 * MiB, "num_allocs": 3, "losses": [0.5]}
    return {"runs": [
        base | {"allocator": "default", "peak_reserved_bytes": 20 * MiB, "trace_file": wl.trace_file_name("fake", "default")},
        base | {"allocator": "gpumem", "policy": None, "peak_reserved_bytes": 10 * MiB,
                "trace_file": wl.trace_file_name("fake", "gpumem"), "stream_uses_recorded": True},
        {"workload": "broken", "allocator": "gpumem", "error": "Traceback ...\nRuntimeError: capture failed"},
    ]}


def test_live_vs_predicted_replays_each_run_with_its_allocators_model(tmp_path: Path) -> None:
    rows = wl.live_vs_predicted(_fake_record(tmp_path), tmp_path)
    assert [(r.workload, r.allocator, r.model) for r in rows] == [
        ("fake", "default", "pytorch"), ("fake", "gpumem", "gpumem"), ("broken", "gpumem", "gpumem")]
    default, gpumem, broken = rows
    assert default.live_overhead == pytest.approx(1.5) and gpumem.live_overhead == pytest.approx(0.25)
    for r in (default, gpumem):   # the replay's own figures, not the live ones
        from gpumem.replay import replay_trace

        res = replay_trace(str(tmp_path / wl.trace_file_name("fake", r.allocator)), "sim:h200-141gb", r.model)
        assert r.predicted_peak_reserved_nbytes == res.peak_reserved_bytes
        assert r.diff_pp == pytest.approx((res.overhead - r.live_overhead) * 100)
    assert broken.predicted_overhead is None and "capture failed" in broken.error
    table = wl.render_table(rows, "sim:h200-141gb")
    assert "| fake | - | gpumem | gpumem |" in table and "live run failed" in table
    assert table.count("met") >= 1
    # two streams: the PyTorch run logged no record_stream (a record from before the log existed), so its
    # row is shown and not scored; gpumem's recorder records them, so its row is scored
    assert default.not_scored and "2 streams" in default.not_scored and gpumem.not_scored is None
    assert "| not scored: the program ran on 2 streams" in table


def test_live_vs_predicted_passes_the_gpu_timing_and_policy_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake_replay(trace: Trace, sim: str, model: str, gpu_timing: str | None) -> object:
        seen.append((trace.source, model, gpu_timing))
        return type("R", (), {"overhead": 0.0, "peak_reserved_bytes": 1})()

    monkeypatch.setattr(wl, "_replay", fake_replay)
    rows = wl.live_vs_predicted(_fake_record(tmp_path), tmp_path, gpu_timing="model", policy="bestfit")
    assert seen == [("pytorch-snapshot", "pytorch", "model"), ("recorded", "bestfit", "model")]
    assert all(r.gpu_timing == "model" for r in rows)


def test_a_missing_trace_costs_its_row(tmp_path: Path) -> None:
    record = _fake_record(tmp_path)
    (tmp_path / wl.trace_file_name("fake", "gpumem")).unlink()
    rows = wl.live_vs_predicted(record, tmp_path)
    assert rows[0].predicted_overhead is not None
    assert rows[1].predicted_overhead is None and rows[1].error.startswith("replay failed")


def test_bad_records_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(wl.WorkloadInputError, match="no 'runs'"):
        wl.live_vs_predicted({"rows": []}, tmp_path)
    with pytest.raises(wl.WorkloadInputError, match="unknown allocator"):
        wl.live_vs_predicted({"runs": [{"workload": "x", "allocator": "expandable"}]}, tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert wl.main(["predict", str(bad)]) == 2
    assert "cannot read the workloads record" in capsys.readouterr().err


def test_predict_cli_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "workloads.json").write_text(json.dumps(_fake_record(tmp_path)))
    assert wl.main(["predict", str(tmp_path / "workloads.json"), "--json", str(tmp_path / "rows.json")]) == 0
    assert "| fake | - | default | pytorch |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())
    rows = rows["workloads.json default"]
    assert len(rows) == 3 and rows[0]["diff_pp"] is not None and np.isfinite(rows[0]["diff_pp"])
    assert load_trace(tmp_path / "fake.gpumem.gmt.gz").n_allocs == 3


def test_parse_policy_replaces_fields_and_refuses_bad_specs() -> None:
    from gpumem.allocator.policy import GrowthRule, get_policy

    assert wl.parse_policy("pytorch") is get_policy("pytorch")
    p = wl.parse_policy("gpumem:growth=pages,page_slack=0,steal_empty_pages=true")
    assert (p.growth, p.page_slack, p.steal_empty_pages, p.name) == (
        GrowthRule.PAGES, 0.0, True, "gpumem:growth=pages,page_slack=0,steal_empty_pages=true")
    for bad, why in [("nope", "unknown allocator policy"), ("gpumem:foo=1", "not field=value"),
                     ("gpumem:page_slack", "not field=value"), ("gpumem:page_slack=x", "convert"),
                     ("gpumem:steal_empty_pages=maybe", "true or false"), ("gpumem:page_slack=2", r"page_slack must be a finite number in \[0.0, 1.0\]"),
                     ("gpumem:growth=sideways", "growth")]:
        with pytest.raises(wl.WorkloadInputError, match=why):
            wl.parse_policy(bad)
    assert get_policy("gpumem").page_slack != 0.0   # the named policy is unchanged


def test_fidelity_cli_adds_the_table_and_refuses_a_bad_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hil import fidelity

    (tmp_path / "workloads.json").write_text(json.dumps(_fake_record(tmp_path)))
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--device", "sim:h200-141gb", "--live-record", str(tmp_path / "workloads.json"),
                          "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["status"] == "skipped"   # no real GPU: the part is skipped, the table still shown
    assert "| fake | - | gpumem | gpumem |" in data["markdown"] and len(data["live_vs_predicted"]["rows"]) == 3
    assert any("broken on gpumem: live run failed" in d for d in data["live_vs_predicted"]["differences"])
    assert fidelity.main(["--device", "sim:h200-141gb", "--live-record", str(tmp_path / "nope.json")]) == 2
    assert "--live-record: cannot read" in capsys.readouterr().err


def test_render_live_compares_each_gpumem_run_with_the_default() -> None:
    base = {"workload": "w", "mean_step_ms": 10.0, "peak_allocated_bytes": 100, "num_allocs": 5, "losses": [1.0, 2.0]}
    record = {"gpu": "G", "torch": "T", "steps": 2, "warmup": 1, "runs": [
        base | {"allocator": "default", "peak_reserved_bytes": 110},
        base | {"allocator": "gpumem", "peak_reserved_bytes": 101, "mean_step_ms": 10.5},
        base | {"workload": "v", "allocator": "gpumem", "peak_reserved_bytes": 101, "losses": [3.0]},
        {"workload": "x", "allocator": "gpumem", "error": "boom\nRuntimeError: capture failed\nsee docs\n\n"}]}
    text = wl.render_live(record)
    assert "| w | default | 0.000 | 0.000 | 10.00 % | 10.00 |  |  | 5 |" in text
    assert "| w | gpumem | 0.000 | 0.000 | 1.00 % | 10.50 | +5.00 % | yes | 5 |" in text
    assert "| v | gpumem |" in text and "| x | gpumem | failed: RuntimeError: capture failed |" in text


def test_a_gpu_timing_this_replay_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    import inspect

    from gpumem.replay import replay_trace

    if "gpu_timing" in inspect.signature(replay_trace).parameters:
        pytest.skip("this gpumem's replay has gpu timing")
    with pytest.raises(wl.WorkloadInputError, match="no gpu_timing option"):
        wl.live_vs_predicted(_fake_record(tmp_path), tmp_path, gpu_timing="trace")


@pytest.mark.parametrize("argv, why", [(["--workloads", "nope"], "unknown workload"),
                                       (["--allocators", "expandable"], "unknown workload or allocator"),
                                       (["--steps", "3", "--warmup", "3"], "0 < --warmup < --steps"),
                                       (["--tag", "a/b"], "letters, digits")])
def test_live_refuses_bad_options_before_running_anything(tmp_path: Path, argv: list[str], why: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        wl.main(["live", "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_live_records_a_failed_child_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        workload, allocator = cmd[4], cmd[5]
        if allocator == "gpumem":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nRuntimeError: no GPU here\n")
        out = Path(cmd[cmd.index("--child-out") + 1])
        out.write_text(json.dumps({"workload": workload, "allocator": allocator, "gpu": "G", "torch": "T",
                                   "mean_step_ms": 1.0, "peak_allocated_bytes": 10, "peak_reserved_bytes": 11,
                                   "trace_nbytes": 5, "losses": [1.0], "num_allocs": 1}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = wl.run_live(["gpt2_train", "moe_train"], ["default", "gpumem"], 3, 1, tmp_path, "gpumem", 5.0, tag="after")
    assert path.name == "workloads-after.json"
    record = json.loads(path.read_text())
    assert [(r["workload"], r["allocator"], "error" in r) for r in record["runs"]] == [
        ("gpt2_train", "default", False), ("gpt2_train", "gpumem", True), ("moe_train", "default", False),
        ("moe_train", "gpumem", True)]
    assert all("--gpumem-policy" in c for c in calls) and record["gpumem_policy"] == "gpumem"
    assert wl.error_line(record["runs"][1]["error"]) == "RuntimeError: no GPU here"


def test_a_pytorch_run_with_a_record_stream_log_is_replayed_with_its_uses(tmp_path: Path) -> None:
    """The probe's PyTorch runs write a record_stream log beside the snapshot (stream_use_file): predict
    merges it, so a block used on a busy stream is held as in PyTorch, and the row is scored."""
    from gpumem.trace import Trace
    from gpumem.trace.stream_log import LoggedUse, RecordStreamLog, write_record_stream_log

    main, side, a, b = 0, 0x5A5A00, 0x7F0000000000, 0x7F0010000000
    ops = [(0, 0, 64 * MiB, main, 0.0, a), (0, 1, 4 * MiB, side, 10.0, b), (0, 2, 4 * MiB, side, 1010.0, b + 4 * MiB),
           (0, 3, 4 * MiB, side, 2010.0, b + 8 * MiB), (1, 0, 64 * MiB, main, 2020.0, a), (0, 4, 64 * MiB, main, 2030.0, a)]
    save_pytorch_snapshot(Trace.from_ops("busy", "pytorch-snapshot", ops), tmp_path / wl.trace_file_name("busy", "default"))
    write_record_stream_log(RecordStreamLog((LoggedUse(0, a, side, 5.0, 1, 0),), {0: (0, 0)}),
                            tmp_path / wl.stream_log_file_name("busy"))
    run = {"workload": "busy", "allocator": "default", "mean_step_ms": 1.0, "peak_allocated_bytes": 76 * MiB,
           "peak_reserved_bytes": 160 * MiB, "num_allocs": 5, "losses": [0.0],
           "trace_file": wl.trace_file_name("busy", "default"), "stream_uses_recorded": True}
    with_log, without = wl.live_vs_predicted({"runs": [run | {"stream_use_file": wl.stream_log_file_name("busy")},
                                                       run]}, tmp_path, gpu_timing="trace")
    assert with_log.stream_uses.startswith("1 record_stream use(s) merged (1 placed by the allocator's counts")
    assert with_log.not_scored is None and with_log.error is None
    assert with_log.predicted_peak_reserved_nbytes >= without.predicted_peak_reserved_nbytes + 64 * MiB
    table = wl.render_table([with_log], "sim:h200-141gb")
    assert "- busy, default: 1 record_stream use(s) merged" in table
    # a log that names a pointer the snapshot holds at other times, not at the call, costs the row, in one line
    # (one never held is skipped, as PyTorch ignores it)
    write_record_stream_log(RecordStreamLog((LoggedUse(0, a, side, 2025.0, 4, 1),), {0: (0, 0)}),
                            tmp_path / "bad.jsonl")
    (bad,) = wl.live_vs_predicted({"runs": [run | {"stream_use_file": "bad.jsonl"}]}, tmp_path)
    assert bad.predicted_overhead is None and "record_stream of 0x7f0000000000 on stream 5921280 (after op 4)" in bad.error


def test_a_pytorch_run_s_logged_waits_are_merged_and_delay_reuse(tmp_path: Path) -> None:
    """A log's wait_stream calls merge as the trace's waits: the side stream's 1 us of work after a wait
    on main's 40 ms holds a block used there until main's work has run (Note [Cross-stream waits])."""
    from gpumem.trace import Trace
    from gpumem.trace.stream_log import LoggedUse, LoggedWait, RecordStreamLog, write_record_stream_log

    main, side, a = 0, 0x5A5A00, 0x7F0000000000
    ops = [(0, 0, 64 * MiB, main, 0.0, a)]
    t_us = 10.0
    for k in range(1, 41):   # 40 ms of work on main, in 1 ms gaps
        ops.append((0, k, MiB, main, t_us, a + (k + 40) * 2 * MiB))
        t_us += 1000.0
    ops.append((0, 41, MiB, side, t_us, a + 200 * MiB))
    ops += [(1, 0, 64 * MiB, main, t_us + 1.0, a), (0, 42, 64 * MiB, main, t_us + 2.0, a)]
    save_pytorch_snapshot(Trace.from_ops("chain", "pytorch-snapshot", ops), tmp_path / wl.trace_file_name("chain", "default"))
    use = LoggedUse(0, a, side, t_us - 500.0, 41, 0)   # after op 40 by its counts and by its time
    write_record_stream_log(RecordStreamLog((use,), {0: (0, 0)}, waits=(LoggedWait(0, side, main, t_us - 500.0, 41, 0),)),
                            tmp_path / "waits.jsonl")
    write_record_stream_log(RecordStreamLog((use,), {0: (0, 0)}), tmp_path / "uses.jsonl")
    run = {"workload": "chain", "allocator": "default", "mean_step_ms": 1.0, "peak_allocated_bytes": 105 * MiB,
           "peak_reserved_bytes": 170 * MiB, "num_allocs": 43, "losses": [0.0],
           "trace_file": wl.trace_file_name("chain", "default"), "stream_uses_recorded": True}
    waits, uses = wl.live_vs_predicted({"runs": [run | {"stream_use_file": "waits.jsonl"},
                                                 run | {"stream_use_file": "uses.jsonl"}]}, tmp_path, gpu_timing="trace")
    assert waits.stream_uses.endswith("1 wait_stream call(s) merged (1 placed by the counts, 0 by time)")
    assert waits.predicted_peak_reserved_nbytes >= uses.predicted_peak_reserved_nbytes + 64 * MiB


def test_trace_wait_streams_tells_each_wait_after_making_it() -> None:
    from types import SimpleNamespace

    made, told = [], []

    class Stream:
        def __init__(self, handle: int) -> None:
            self.cuda_stream = handle

        def wait_stream(self, other: "Stream") -> None:
            if other is None:
                raise RuntimeError("not a stream")
            made.append((self.cuda_stream, other.cuda_stream))

    torch = SimpleNamespace(cuda=SimpleNamespace(Stream=Stream))
    original = Stream.wait_stream
    undo = wl.trace_wait_streams(torch, lambda s, o: told.append((s.cuda_stream, o.cuda_stream, list(made))))
    s, o = Stream(1), Stream(2)
    s.wait_stream(o)
    with pytest.raises(RuntimeError):
        s.wait_stream(None)   # type: ignore[arg-type]
    assert made == [(1, 2)] and told == [(1, 2, [(1, 2)])]   # told after the wait was made; a failed one not
    undo()
    assert Stream.wait_stream is original


def test_plan_steps_reaches_the_gpumem_children_only_through_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--gpumem-plan-steps``: every child gets the flag (it marks steps only under gpumem), the record says so."""
    import subprocess

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: no GPU here\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = wl.run_live(["gpt2_train"], ["default", "gpumem"], 3, 1, tmp_path, None, 5.0, plan_steps=True)
    assert all("--gpumem-plan-steps" in c for c in calls) and json.loads(path.read_text())["gpumem_plan_steps"]
    calls.clear()
    wl.run_live(["gpt2_train"], ["gpumem"], 3, 1, tmp_path, None, 5.0, tag="off")
    assert calls and not any("--gpumem-plan-steps" in c for c in calls)


def test_step_marks_reach_the_gpumem_children_and_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--gpumem-step-marks optimizer``: every child gets it (it configures marks only under gpumem), the record
    and its live table say so; with ``--gpumem-plan-steps`` as well the command line is refused."""
    import subprocess

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: no GPU here\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = wl.run_live(["gpt2_train"], ["default", "gpumem"], 3, 1, tmp_path, None, 5.0, step_marks="optimizer")
    assert calls and all(c[-2:] == ["--gpumem-step-marks", "optimizer"] for c in calls)
    record = json.loads(path.read_text())
    assert record["gpumem_step_marks"] == "optimizer (configure)" and not record["gpumem_plan_steps"]
    assert "steps marked automatically (step_marks='optimizer (configure)')" in wl.render_live(record)
    default = json.loads(wl.run_live(["gpt2_train"], ["gpumem"], 3, 1, tmp_path, None, 5.0, tag="d").read_text())
    assert default["gpumem_step_marks"] == "optimizer (default)"
    calls.clear()
    wl.run_live(["gpt2_train"], ["gpumem"], 3, 1, tmp_path, None, 5.0, tag="off")
    assert calls and not any("--gpumem-step-marks" in c for c in calls)
    with pytest.raises(SystemExit):
        wl.main(["live", "--out", str(tmp_path), "--gpumem-plan-steps", "--gpumem-step-marks", "optimizer"])
    with pytest.raises(SystemExit):
        wl.main(["live", "--out", str(tmp_path), "--gpumem-step-marks", "adam"])


def _fake_child(calls: list) -> object:
    """A stand-in for the child process: records the command, writes a run whose step time is 100 ms under
    PyTorch's allocator and 101 ms under gpumem."""
    import subprocess

    def fake_run(cmd, **kw):
        calls.append(cmd)
        workload, allocator = cmd[4], cmd[5]
        out = Path(cmd[cmd.index("--child-out") + 1])
        out.write_text(json.dumps({"workload": workload, "allocator": allocator, "gpu": "G", "torch": "T",
                                   "mean_step_ms": 101.0 if allocator == "gpumem" else 100.0,
                                   "peak_allocated_bytes": 10, "peak_reserved_bytes": 11, "trace_file": None,
                                   "trace_nbytes": 0, "losses": [1.0], "num_allocs": 1}))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return fake_run


def test_rounds_alternate_the_order_and_record_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Step time in rounds]: each workload's rounds run back to back, the allocators' order reversed in
    every second round, every child told to record nothing; each run says its round."""
    import subprocess

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_child(calls))
    path = wl.run_live(["gpt2_train", "moe_train"], ["default", "gpumem"], 3, 1, tmp_path, None, 5.0, rounds=3,
                       record_trace=False)
    record = json.loads(path.read_text())
    assert [(c[4], c[5]) for c in calls] == [
        ("gpt2_train", "default"), ("gpt2_train", "gpumem"), ("gpt2_train", "gpumem"), ("gpt2_train", "default"),
        ("gpt2_train", "default"), ("gpt2_train", "gpumem"),
        ("moe_train", "default"), ("moe_train", "gpumem"), ("moe_train", "gpumem"), ("moe_train", "default"),
        ("moe_train", "default"), ("moe_train", "gpumem")]
    assert all("--no-record" in c for c in calls)
    assert [r["round"] for r in record["runs"]] == [1, 1, 2, 2, 3, 3] * 2
    assert record["rounds"] == 3 and record["recorded"] is False
    rows = wl.step_times(record)
    assert [r.workload for r in rows] == ["gpt2_train", "moe_train"]
    assert rows[0].ratios == pytest.approx((0.01, 0.01, 0.01)) and rows[0].median == pytest.approx(0.01)
    assert "+1.00 … +1.00 %" in wl.render_step_times(record)
    # each gpumem run is compared with PyTorch's run of its own round
    assert wl.render_live(record).count("+1.00 %") == 6


def test_several_rounds_that_would_record_are_refused_before_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    import subprocess

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_child(calls))
    with pytest.raises(wl.WorkloadInputError, match="record no trace"):
        wl.run_live(["gpt2_train"], ["default", "gpumem"], 3, 1, tmp_path / "a", None, 5.0, rounds=2)
    with pytest.raises(wl.WorkloadInputError, match="a whole number from 1"):
        wl.run_live(["gpt2_train"], ["default", "gpumem"], 3, 1, tmp_path / "a", None, 5.0, rounds=0,
                    record_trace=False)
    for argv, why in ((["--rounds", "2"], "needs --no-record"), (["--rounds", "0", "--no-record"], "1 to 1000")):
        with pytest.raises(SystemExit) as exc:
            wl.main(["live", "--out", str(tmp_path / "b"), *argv])
        assert exc.value.code == 2 and why in capsys.readouterr().err
    assert not calls and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_step_times_pair_runs_by_round_and_leave_out_failed_rounds() -> None:
    def run(alloc: str, rnd: int | None, ms: float | None) -> dict:
        r: dict = {"workload": "w", "allocator": alloc}
        if rnd is not None:
            r["round"] = rnd
        if ms is None:
            r["error"] = "RuntimeError: x"
        else:
            r["mean_step_ms"] = ms
        return r

    record = {"steps": 40, "warmup": 10, "runs": [
        run("default", 1, 100.0), run("gpumem", 1, 102.0), run("gpumem", 2, 99.0), run("default", 2, None),
        run("default", 3, 100.0), run("gpumem", 3, 100.0), run("default", 4, 100.0), run("gpumem", 4, 101.0)]}
    (row,) = wl.step_times(record)
    assert row.ratios == pytest.approx((0.02, 0.0, 0.01)) and row.failed_rounds == 1
    assert row.median == pytest.approx(0.01) and row.mean == pytest.approx(0.01)
    # Student's t, 2 degrees of freedom: 0.01 +- 2.920 * 0.01 / sqrt(3)
    assert row.interval() == pytest.approx((0.01 - 0.0168586, 0.01 + 0.0168586), abs=1e-6)
    assert "| w | 3 | 1 |" in wl.render_step_times(record)
    # a record of one round (or from before rounds existed) pairs its runs as round 1, with no interval
    one = {"runs": [run("default", None, 100.0), run("gpumem", None, 103.0)]}
    assert wl.step_times(one)[0].ratios == pytest.approx((0.03,))
    assert "fewer than 3 rounds" in wl.render_step_times(one)
    assert wl.step_times({"runs": [run("gpumem", 1, 1.0)]}) == []


def test_steptime_cli_prints_and_refuses_what_is_not_a_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = tmp_path / "r.json"
    good.write_text(json.dumps({"steps": 4, "warmup": 1, "runs": [
        {"workload": "w", "allocator": "default", "mean_step_ms": 10.0},
        {"workload": "w", "allocator": "gpumem", "mean_step_ms": 10.1}]}))
    md = tmp_path / "t.md"
    assert wl.main(["steptime", str(good), "--markdown", str(md)]) == 0
    assert "+1.00 %" in capsys.readouterr().out and "+1.00 %" in md.read_text()
    for text in ("[1, 2]", "{", '{"runs": 3}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert wl.main(["steptime", str(bad)]) == 2
        assert "error:" in capsys.readouterr().err


def test_a_run_that_recorded_no_trace_is_shown_not_predicted(tmp_path: Path) -> None:
    record = {"runs": [{"workload": "gpt2_train", "allocator": "gpumem", "mean_step_ms": 1.0, "trace_file": None,
                        "peak_allocated_bytes": 100, "peak_reserved_bytes": 101, "losses": [1.0], "num_allocs": 1}]}
    (row,) = wl.live_vs_predicted(record, tmp_path)
    assert row.predicted_overhead is None and "recorded none" in row.error
    assert "recorded none" in wl.render_table([row], "sim:h200-141gb")


def test_steptime_pools_the_rounds_of_several_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    paths = []
    for i, ms in enumerate((101.0, 99.0)):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"steps": 4, "warmup": 1, "recorded": False, "runs": [
            {"workload": "w", "allocator": a, "round": rnd, "mean_step_ms": ms * (1 + rnd / 1e6) if a == "gpumem"
             else 100.0 * (1 + rnd / 1e6 + i / 1e7)} for rnd in (1, 2) for a in ("default", "gpumem")]}))
        paths.append(str(path))
    pooled = wl.pool_rounds([json.loads(Path(p).read_text()) for p in paths])
    assert pooled["rounds"] == 4 and [r["round"] for r in pooled["runs"]] == [1, 1, 2, 2, 3, 3, 4, 4]
    (row,) = wl.step_times(pooled)
    assert row.ratios == pytest.approx((0.01, 0.01, -0.01, -0.01), abs=1e-5) and row.mean == pytest.approx(0.0, abs=1e-5)
    assert wl.main(["steptime", *paths, "--pool"]) == 0
    out = capsys.readouterr().out
    assert "2 records pooled" in out and "| w | 4 |" in out and "not recorded" in out


def test_pooling_refuses_records_measured_otherwise_and_an_empty_table_says_so(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture) -> None:
    """New user 13: --pool mixed a recorded one-pair record into unrecorded rounds under the first one's
    header; a record with no complete round printed an empty table and exited 0."""
    runs = [{"workload": "w", "allocator": a, "mean_step_ms": 10.0} for a in ("default", "gpumem")]
    base = {"steps": 40, "warmup": 10, "recorded": False, "runs": runs}
    for key, value in (("recorded", True), ("steps", 12), ("warmup", 4), ("gpumem_policy", "gpumem:page_slack=0")):
        other = dict(base, runs=[dict(r, mean_step_ms=11.0) for r in runs])   # other runs: only the setting differs
        other.pop("recorded") if key == "recorded" else other.update({key: value})   # a record from before: recorded
        with pytest.raises(wl.WorkloadInputError, match=repr(key)):
            wl.pool_rounds([base, other])
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        a.write_text(json.dumps(base))
        b.write_text(json.dumps(other))
        assert wl.main(["steptime", str(a), str(b), "--pool"]) == 2
        assert "are not pooled" in capsys.readouterr().err
    lonely = tmp_path / "l.json"
    lonely.write_text(json.dumps({"runs": [runs[1], {"workload": "w", "allocator": "default", "error": "x"}]}))
    assert wl.main(["steptime", str(lonely)]) == 1
    assert "no workload has a gpumem and a PyTorch run" in capsys.readouterr().err


def test_predict_refuses_a_record_made_without_traces(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"recorded": False, "rounds": 2, "runs": [
        {"workload": "gpt2_train", "allocator": "gpumem", "mean_step_ms": 1.0, "trace_file": None, "round": 1,
         "peak_allocated_bytes": 100, "peak_reserved_bytes": 101, "losses": [1.0], "num_allocs": 1}]}))
    assert wl.main(["predict", str(path)]) == 2
    assert "nothing to predict" in capsys.readouterr().err
    assert "gpt2_train, round 1" in wl.render_live(json.loads(path.read_text()))


def test_t_quantiles_are_conservative_between_tabled_degrees() -> None:
    assert wl.t_quantile_95(1) == 6.314 and wl.t_quantile_95(15) == 1.753
    assert wl.t_quantile_95(35) == wl.t_quantile_95(30) and wl.t_quantile_95(10_000) == 1.658
    with pytest.raises(wl.WorkloadInputError):
        wl.t_quantile_95(0)


@pytest.mark.parametrize("run, why", [
    (7, "not an object"), ({"allocator": "gpumem", "mean_step_ms": 1.0}, "not an object"),
    ({"workload": ["w"], "allocator": "gpumem", "mean_step_ms": 1.0}, "not an object"),
    ({"workload": "w", "allocator": "gpumem"}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": None}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": "100"}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": True}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 0.0}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": -100.0}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": float("nan")}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": float("inf")}, "is not a number in"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "round": 0}, "not a whole number"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "round": 1.5}, "not a whole number"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "round": "1"}, "not a whole number"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "round": False}, "not a whole number"),
    ({"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "round": [1]}, "not a whole number"),
    ({"workload": "w", "allocator": "default", "mean_step_ms": 1.0}, "two runs"),
])
def test_steptime_refuses_bad_runs_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, run: object,
                                               why: str) -> None:
    """Attacker 16: bad runs gave tracebacks (KeyError, ZeroDivisionError...) or numbers shown as right
    (-201 % from a negative step, NaN means); colliding rounds kept the later run."""
    record = {"runs": [{"workload": "w", "allocator": "default", "mean_step_ms": 1.0}, run]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    assert wl.main(["steptime", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and why in err and len(err.strip().splitlines()) == 1
    with pytest.raises(wl.WorkloadInputError, match=why):
        wl.step_times(json.loads(path.read_text()))


def test_steptime_refuses_a_record_pooled_twice_and_a_markdown_target_it_cannot_use(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Attacker 16: the same record given twice to --pool counted its rounds twice and narrowed the interval;
    --markdown into a folder, a missing folder, or over a record read."""
    runs = [{"workload": "w", "allocator": a, "round": r, "mean_step_ms": 10.0 + (a == "gpumem") * r / 10}
            for r in (1, 2, 3) for a in ("default", "gpumem")]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"recorded": False, "runs": runs}))
    copy = tmp_path / "copy.json"
    copy.write_text(path.read_text())
    for argv, why in (([str(path), str(path), "--pool"], "given twice"), ([str(path), str(copy), "--pool"], "count twice"),
                      ([str(path), "--markdown", str(tmp_path)], "is a folder"),
                      ([str(path), "--markdown", str(tmp_path / "no" / "t.md")], "does not exist"),
                      ([str(path), "--markdown", str(path)], "would be overwritten")):
        assert wl.main(["steptime", *argv]) == 2
        assert why in capsys.readouterr().err
    assert json.loads(path.read_text())["runs"] == runs


def test_live_refuses_names_given_twice_and_rounds_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Attacker 16: a workload named twice ran twice and its rounds replaced each other; --rounds had no bound."""
    for argv, why in ((["--workloads", "gpt2_train,gpt2_train"], "named twice"),
                      (["--allocators", "default,gpumem,gpumem"], "named twice"),
                      (["--rounds", str(wl.MAX_ROUNDS + 1), "--no-record"], f"1 to {wl.MAX_ROUNDS}")):
        with pytest.raises(SystemExit) as exc:
            wl.main(["live", "--out", str(tmp_path / "o"), *argv])
        assert exc.value.code == 2 and why in capsys.readouterr().err
    for rounds in (1.5, 2.0, True, 0):
        with pytest.raises(wl.WorkloadInputError, match="whole number"):
            wl.run_live(["gpt2_train"], ["default", "gpumem"], 3, 1, tmp_path / "o", None, 5.0, rounds=rounds,
                        record_trace=False)
    assert not (tmp_path / "o").exists()


def test_the_long_decodes_run_only_when_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `live` runs every workload but the long decodes (minutes each: they would time out at the default
    --timeout; llama_long_decode did, under both allocators, on the H200 on 2026-11-30); named, they run."""
    import subprocess

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_child(calls))
    wl.main(["live", "--out", str(tmp_path / "a"), "--allocators", "gpumem"])
    ran = {c[4] for c in calls}
    assert ran == set(wl.WORKLOADS) - set(wl.NAMED_ONLY) - set(wl.GPUMEM_REFUSES)
    assert set(wl.NAMED_ONLY) <= set(wl.WORKLOADS) and "llama_long_decode" not in ran
    calls.clear()
    wl.main(["live", "--out", str(tmp_path / "b"), "--allocators", "gpumem", "--workloads", "llama7b_long_decode_sdpa"])
    assert [c[4] for c in calls] == ["llama7b_long_decode_sdpa"]


def test_re_attack_17_hostile_numbers_shared_runs_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Attacker 17: step times whose ratio overflows or an integer of 400 digits gave tracebacks; an edited copy
    of a record pooled its runs twice; --markdown through a hard link overwrote the record; predict wrote its
    outputs over its input; a live table crashed on a run without peaks."""
    import os

    def record(default_ms: object, gpumem_ms: object) -> dict:
        return {"recorded": False, "runs": [{"workload": "w", "allocator": "default", "round": r, "mean_step_ms": default_ms}
                                            for r in (1, 2, 3)] +
                [{"workload": "w", "allocator": "gpumem", "round": r, "mean_step_ms": gpumem_ms} for r in (1, 2, 3)]}
    for d, g in ((1e-10, 1e308), (1.0, 1e308), (1, 10**400), (1e-9, 80_000_000.0)):
        path = tmp_path / "r.json"
        path.write_text(json.dumps(record(d, g)))
        assert wl.main(["steptime", str(path)]) == 2, (d, g)
        assert capsys.readouterr().err.startswith("error:")
    good = tmp_path / "good.json"
    good.write_text(json.dumps(record(10.0, 10.1)))
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(dict(record(10.0, 10.1), note="x")))
    assert wl.main(["steptime", str(good), str(edited), "--pool"]) == 2
    assert "count twice" in capsys.readouterr().err
    os.link(good, tmp_path / "hard.json")
    before = good.read_text()
    assert wl.main(["steptime", str(good), "--markdown", str(tmp_path / "hard.json")]) == 2
    assert "overwritten" in capsys.readouterr().err and good.read_text() == before
    rec = tmp_path / "live.json"
    rec.write_text(json.dumps({"runs": [{"workload": "w", "allocator": "gpumem", "mean_step_ms": 1.0, "losses": [],
                                         "num_allocs": 1, "trace_file": "t.gmt.gz"}]}))
    for argv in (["--markdown", str(rec)], ["--json", str(rec)], []):
        assert wl.main(["predict", str(rec), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and ("overwritten" in err or "peak_allocated_bytes" in err)
    assert json.loads(rec.read_text())["runs"][0]["workload"] == "w"
    pipe = {"runs": [{"workload": "a|b\nc", "allocator": a, "mean_step_ms": 10.0 + (a == "gpumem")}
                     for a in ("default", "gpumem")]}
    table = wl.render_step_times(pipe)
    assert "| a\\|b c |" in table and len(table.strip().splitlines()) == 5   # heading, blank line, head, rule, row


def test_a_run_whose_history_ring_was_full_is_shown_not_predicted(tmp_path: Path) -> None:
    """Note [A full history ring]: a PyTorch snapshot that lost its oldest entries replays from mid-run; its row
    says so instead of giving a prediction (the trace is not even read)."""
    record = {"runs": [{"workload": "llama7b_long_decode", "allocator": "default", "mean_step_ms": 1.0,
                        "trace_file": "missing.pickle.gz", "history_entries": wl.HISTORY_MAX_ENTRIES,
                        "history_truncated": True, "peak_allocated_bytes": 100, "peak_reserved_bytes": 121,
                        "losses": [1.0], "num_allocs": 7_000_000}]}
    (row,) = wl.live_vs_predicted(record, tmp_path)
    assert row.predicted_overhead is None and "dropped the oldest" in row.error
    assert "dropped the oldest" in wl.render_table([row], "sim:h200-141gb")


def test_a_gpumem_trace_with_live_reserves_is_compared_with_them(tmp_path: Path) -> None:
    """A gpumem run whose trace has the live engine's reserve: its row says where the replay first held otherwise
    (or that it never did), from the same replay as the row's prediction."""
    from gpumem.replay_compare import ReserveCapture
    from gpumem.allocator import make_allocator
    from gpumem.replay import replay
    from gpumem.specs import open_device

    record = _fake_record(tmp_path)
    path = tmp_path / wl.trace_file_name("fake", "gpumem")
    trace = load_trace(path, progress=False)
    dev = open_device("sim:h200-141gb")
    a = make_allocator(dev, "gpumem")
    cap = ReserveCapture(trace, a)
    replay(trace, a, progress=False)
    cap.restore()
    a.close()
    dev.close()
    reserves = np.full(trace.n_ops, -1, np.int64)
    reserves[cap.ops] = cap.reserves
    import dataclasses

    save_trace(dataclasses.replace(trace, live_reserved_nbytes=reserves), path)
    rows = wl.live_vs_predicted(record, tmp_path)
    assert rows[1].live_comparison and "held what live held after every one" in rows[1].live_comparison
    assert rows[0].live_comparison is None   # PyTorch's run: no live reserve
    reserves[cap.ops[-1]] += 2 * MiB
    save_trace(dataclasses.replace(trace, live_reserved_nbytes=reserves), path)
    rows = wl.live_vs_predicted(record, tmp_path)
    assert f"first difference: op {int(cap.ops[-1])}" in rows[1].live_comparison
    assert "--compare-live" in wl.render_table(rows, "sim:h200-141gb")


def test_a_workload_gpumem_refuses_is_not_run_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """cudagraph_train captures a CUDA graph, which gpumem.torch refuses by design: a plain `live` failed on it
    every time (exit status 1). It runs under PyTorch's allocator only, says why, and the run succeeds; the
    advice for the named-only workloads is options `live` takes (new user 39: --steps 3 with the default
    --warmup 4 was refused)."""
    import subprocess

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_child(calls))
    assert wl.main(["live", "--out", str(tmp_path), "--workloads", "cudagraph_train,moe_train"]) == 0
    assert [(c[4], c[5]) for c in calls] == [("cudagraph_train", "default"), ("moe_train", "default"),
                                             ("moe_train", "gpumem")]
    assert "cudagraph_train      gpumem   not run: it captures a CUDA graph" in capsys.readouterr().out
    record = json.loads((tmp_path / "workloads.json").read_text())
    assert [(r["workload"], r["allocator"]) for r in record["runs"]] == [(c[4], c[5]) for c in calls]
    for workload, options in wl.NAMED_ONLY.items():
        calls.clear()
        assert wl.main(["live", "--out", str(tmp_path / workload), "--allocators", "default", "--workloads",
                        workload, *options.split()]) == 0
        assert [c[4] for c in calls] == [workload]


def test_a_live_run_that_runs_nothing_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    """Re-check 39: `live --allocators gpumem --workloads cudagraph_train` refused every run, wrote no record, and
    read a missing file (a traceback) or an earlier run's record (its exit status). Now it is refused at once, with
    the reason, and a record is written before the first run."""
    import subprocess

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_child(calls))
    stale = tmp_path / "workloads.json"
    stale.write_text(json.dumps({"runs": [{"workload": "x", "allocator": "gpumem", "error": "old"}]}))
    with pytest.raises(SystemExit):
        wl.main(["live", "--out", str(tmp_path), "--allocators", "gpumem", "--workloads", "cudagraph_train"])
    assert "is not run under gpumem" in capsys.readouterr().err and calls == []
    path = wl.run_live(["cudagraph_train"], ["gpumem"], 3, 1, tmp_path, None, 5.0)
    assert json.loads(path.read_text())["runs"] == [] and calls == []   # the stale record replaced


def test_timed_driver_gives_the_timed_steps_calls_and_milliseconds_per_step() -> None:
    """Note [Time in driver calls]: the probe's record gives the engine's driver calls over the timed steps only
    (the counters when they began taken from those at the end), per step, the nanoseconds as milliseconds."""
    before = {"num_device_calls": 100, "num_event_calls": 40, "gpumem.n_steals": 3, "gpumem.n_waits": 0,
              "gpumem.driver_memory_ns": 5_000_000, "gpumem.driver_event_ns": 1_000_000, "gpumem.driver_wait_ns": 0,
              "gpumem.engine_slow_calls": 1000, "gpumem.engine_slow_ns": 10_000_000}
    after = {"num_device_calls": 140, "num_event_calls": 80, "gpumem.n_steals": 7, "gpumem.n_waits": 2,
             "gpumem.driver_memory_ns": 7_000_000, "gpumem.driver_event_ns": 1_400_000, "gpumem.driver_wait_ns": 600_000,
             "gpumem.engine_slow_calls": 1200, "gpumem.engine_slow_ns": 14_000_000}
    got = wl.timed_driver(before, after, 4)
    assert got == {"memory_calls": 10.0, "event_calls": 10.0, "steals": 1.0, "waits": 0.5, "memory_ms": 0.5,
                   "event_ms": 0.1, "wait_ms": 0.15, "slow_calls": 50.0, "slow_ms": 1.0}
    # no counters when the timed steps began (PyTorch's allocator, or no timed step): nothing to give
    assert wl.timed_driver({}, after, 4) == {} and wl.timed_driver(before, after, 0) == {}
