"""find_max_batch and peak reserved by replay, on small simulated profiles."""

import dataclasses
import json
import re

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, estimate_peak_reserved, find_max_batch, inference_trace
from gpumem.estimate.fit import _replay
from gpumem.specs import open_device

TINY = ModelShape(512, 1376, 4, 8000, 8, 8)
DEVICE = "sim:gtx-1050-2gb"


def test_reserved_is_at_least_allocated_under_each_policy():
    w = inference_trace(TINY, 2, batch_size=4, prompt_len=64, new_tokens=4)
    res = estimate_peak_reserved(w, ("pytorch", "expandable", "gpumem"), device=DEVICE)
    assert [r.policy for r in res] == ["pytorch", "expandable", "gpumem"]
    for r in res:
        assert r.fits and r.peak_reserved_bytes >= w.trace.peak_live_nbytes


def test_a_workload_too_large_does_not_fit():
    w = inference_trace(TINY, 2, batch_size=256, prompt_len=2048, new_tokens=2)
    (r,) = estimate_peak_reserved(w, ("pytorch",), device=DEVICE)
    assert not r.fits and "out of memory" in r.oom_message.lower()


@pytest.mark.parametrize("policy", ["pytorch", "gpumem"])
def test_answer_fits_with_margin_and_one_more_does_not(policy):
    r = find_max_batch(TINY, 2, device=DEVICE, prompt_len=256, new_tokens=2, policy=policy, max_value=512)
    assert r.simulated >= 1
    limit = r.limit_bytes
    weights = TINY.n_params * 2
    assert limit == int(weights + (r.usable_bytes - weights) / (1 + r.margin))
    dev = open_device(DEVICE)
    try:
        def fits(b):
            return _replay(inference_trace(TINY, 2, batch_size=b, prompt_len=256, new_tokens=2), dev, policy,
                           limit).fits
        assert fits(r.simulated)
        assert not fits(r.simulated + 1)
    finally:
        dev.close()
    # the margin makes the answer no larger than a search without it, which an estimate of allocated bytes
    # alone (no allocator) never undercuts; a halving retry settles at a power of two at most that
    assert r.simulated <= r.binary_search <= r.estimate
    assert r.halving <= r.binary_search and r.halving & (r.halving - 1) == 0


def test_sequence_length_search():
    r = find_max_batch(TINY, 2, device=DEVICE, search="seq_len", batch_size=8, new_tokens=2, max_value=8192)
    assert 1 <= r.simulated <= r.binary_search


def test_nothing_fits_gives_zero():
    huge = ModelShape(8192, 28672, 8, 128000, 64, 8)  # ~7 GiB of weights on a 2 GB card
    r = find_max_batch(huge, 2, device=DEVICE, prompt_len=16, new_tokens=1, max_value=8)
    assert r.simulated == 0 and r.estimate == 0 and r.binary_search == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(search="tokens"), "search"),
    (dict(margin=11.0), "margin"),
    (dict(margin=-0.1), "margin"),
    (dict(margin=float("nan")), "margin"),
    (dict(max_value=0), "max_value"),
    (dict(policy="nope"), "unknown allocator policy"),
])
def test_bad_input_is_refused(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        find_max_batch(TINY, 2, device=DEVICE, prompt_len=16, **kwargs)


def test_no_policy_is_refused():
    with pytest.raises(InvalidArgumentError, match="at least one policy"):
        estimate_peak_reserved(inference_trace(TINY, 2, prompt_len=8), ())


def test_training_fit_and_weights_larger_than_the_device():
    r = find_max_batch(TINY, 2, device=DEVICE, prompt_len=128, training=True, max_value=64)
    assert 1 <= r.simulated <= r.binary_search
    assert all(t.value >= 1 for t in r.tries)


def test_bad_input_leaves_an_open_device_untouched():
    dev = open_device(DEVICE)
    try:
        before = dev.mem_info()
        with pytest.raises(InvalidArgumentError, match="margin"):
            find_max_batch(TINY, 2, device=dev, prompt_len=16, margin=-1.0)
        assert dev.mem_info() == before
        r = find_max_batch(TINY, 2, device=dev, prompt_len=16, new_tokens=1, max_value=4)
        assert r.simulated == 4 and dev.mem_info() == before  # replays give back what they took
    finally:
        dev.close()


def test_progress_bar_names_its_unit_apart_from_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # the bar has no total: tqdm writes "{n}{unit}", which read "fit batch: 2replay [00:00, 3.18replay/s]"
    import io

    from gpumem.estimate import fit as fit_module
    from gpumem.progress import progress as real_progress

    out = io.StringIO()

    def bar(total, desc, unit, *, enabled=None):
        return real_progress(total, desc, unit, enabled=True, stream=out, delay_s=0.0)

    monkeypatch.setattr(fit_module, "progress_bar", bar)
    find_max_batch(TINY, 2, device=DEVICE, prompt_len=16, new_tokens=1, max_value=8, progress=True)
    text = out.getvalue()
    assert "fit batch" in text and " replay" in text
    assert not re.search(r"\dreplay", text), text


WINDOWED = dataclasses.replace(TINY, sliding_window=8)


@pytest.mark.parametrize("new_tokens", [8, 16])
def test_seq_len_search_refuses_new_tokens_that_fill_the_window(new_tokens):
    # once: max_value became 8 - new_tokens (0 or -8), the halving answer -8, and a prompt of 8 was replayed
    with pytest.raises(InvalidArgumentError, match=f"{new_tokens} new tokens >= the sliding window of 8"):
        find_max_batch(WINDOWED, 2, device=DEVICE, search="seq_len", new_tokens=new_tokens)


def test_seq_len_search_says_when_the_window_bounds_it():
    r = find_max_batch(WINDOWED, 2, device=DEVICE, search="seq_len", new_tokens=3, max_value=100)
    assert r.simulated == r.binary_search == 5
    assert r.bound.startswith("prompt lengths searched up to 5, not 100") and "sliding window of 8" in r.bound
    assert max(t.value for t in r.tries) <= 5  # nothing replayed above the bound
    assert find_max_batch(WINDOWED, 2, device=DEVICE, search="seq_len", new_tokens=3, max_value=4).bound == ""
    assert find_max_batch(WINDOWED, 2, device=DEVICE, new_tokens=3, max_value=4).bound == ""


def test_cli_fit_seq_len_names_the_window(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mistral", "hidden_size": 512, "intermediate_size": 1376,
                               "num_hidden_layers": 4, "vocab_size": 8000, "num_attention_heads": 8,
                               "num_key_value_heads": 8, "sliding_window": 8, "torch_dtype": "bfloat16"}))
    argv = ["fit", "--hf-config", str(cfg), "--device", DEVICE, "--search", "seq_len"]
    assert main([*argv, "--new-tokens", "3"]) == 0
    assert "warning: prompt lengths searched up to 5, not 4096" in capsys.readouterr().out
    assert main([*argv, "--new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] == 5 and any("sliding window of 8" in w for w in out["warnings"])
    assert main([*argv, "--new-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "16 new tokens >= the sliding window of 8" in err and len(err.strip().splitlines()) == 1
