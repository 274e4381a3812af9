"""A Llama-style training run under gpumem.torch or PyTorch's allocator, for the estimate's training replay: ``python
reports/hil/estimate-lag-h200-2026-11-30/train_probe.py {gpumem,default} HIDDEN INTERMEDIATE LAYERS VOCAB HEADS BATCH
SEQ`` builds a randomly initialised ``LlamaForCausalLM`` in bf16 on the GPU (SDPA, as ``benchmarks/hf_memory.py``
builds it), runs two AdamW training steps (``model(input_ids=ids, labels=ids)``, ``backward``, ``step``,
``zero_grad(set_to_none=True)``: ``training_trace(..., n_steps=2)``'s program), and prints one JSON line: the
process's peak reserved and peak allocated since the start (gpumem.torch: ``gpumem.torch.memory_stats()``).

``--predict`` instead (no GPU) prints the estimate's figures for the same run: the program's peak of requests and the
replay of ``training_trace`` under ``pytorch`` and ``gpumem`` with the replay's default GPU timing (what the
estimate replays today: the workload's synthetic clock, one microsecond per op, so a GPU never behind) and with
``model`` (the GPU's lag, as the decode's replay runs it since 2026-11-30).
"""

from __future__ import annotations

import json
import sys


def predict(hidden: int, inter: int, layers: int, vocab: int, heads: int, batch: int, seq: int) -> dict:
    from gpumem.estimate import ModelShape, training_trace
    from gpumem.replay import replay_trace

    w = training_trace(ModelShape(hidden, inter, layers, vocab, heads, heads), 2, batch_size=batch, seq_len=seq)
    out = {"peak_requested": w.peak_nbytes}
    for policy, timing in (("pytorch", None), ("gpumem", None), ("gpumem", "model")):
        r = replay_trace(w.trace, "sim:h200-141gb", policy, gpu_timing=timing)
        out[f"peak_reserved_{policy}_{timing or 'default'}"] = r.peak_reserved_bytes
    return out


def live(alloc: str, hidden: int, inter: int, layers: int, vocab: int, heads: int, batch: int, seq: int) -> dict:
    import torch

    if alloc == "gpumem":
        import gpumem.torch as gt
        gt.install()
    import transformers

    from benchmarks.hf_memory import build_model  # the accuracy table's model: bf16, SDPA, untied, on the GPU

    model = build_model(torch, transformers, dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                                  vocab_size=vocab, num_attention_heads=heads,
                                                  num_key_value_heads=heads))
    model.train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        ids = torch.randint(3, vocab, (batch, seq), device="cuda", generator=gen)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, ids
        torch.cuda.synchronize()
    if alloc == "gpumem":
        s = gt.memory_stats()
        return {"peak_reserved": s["reserved_bytes.all.peak"], "peak_allocated": s["allocated_bytes.all.peak"]}
    return {"peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated()}


def main() -> None:
    what = sys.argv[1]
    dims = [int(a) for a in sys.argv[2:9]]
    got = predict(*dims) if what == "--predict" else live(what, *dims)
    print(json.dumps({"run": what, "dims": dims, **got}))


if __name__ == "__main__":
    main()
