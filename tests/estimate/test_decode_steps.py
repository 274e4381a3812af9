"""Issue 20 items 2, 4, 6, 11, 12: the short decode trace against the full one, fit and estimate against the
manager's usable memory, injected faults in fit, progress and the estimate table."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from gpumem.cli import main
from gpumem.estimate import ModelShape, find_max_batch, inference_trace
from gpumem.estimate.fit import InjectedFaultError, _decode_timing, _replay, replay_inference, usable_memory
from gpumem.estimate.workload import decode_steps_simulated
from gpumem.managers import GpuMemoryManager
from gpumem.managers.reserve import default_usable_nbytes
from gpumem.specs import open_device

SHAPES = {"mha": ModelShape(256, 688, 4, 1000, 4, 4), "gqa": ModelShape(512, 1376, 6, 3000, 8, 2),
          "tied": ModelShape(384, 1024, 3, 5000, 6, 3, tie_word_embeddings=True),
          "moe": ModelShape(256, 512, 3, 1000, 4, 2, n_experts=4, experts_per_token=2),
          "moe-shared": ModelShape(256, 512, 2, 1000, 4, 4, attention_bias=True, n_experts=6, experts_per_token=3,
                                   expert_intermediate_size=128, shared_expert_intermediate_size=384,
                                   router_weights_cast=True),
          "bitnet": ModelShape(256, 512, 2, 1000, 4, 2, tie_word_embeddings=True, sub_norms=True,
                               activation="relu2")}
LLAMA_7B = ["--hidden-size", "4096", "--intermediate-size", "11008", "--layers", "32", "--vocab-size", "32000",
            "--heads", "32"]
#: LLAMA_7B's shape with 2 layers (a single-value option may be given once: Note [Options behave the same in
#: every command])
LLAMA_7B_2 = [("2" if prev == "--layers" else a) for prev, a in zip([None, *LLAMA_7B], LLAMA_7B)]


# -- item 11: the short trace and the streamed replay give the full trace's figures -------------------------

def test_the_trace_does_not_grow_with_new_tokens():
    s = SHAPES["gqa"]
    short = inference_trace(s, 2, batch_size=2, prompt_len=32, new_tokens=40)
    long = inference_trace(s, 2, batch_size=2, prompt_len=32, new_tokens=4000)
    assert long.trace.n_ops == short.trace.n_ops  # before: one decode forward per new token
    assert decode_steps_simulated(4000) == [1, 2, 3998, 3999]
    assert decode_steps_simulated(5) == [1, 2, 3, 4] == decode_steps_simulated(5, full=True)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(SHAPES)), st.integers(1, 40), st.integers(1, 300), st.integers(0, 90),
       st.sampled_from([1, 2, 4]))
def test_peak_allocated_and_its_split_match_the_full_trace(name, batch, prompt, new, dtype_bytes):
    s = SHAPES[name]
    full = inference_trace(s, dtype_bytes, batch_size=batch, prompt_len=prompt, new_tokens=new, full_decode=True)
    fast = inference_trace(s, dtype_bytes, batch_size=batch, prompt_len=prompt, new_tokens=new)
    assert (fast.peak_nbytes, fast.at_peak, fast.phase_at_peak) == (full.peak_nbytes, full.at_peak,
                                                                    full.phase_at_peak)


@pytest.mark.parametrize("name,batch,prompt,new", [("mha", 1, 64, 50), ("mha", 8, 100, 120), ("gqa", 3, 77, 60),
                                                   ("gqa", 64, 16, 90), ("tied", 5, 200, 33), ("mha", 2, 9, 1),
                                                   ("gqa", 4, 30, 4), ("gqa", 4, 30, 5), ("moe", 6, 50, 40),
                                                   ("moe-shared", 3, 70, 25), ("bitnet", 4, 33, 21)])
def test_streamed_replay_reserves_what_the_full_trace_reserves(name, batch, prompt, new):
    s = SHAPES[name]
    full = inference_trace(s, 2, batch_size=batch, prompt_len=prompt, new_tokens=new, full_decode=True)
    policies = ("pytorch", "expandable", "gpumem", "bestfit", "cupy")
    streamed = replay_inference(s, 2, policies, "sim:h200-141gb", batch_size=batch, prompt_len=prompt,
                                new_tokens=new)
    # a policy whose pages are stolen replays the trace with the GPU's lag (Note [The GPU's lag in the decode
    # replay]); every policy reports the program's requests
    for r in streamed:
        ref = _replay(full, "sim:h200-141gb", r.policy, gpu_timing=_decode_timing(r.policy))
        assert (r.peak_reserved_bytes, r.fits, r.peak_allocated_bytes) == (ref.peak_reserved_bytes, ref.fits,
                                                                           full.peak_nbytes), r.policy


def test_streamed_replay_stops_where_the_full_replay_runs_out_of_memory():
    s = SHAPES["gqa"]
    full = inference_trace(s, 2, batch_size=64, prompt_len=300, new_tokens=30, full_decode=True)
    limit = full.peak_nbytes - 2**20
    (r,) = replay_inference(s, 2, ("pytorch",), "sim:h200-141gb", batch_size=64, prompt_len=300, new_tokens=30,
                            limit=limit)
    ref = _replay(full, "sim:h200-141gb", "pytorch", limit)
    assert not r.fits and not ref.fits and r.peak_reserved_bytes == ref.peak_reserved_bytes
    assert not r.injected_fault and "out of memory" in r.oom_message


# -- item 2: one usable memory; fit and estimate agree, and the manager takes fit's answer ------------------

def test_fit_sizes_against_the_managers_usable_memory():
    dev = open_device("sim:a100-80gb")
    try:
        usable = usable_memory(dev)
        assert usable == default_usable_nbytes(dev.mem_info())
    finally:
        dev.close()
    with GpuMemoryManager("sim:a100-80gb") as m:
        assert m.usable_memory == usable  # before: fit used all the free memory (78.94 GiB vs 71.00 GiB)


def test_the_issues_example_fit_and_estimate_agree_and_the_manager_takes_the_answer(capsys):
    assert main(["fit", *LLAMA_7B, "--prompt-len", "4096", "--device", "sim:a100-80gb", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert (fit["new_tokens"], fit["prompt_len"], fit["training"]) == (16, 4096, False)  # printed with the answer
    b = fit["simulated"]
    assert b >= 1
    rows = {}
    for batch in (b, b + 1):
        assert main(["estimate", *LLAMA_7B, "--batch-size", str(batch), "--prompt-len", "4096", "--device",
                     "sim:a100-80gb", "--policy", "pytorch", "--json"]) == 0
        (rows[batch],) = json.loads(capsys.readouterr().out)
    assert rows[b]["new_tokens"] == 16 and rows[b]["usable_bytes"] == fit["usable_bytes"]
    assert rows[b]["fits"] and rows[b]["headroom_bytes"] >= 0
    assert rows[b]["peak_reserved_bytes"] <= fit["usable_bytes"]
    if fit["binary_search"] == b:  # the most that fits without margin: one more does not, says estimate too
        assert not rows[b + 1]["fits"]
    # the answer's allocations, made through a GpuMemoryManager on the same device, all succeed
    shape = ModelShape(4096, 11008, 32, 32000, 32, 32)

    class ManagerSink:
        def __init__(self, m):
            self.m, self.live = m, {}

        def alloc(self, i, nbytes):
            if nbytes:
                self.live[i] = self.m.allocate(nbytes)

        def free(self, i):
            a = self.live.pop(i, None)
            if a is not None:
                self.m.deallocate(a)

    from gpumem.estimate.workload import stream_inference
    with GpuMemoryManager("sim:a100-80gb") as m:
        stream_inference(shape, 2, (ManagerSink(m),), batch_size=b, prompt_len=4096, new_tokens=16)


def test_help_shows_the_shared_defaults(capsys):
    for command in ("estimate", "fit"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "tokens generated per sequence (default: 16" in text, command


def test_fit_text_names_the_workload(capsys):
    assert main(["fit", *LLAMA_7B_2, "--device", "sim:t4-16gb", "--max", "64"]) == 0
    out = capsys.readouterr().out
    assert "generate(), 16 new tokens, prompt 512" in out and "usable by a GpuMemoryManager" in out


# -- item 12: fit on a device that injects faults -------------------------------------------------------------

def test_fit_on_a_faulty_device_names_the_injected_fault(capsys):
    spec = "sim:a100-80gb?fail_rate=0.3"
    with pytest.raises(InjectedFaultError, match="injected fault"):
        find_max_batch(SHAPES["gqa"], 2, device=spec, prompt_len=64, new_tokens=4, max_value=64)
    assert main(["fit", "--hidden-size", "2048", "--intermediate-size", "5632", "--layers", "22", "--vocab-size",
                 "32000", "--heads", "32", "--kv-heads", "4", "--device", spec]) == 4
    captured = capsys.readouterr()
    assert "injected fault" in captured.err and "nothing was out of memory" in captured.err
    assert "needs more than" not in captured.out + captured.err


# -- item 4: progress on a terminal, quiet otherwise ----------------------------------------------------------

@pytest.mark.parametrize("command", ["estimate", "fit"])
@pytest.mark.parametrize("json_flag,expected", [([], None), (["--json"], False)])
def test_progress_is_asked_for_on_a_terminal_only(monkeypatch, capsys, command, json_flag, expected):
    seen = []
    import gpumem.estimate.fit as fitmod
    import gpumem.commands.estimate as estmod
    from gpumem import progress as real

    def spy(total, desc="", unit="it", *, enabled=None, **kw):
        seen.append(enabled)
        return real.progress(total, desc, unit, enabled=False)

    monkeypatch.setattr(fitmod, "progress_bar", spy)
    monkeypatch.setattr(estmod, "progress", spy)
    argv = [command, *LLAMA_7B_2, "--prompt-len", "64", "--device", "sim:t4-16gb", *json_flag]
    if command == "fit":
        argv += ["--max", "8"]
    assert main(argv) == 0
    capsys.readouterr()
    # None: the bar shows when stderr is a terminal (gpumem.progress decides); fit asks one for its replays and
    # one per replay for its steps, all alike
    assert seen[:1] == [expected] and set(seen) == {expected}


# -- item 6: the table -----------------------------------------------------------------------------------------

def test_estimate_table_says_whether_it_fits_and_names_its_units(capsys):
    assert main(["estimate", *LLAMA_7B, "--batch-size", "15", "--prompt-len", "4096", "--device",
                 "sim:a100-80gb", "--policy", "pytorch"]) == 0
    out = capsys.readouterr().out
    assert "GiB (2^30 bytes)" in out and "FITS, HEADROOM" in out and "KV @PEAK" in out
    assert "the key/value cache at the peak (not after the last token)" in out
    line = out.splitlines()[2]
    assert line.split()[-2] == "yes" and float(line.split()[-1]) >= 0
    assert main(["estimate", *LLAMA_7B, "--batch-size", "15", "--prompt-len", "4096", "--device",
                 "sim:a100-80gb", "--no-reserved"]) == 0
    out = capsys.readouterr().out
    assert "RES" not in out and "whether PEAK ALLOC fits" in out


def test_a_short_trace_is_not_replayed_as_if_it_were_the_workload():
    from gpumem.errors import InvalidArgumentError
    from gpumem.estimate import estimate_peak_reserved

    short = inference_trace(SHAPES["mha"], 2, batch_size=2, prompt_len=16, new_tokens=40)
    assert not short.complete
    with pytest.raises(InvalidArgumentError, match="leaves decode steps out"):
        estimate_peak_reserved(short, ("pytorch",), device="sim:t4-16gb")
    assert inference_trace(SHAPES["mha"], 2, batch_size=2, prompt_len=16, new_tokens=40, full_decode=True).complete


def test_fit_takes_the_training_options_estimate_takes(capsys):
    base = [*LLAMA_7B_2, "--device", "sim:t4-16gb", "--prompt-len", "256", "--json"]
    assert main(["fit", *base, "--training", "--max", "64"]) == 0
    plain = json.loads(capsys.readouterr().out)["simulated"]
    assert main(["fit", *base, "--training", "--gradient-checkpointing", "--optimizer-8bit", "--max", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated"] >= plain
    assert main(["fit", *base, "--gradient-checkpointing"]) == 2
    assert "--gradient-checkpointing is for --training" in capsys.readouterr().err
