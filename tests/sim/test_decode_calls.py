"""sim.decode_calls: windows of decode steps counted, calls and memory read per policy, bad arguments refused;
the live probe's long-decode workload is the simulated model's shape."""

from __future__ import annotations

import pytest

from gpumem.estimate.shape import ModelShape
from hil.probes import workloads as wl
from sim import decode_calls as dc

TINY = ModelShape(64, 128, 2, 100, 4, 4)


def test_windows_cover_every_decode_step_once() -> None:
    run = dc.decode_run(TINY, "pytorch", prompt=16, new_tokens=30, window=10)
    assert [(w.first, w.last) for w in run.windows] == [(1, 10), (11, 20), (21, 29)]
    assert run.oom_step == -1
    assert run.peak_reserved_nbytes >= run.peak_allocated_nbytes > 0
    assert all(w.max_reserved_nbytes <= run.peak_reserved_nbytes for w in run.windows)


def test_gpumem_calls_counted_per_window() -> None:
    """The calls of the windows are the decode's calls: at most the allocator's whole count."""
    run = dc.decode_run(TINY, "gpumem", prompt=16, new_tokens=30, window=7)
    assert sum(w.steps for w in run.windows) == 29
    assert all(w.device_calls >= 0 and w.event_calls >= 0 and w.cost_us >= 0 for w in run.windows)
    text = dc.table([run])
    assert "| 1-7 |" in text and "peak held / peak allocated" in text


def test_the_decode_slack_only_where_asked() -> None:
    """The estimate's ops have no slack since it runs the GPU's lag (Note [The GPU's lag in the decode replay]):
    False by default for every policy; True adds it (--decode-slack)."""
    def peak(policy: str, slack: bool) -> int:
        return dc.decode_run(TINY, policy, prompt=16, new_tokens=30, window=7,
                             decode_slack=slack).peak_allocated_nbytes

    with_slack, without = peak("gpumem", True), peak("gpumem", False)
    assert with_slack > without
    assert dc.decode_run(TINY, "gpumem", prompt=16, new_tokens=30, window=7).peak_allocated_nbytes == without
    assert peak("pytorch", False) == without and peak("pytorch", True) == with_slack


def test_decode_slack_on_the_command_line(capsys) -> None:
    for flag, said in (("--no-decode-slack", "no decode slack"), ("--decode-slack", "with the decode slack")):
        assert dc.main(["--model", "small", "--prompt", "8", "--new-tokens", "3", "--policies", "gpumem", flag]) == 0
        assert said in capsys.readouterr().out
        for other in (["--ring", "2"], ["--corpus", "check"]):
            with pytest.raises(SystemExit):
                dc.main([flag, *other])
            assert "are for the model's decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.main(["--decode-slack", "--no-decode-slack"])
    assert "not allowed with" in capsys.readouterr().err


def test_a_policy_with_options_is_read() -> None:
    run = dc.decode_run(TINY, "gpumem:page_slack=0.01", prompt=8, new_tokens=4, window=100)
    assert run.policy == "gpumem:page_slack=0.01" and len(run.windows) == 1


@pytest.mark.parametrize("argv", [["--prompt", "0"], ["--new-tokens", "1"], ["--window", "0"],
                                  ["--model", "70b"], ["--corpus", "both"]])
def test_bad_arguments_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        dc.main(argv)


def test_the_small_model_is_the_live_long_decode_shape() -> None:
    cfg, s = wl.LONG_DECODE_CONFIG, dc.MODELS["small"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        s.hidden_size, s.intermediate_size, s.n_layers, s.vocab_size, s.n_heads, s.n_kv_heads)
    assert "llama_long_decode" in wl.WORKLOADS
    assert wl.LONG_DECODE_PROMPT + wl.LONG_DECODE_NEW_TOKENS <= cfg["max_position_embeddings"]


def test_the_ring_counts_every_step() -> None:
    run = dc.ring_run("gpumem", blocks=4, steps=25, prompt=64, token_nbytes=4096, weights_nbytes=64 << 20, window=10)
    assert [(w.first, w.last) for w in run.windows] == [(1, 10), (11, 20), (21, 25)]
    assert run.peak_allocated_nbytes >= (64 << 20) + 4 * (64 + 25) * 4096
    assert run.peak_reserved_nbytes >= run.peak_allocated_nbytes


def test_a_json_target_that_cannot_be_written_is_refused_before_the_runs(tmp_path, monkeypatch, capsys) -> None:
    def no_run(*args: object, **kw: object) -> None:
        raise AssertionError("the study ran")

    monkeypatch.setattr(dc, "decode_run", no_run)
    monkeypatch.setattr(dc, "corpus_rows", no_run)
    for extra in ([], ["--corpus", "tuning"]):
        for target, match in ((tmp_path, "is a folder"), (tmp_path / "no" / "r.json", "no folder")):
            with pytest.raises(SystemExit) as exc:
                dc.main([*extra, "--json", str(target)])
            assert exc.value.code == 2 and match in capsys.readouterr().err


def test_an_unknown_policy_is_refused_before_the_runs(monkeypatch, capsys) -> None:
    """Review attacker 8: a WorkloadInputError traceback after the first policy's run."""
    def no_run(*args: object, **kw: object) -> None:
        raise AssertionError("the study ran")

    monkeypatch.setattr(dc, "decode_run", no_run)
    monkeypatch.setattr(dc, "ring_run", no_run)
    for extra in ([], ["--ring", "2"]):
        with pytest.raises(SystemExit) as exc:
            dc.main([*extra, "--new-tokens", "3", "--policies", "gpumem,nonexistent"])
        assert exc.value.code == 2 and "--policies: policy 'nonexistent'" in capsys.readouterr().err


def test_weights_larger_than_the_device_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        dc.main(["--ring", "2", "--weights-mib", "100000000", "--new-tokens", "3", "--policies", "gpumem"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "OutOfMemoryError: out of memory on sim:h200-141gb" in err
