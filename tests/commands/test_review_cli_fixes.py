"""Findings of the seventh new-user review and the eighth adversarial review on the ``gpumem`` commands'
arguments: a mistyped option names its subcommand, an option that swallowed the trace says so, a sweep checks
its trace paths before any case runs, the size-bucket pool is taken wherever a replay is, and small sizes are
printed in a unit that fits."""

from __future__ import annotations

import json
import os

import pytest

from gpumem.cli import main

GMT = ('{"format": "gpumem-trace", "version": 1, "name": "tiny", "source": "gpumem", "n_ops": 2, "n_allocs": 1, '
       '"n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}\na 0 1048576 0 1 10000\nf 0 0 2\n')
SHAPE = ["--hidden-size", "256", "--intermediate-size", "688", "--layers", "2", "--vocab-size", "1000",
         "--heads", "4"]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.gmt"
    path.write_text(GMT)
    return str(path)


@pytest.mark.parametrize("command,argv", [
    ("replay", ["T", "--foo"]),
    ("estimate", [*SHAPE, "--prompt-len", "8", "--bogus"]),
    ("fit", [*SHAPE, "--lora-rankk", "16"]),
    ("report", ["T", "--out", "D", "--nope", "1"]),
])
def test_an_unknown_option_gets_the_subcommands_usage(tiny, capsys, command, argv):
    argv = [tiny if a == "T" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main([command, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: gpumem {command} " in err
    assert f"gpumem {command}: error: unrecognized arguments:" in err
    assert "COMMAND ..." not in err  # not the top-level usage


@pytest.mark.parametrize("argv,name,options", [
    (["report", "--device", "sim:t4-16gb", "T", "--out", "D"], "TRACE", "--device, --policy, --fit-device"),
    (["sweep", "--device", "sim:t4-16gb", "T", "--policy", "gpumem", "--out", "D"], "TRACE", "--device"),
])
def test_a_trace_swallowed_by_a_many_valued_option_is_explained(tiny, tmp_path, capsys, argv, name, options):
    argv = [tiny if a == "T" else str(tmp_path / "out") if a == "D" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required" in err
    assert f"give {name} before them" in err and options in err
    assert not (tmp_path / "out").exists()


def test_replay_without_a_trace_has_no_hint(capsys):
    with pytest.raises(SystemExit):
        main(["replay"])
    err = capsys.readouterr().err
    assert "required: trace" in err and "before them" not in err  # replay has no option of several values


def test_sweep_refuses_a_missing_trace_before_any_case(tiny, tmp_path, capsys, monkeypatch):
    import gpumem.report.sweep as sweep

    def no_case(*a, **k):  # pragma: no cover - the point is that it is never called
        raise AssertionError("a case ran")

    monkeypatch.setattr(sweep, "run_sweep", no_case)
    out = tmp_path / "sw"
    code = main(["sweep", tiny, str(tmp_path / "nosuch.gmt"), "--device", "sim:t4-16gb", "--policy", "gpumem",
                 "--out", str(out), "--jobs", "1", "--no-plots"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no such trace file" in err and "nosuch.gmt" in err and "nothing was run" in err
    assert not out.exists()
    os.symlink(tmp_path / "gone.gmt", tmp_path / "dangling.gmt")
    assert main(["sweep", str(tmp_path / "dangling.gmt"), "--device", "sim:t4-16gb", "--policy", "gpumem",
                 "--out", str(out), "--jobs", "1", "--no-plots"]) == 2
    assert "no such trace file" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path), "--device", "sim:t4-16gb", "--policy", "gpumem",
                 "--out", str(out), "--jobs", "1", "--no-plots"]) == 2  # a folder, not a trace
    capsys.readouterr()


def test_sweep_takes_the_bucket_pool_as_replay_and_fit_do(tiny, tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", tiny, "--device", "sim:t4-16gb", "--policy", "gpumem", "bucket", "--out", str(out),
                 "--jobs", "1", "--no-plots", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["policy"], r["status"]) for r in rows] == [("gpumem", "ok"), ("bucket", "ok")]
    assert main(["replay", tiny, "--policy", "bucket", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert rows[1]["peak_reserved_bytes"] == replayed["peak_reserved_bytes"]


def test_estimate_takes_the_bucket_pool(capsys):
    assert main(["estimate", *SHAPE, "--prompt-len", "16", "--new-tokens", "2", "--policy", "bucket,gpumem",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert set(row["peak_reserved_by_policy"]) == {"bucket", "gpumem"} and row["reserved_policy"] == "bucket"


def test_report_summary_of_a_tiny_trace_is_in_a_unit_that_fits(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r"
    assert main(["report", tiny, "--device", "sim:t4-16gb", "--policy", "gpumem", "--no-fit", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "1.00 MiB" in text and "0.00 GiB" not in text
    html = (out / "index.html").read_text()
    assert "1.00 MiB" in html and "peak live (GiB)" not in html
