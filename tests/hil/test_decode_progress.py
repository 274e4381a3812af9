"""The decode progress probe's arguments and window arithmetic (the probe itself needs a GPU)."""

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
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        dp.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults():
    args = dp._parser().parse_args(["--allocator", "default"])
    assert (args.attention, args.new_tokens, args.prompt, args.window, args.json) == ("sdpa", 4500, 2048, 250, None)


def test_help_explains(capsys):
    with pytest.raises(SystemExit):
        dp.main(["--help"])
    out = capsys.readouterr().out
    assert "window" in out and "steals" in out


def test_record_needs_gpumem(capsys):
    assert dp.main(["--allocator", "default", "--record", "x.gmt.gz"]) == 2
    assert "--record needs --allocator gpumem" in capsys.readouterr().err
