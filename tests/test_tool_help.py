"""The benchmarks' and probes' ``--help`` says their whole first sentence (new user 10)."""

import importlib
import sys

import pytest

#: Tools whose docstring's first sentence runs over more than one line: ``--help`` once cut it mid-sentence
#: ("... the full replay against").
TOOLS = ["benchmarks.native_run_ops", "benchmarks.expandable_engine_speed", "benchmarks.estimate_speed",
         "benchmarks.decode_state_period", "benchmarks.segment_engine_bench", "hil.probes.rmm_resource",
         "benchmarks.estimate_null_device"]


@pytest.mark.parametrize("name", TOOLS)
def test_help_gives_the_first_sentence_whole(name, monkeypatch, capsys):
    mod = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    first = " ".join(mod.__doc__.split("\n\n")[0].split()).rstrip(":.")
    assert first + "." in out
