"""The decode progress probe's arguments and window arithmetic (the probe itself needs a GPU)."""

import json

import pytest

from hil.probes import decode_progress as dp


def test_window_line_counts_differences_and_keeps_levels():
    before = {"dev": 10, "ev": 4, "steals": 1, "nallocs": 100, "res": 5, "alloc": 3}
    after = {"dev": 25, "ev": 4, "steals": 3, "nallocs": 160, "res": 9, "alloc": 2}
    assert dp.window_line(before, after) == {"dev": 15, "ev": 0, "steals": 2, "nallocs": 60, "res": 9, "alloc": 2}


def test_window_line_from_nothing_counts_from_zero():
    assert dp.window_line({}, {"dev": 7, "res": 1}) == {"dev": 7, "res": 1}


@pytest.mark.parametrize("argv, message", [
    ([], "--allocator"),
    (["--allocator", "cupy"], "invalid choice"),
    (["--allocator", "gpumem", "--attention", "flash"], "invalid choice"),
    (["--allocator", "gpumem", "--new-tokens", "0"], "at least 1"),
    (["--allocator", "gpumem", "--window", "x"], "whole number"),
    (["--allocator", "gpumem", "--prompt", "-3"], "at least 1"),
    (["--allocator", "gpumem", "--batch", "0"], "at least 1"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        dp.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults():
    args = dp._parser().parse_args(["--allocator", "default"])
    assert (args.attention, args.new_tokens, args.prompt, args.window, args.json, args.batch) == (
        "sdpa", 4500, 2048, 250, None, 1)


def test_help_explains(capsys):
    with pytest.raises(SystemExit):
        dp.main(["--help"])
    out = capsys.readouterr().out
    assert "window" in out and "steals" in out


def test_record_needs_gpumem(capsys):
    assert dp.main(["--allocator", "default", "--record", "x.gmt.gz"]) == 2
    assert "--record needs --allocator gpumem" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--record", "x.csv"], "name it .gmt or .gmt.gz"),
    (["--json", "/nonexistent-folder/x.json"], "no folder"),
    (["--record", "same.gmt", "--json", "same.gmt"], "same file"),
])
def test_outputs_checked_before_the_run(extra, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dp.main(["--allocator", "gpumem"] + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_folder_as_json_is_refused(tmp_path, capsys):
    assert dp.main(["--allocator", "gpumem", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_without_torch_one_line(monkeypatch, capsys):
    import builtins
    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert dp.main(["--allocator", "gpumem"]) == 2
    err = capsys.readouterr().err
    assert "needs torch and transformers" in err and err.count("\n") == 1


def test_json_is_rewritten_after_each_window(tmp_path):
    args = dp._parser().parse_args(["--allocator", "default", "--json", str(tmp_path / "p.json"), "--window", "2"])
    lines = []
    counts = iter(range(100))
    clock = dp._WindowClock("t", 2, lambda: {"dev": next(counts), "res": 1}, lines, lambda: dp._write_json(args, lines))
    for _ in range(5):   # the prompt, then 4 tokens: two windows
        clock.put(None)
    import json
    data = json.loads((tmp_path / "p.json").read_text())
    assert [line["token"] for line in data["lines"]] == [2, 4] and data["window"] == 2


def test_positions_past_the_model_refused(capsys):
    assert dp.main(["--allocator", "gpumem", "--prompt", "8000", "--new-tokens", "500"]) == 2
    assert "positions" in capsys.readouterr().err


def test_max_positions_is_the_model_config():
    from hil.probes.workloads import LONG7B_CONFIG
    assert dp.MAX_POSITIONS == LONG7B_CONFIG["max_position_embeddings"]


def test_json_write_leaves_no_temporary(tmp_path):
    args = dp._parser().parse_args(["--allocator", "default", "--json", str(tmp_path / "p.json")])
    dp._write_json(args, [{"token": 1}])
    dp._write_json(args, [{"token": 1}, {"token": 2}])
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_json_names_the_batch(tmp_path):
    """The run's JSON says its batch, as it says its prompt (new user 35: only the file name said it)."""
    args = dp._parser().parse_args(["--allocator", "gpumem", "--batch", "12", "--json", str(tmp_path / "p.json")])
    dp._write_json(args, [])
    got = json.loads((tmp_path / "p.json").read_text())
    assert (got["batch"], got["prompt"]) == (12, args.prompt)
