"""Note [The decode slack for stolen pages] (gpumem/estimate/fit.py): the program's requests and the replays of
policies whose pages are never stolen are made without Note [Overhead]'s decode slack; the ``gpumem`` replay keeps
it, as a stand-in for the GPU's lag."""

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, inference_trace
from gpumem.estimate.fit import decode_slack_for, replay_inference
from gpumem.estimate.workload import DECODE_SLACK_PER_Q_NBYTES

MHA = ModelShape(512, 1024, 2, 1000, 8, 8)
GQA = ModelShape(512, 1024, 2, 1000, 8, 2)


def test_only_policies_whose_pages_are_stolen_get_the_slack():
    assert [decode_slack_for(p) for p in ("pytorch", "expandable", "bestfit", "cupy", "bucket", "gpumem")] == [
        False, False, False, False, False, True]
    with pytest.raises(InvalidArgumentError, match="unknown allocator policy"):
        decode_slack_for("no-such-policy")


def test_the_slack_is_a_block_through_each_decode_forward_of_multi_head_models_only():
    kw = dict(batch_size=1, prompt_len=32, new_tokens=8, full_decode=True)
    plain, slacked = inference_trace(MHA, 2, **kw), inference_trace(MHA, 2, decode_slack=True, **kw)
    assert plain.peak_nbytes < slacked.peak_nbytes <= plain.peak_nbytes + DECODE_SLACK_PER_Q_NBYTES * MHA.q_dim
    assert len(slacked.trace.kinds) == len(plain.trace.kinds) + 2 * 7  # made and freed in each of 7 decode steps
    assert inference_trace(GQA, 2, decode_slack=True, **kw).peak_nbytes == inference_trace(GQA, 2, **kw).peak_nbytes


def test_every_policy_reports_the_programs_requests_and_only_gpumem_replays_the_slack():
    kw = dict(batch_size=1, prompt_len=32, new_tokens=40)
    plain = inference_trace(MHA, 2, **kw)
    got = {r.policy: r for r in replay_inference(MHA, 2, ("pytorch", "gpumem"), "sim:h200-141gb", **kw)}
    assert got["pytorch"].peak_allocated_bytes == got["gpumem"].peak_allocated_bytes == plain.peak_nbytes
    # each policy alone gives what it gives beside the other (two streams, Note [One stream, every policy] in each)
    for p in ("pytorch", "gpumem"):
        (alone,) = replay_inference(MHA, 2, (p,), "sim:h200-141gb", **kw)
        assert alone == got[p]
    # the gpumem replay holds the slack's block on top of what the program holds at some point of a decode step
    (full,) = replay_inference(MHA, 2, ("gpumem",), "sim:h200-141gb", full_replay=True, **kw)
    assert full == got["gpumem"]
