"""Note [The GPU's lag in the decode replay] (gpumem/estimate/fit.py): no replay of the estimate gets Note
[Overhead]'s decode slack any more; the ``gpumem`` replay runs the GPU's lag instead. The slack stays in the
workload (``decode_slack=True``) for studies of the old stand-in."""

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, inference_trace
from gpumem.estimate.fit import decode_lag_for, replay_inference
from gpumem.estimate.workload import DECODE_SLACK_PER_Q_NBYTES
from gpumem.replay import replay_trace

MHA = ModelShape(512, 1024, 2, 1000, 8, 8)
GQA = ModelShape(512, 1024, 2, 1000, 8, 2)


def test_only_policies_whose_pages_are_stolen_run_the_gpus_lag():
    assert [decode_lag_for(p) for p in ("pytorch", "expandable", "bestfit", "cupy", "bucket", "gpumem")] == [
        False, False, False, False, False, True]
    with pytest.raises(InvalidArgumentError, match="unknown allocator policy"):
        decode_lag_for("no-such-policy")
    with pytest.raises(InvalidArgumentError, match="unknown allocator policy"):
        replay_inference(MHA, 2, ("pytorch", "no-such-policy"), "sim:h200-141gb", prompt_len=8, new_tokens=20)


def test_the_slack_is_a_block_through_each_decode_forward_of_multi_head_models_only():
    kw = dict(batch_size=1, prompt_len=32, new_tokens=8, full_decode=True)
    plain, slacked = inference_trace(MHA, 2, **kw), inference_trace(MHA, 2, decode_slack=True, **kw)
    assert plain.peak_nbytes < slacked.peak_nbytes <= plain.peak_nbytes + DECODE_SLACK_PER_Q_NBYTES * MHA.q_dim
    assert len(slacked.trace.kinds) == len(plain.trace.kinds) + 2 * 7  # made and freed in each of 7 decode steps
    assert inference_trace(GQA, 2, decode_slack=True, **kw).peak_nbytes == inference_trace(GQA, 2, **kw).peak_nbytes


def test_every_policy_replays_the_programs_requests_and_gpumem_the_gpus_lag():
    kw = dict(batch_size=1, prompt_len=32, new_tokens=40)
    plain = inference_trace(MHA, 2, full_decode=True, **kw)
    got = {r.policy: r for r in replay_inference(MHA, 2, ("pytorch", "gpumem"), "sim:h200-141gb", **kw)}
    assert got["pytorch"].peak_allocated_bytes == got["gpumem"].peak_allocated_bytes == plain.peak_nbytes
    # each policy alone gives what it gives beside the other (one stream, Note [One stream, every policy])
    for p in ("pytorch", "gpumem"):
        (alone,) = replay_inference(MHA, 2, (p,), "sim:h200-141gb", **kw)
        assert alone == got[p]
    (full,) = replay_inference(MHA, 2, ("gpumem",), "sim:h200-141gb", full_replay=True, **kw)
    assert full == got["gpumem"]
    model = replay_trace(plain.trace, "sim:h200-141gb", "gpumem", gpu_timing="model")
    assert got["gpumem"].peak_reserved_bytes == model.peak_reserved_bytes
