"""Mixed precision on fp32 master weights (Note [Mixed precision] in gpumem.estimate.workload)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError
from gpumem.estimate import from_hf_config, training_trace
from gpumem.estimate.fit import find_max_batch
from gpumem.estimate.formulas import estimate_training_memory
from gpumem.estimate.shape import ModelShape
from gpumem.estimate.workload import Category, LoraConfig

ROOT = Path(__file__).resolve().parents[2]
RUN2 = ROOT / "reports" / "hil" / "estimate-accuracy-h200-2026-11-25-run2.json"
SMALL = ModelShape(256, 688, 2, 1000, 4, 2)
SHAPE = ["--hidden-size", "512", "--intermediate-size", "1376", "--layers", "4", "--vocab-size", "8000",
         "--heads", "8"]


def _measured_rows() -> list[dict]:
    return [r for r in json.loads(RUN2.read_text())["rows"] if r.get("extra", {}).get("fp32_master")]


def test_the_three_h200_rows_are_at_or_above_the_measurement_and_within_3_percent():
    rows = _measured_rows()
    assert len(rows) == 3
    for r in rows:
        shape, _ = from_hf_config(r["config"])
        w = training_trace(shape, 4, batch_size=r["batch_size"], seq_len=r["prompt_len"],
                           gradient_checkpointing=r["extra"]["gradient_checkpointing"], mixed_precision="bf16")
        # Note [Allocated as PyTorch counts it] (gpumem.estimate.fit): the pytorch replay's peak of blocks is the
        # figure gpumem estimate reports; the trace's sum of requests is up to 1.6 % below (fp32 master b2)
        from gpumem.estimate.fit import estimate_peak_reserved

        (rep,) = estimate_peak_reserved(w, ("pytorch",))
        err = rep.peak_block_allocated_bytes / r["peak_allocated_bytes"] - 1
        assert 0 <= err <= 0.03, (r["batch_size"], r["extra"], err)
        assert -0.016 <= w.peak_nbytes / r["peak_allocated_bytes"] - 1 <= 0.03


def test_master_weights_gradients_and_states_are_fp32():
    est = estimate_training_memory(256, 688, 2, 1000, 4, 2, 64, 4, batch_size=1, mixed_precision="bf16")
    n = SMALL.n_params
    assert est.optimizer_bytes == 2 * 4 * n  # the optimizer step holds the peak at this size
    assert est.gradient_bytes == 4 * n


def test_mixed_precision_holds_more_than_bf16_and_fp32_activations_sit_between():
    bf16 = training_trace(SMALL, 2, batch_size=4, seq_len=256).peak_nbytes
    amp = training_trace(SMALL, 4, batch_size=4, seq_len=256, mixed_precision="bf16").peak_nbytes
    assert amp > bf16


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), s=st.integers(1, 96), ckpt=st.booleans(), steps=st.integers(1, 3))
def test_every_allocation_is_freed_but_weights_states_and_overhead(b, s, ckpt, steps):
    w = training_trace(SMALL, 4, batch_size=b, seq_len=s, n_steps=steps, gradient_checkpointing=ckpt,
                       mixed_precision="fp16")
    live: dict[int, int] = {}
    for kind, i, size, _ in zip(*w.trace.as_lists()):
        if kind == 0:
            live[i] = size
        else:
            del live[i]
    n = SMALL.n_params
    # weights (fp32), two fp32 AdamW states, and the fixed overheads (12 + 32 + 32 + 16 MiB)
    assert sum(live.values()) == 4 * n + 8 * n + 92 * 2**20
    assert w.peak_nbytes >= 16 * n


@pytest.mark.parametrize("kwargs, match", [
    ({"mixed_precision": "fp8"}, "mixed_precision must be one of bf16, fp16"),
    ({"mixed_precision": True}, "mixed_precision must be one of"),
    ({"mixed_precision": "bf16", "dtype_bytes": 2}, "weights' dtype must be fp32"),
    ({"mixed_precision": "bf16", "optimizer_8bit": True}, "8-bit optimizer states is not modelled"),
    ({"mixed_precision": "bf16", "lora": LoraConfig(8)}, "LoRA is not modelled"),
])
def test_unmodelled_combinations_are_refused(kwargs, match):
    dtype_bytes = kwargs.pop("dtype_bytes", 4)
    with pytest.raises(InvalidArgumentError, match=match):
        training_trace(SMALL, dtype_bytes, seq_len=16, **kwargs)


def test_fit_refuses_mixed_precision_outside_training():
    with pytest.raises(InvalidArgumentError, match="for training=True"):
        find_max_batch(SMALL, 4, device="sim:gtx-1050-2gb", mixed_precision="bf16")
    with pytest.raises(InvalidArgumentError, match="weights' dtype must be fp32"):
        find_max_batch(SMALL, 2, device="sim:gtx-1050-2gb", training=True, mixed_precision="bf16")


def test_cli_estimate_mixed_precision_defaults_to_fp32_master_weights(capsys):
    assert main(["estimate", *SHAPE, "--training", "--prompt-len", "64", "--mixed-precision", "bf16",
                 "--policy", "pytorch", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["dtype"] == "fp32" and row["mixed_precision"] == "bf16" and row["workload"] == "training"
    assert main(["estimate", *SHAPE, "--training", "--prompt-len", "64", "--no-reserved", "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert row["peak_allocated_bytes"] > plain["peak_allocated_bytes"]


def test_cli_fit_mixed_precision(capsys):
    assert main(["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--training", "--prompt-len", "64",
                 "--mixed-precision", "bf16", "--max", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "fp32" and out["simulated"] >= 1


@pytest.mark.parametrize("argv, match", [
    (["estimate", *SHAPE, "--prompt-len", "8", "--mixed-precision", "bf16"], "--mixed-precision is for --training"),
    (["estimate", *SHAPE, "--prompt-len", "8", "--training", "--mixed-precision", "bf16", "--dtype", "bf16"],
     "--dtype must be fp32"),
    (["estimate", *SHAPE, "--prompt-len", "8", "--training", "--mixed-precision", "bf16", "--optimizer-8bit"],
     "8-bit optimizer states is not modelled"),
    (["estimate", *SHAPE, "--prompt-len", "8", "--training", "--mixed-precision", "bf16", "--lora-rank", "4"],
     "LoRA is not modelled"),
    (["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--mixed-precision", "bf16"], "--mixed-precision is for --training"),
    (["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--training", "--mixed-precision", "bf16", "--lora-rank", "4"],
     "LoRA is not modelled"),
    (["fit", *SHAPE, "--device", "sim:gtx-1050-2gb", "--training", "--mixed-precision", "bf16", "--dtype", "bf16"],
     "weights' dtype must be fp32"),
])
def test_cli_refusals_exit_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_help_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    assert "--mixed-precision" in capsys.readouterr().out
