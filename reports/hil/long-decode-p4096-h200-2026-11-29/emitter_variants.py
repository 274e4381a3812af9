"""The estimate's model of a 7B decode under the gpumem policy, as shipped and with its decode workspace
(``DECODE_SLACK_PER_Q_NBYTES``, Note [Overhead] in gpumem/estimate/workload.py) left out or held from the
prefill's end to the last step: peak reserved and the device's calls (twin off, so the device counts them all).

    PYTHONPATH=. python reports/hil/long-decode-p4096-h200-2026-11-29/emitter_variants.py

Prints one row per variant and length; the record's figures come from it (this machine's CPU, a few minutes).
Since the twelfth session (Note [The decode slack for stolen pages] in gpumem/estimate/fit.py) the printed peak
allocated is the program's requests without the slack (the record's column had it), and the held variant patches
the emitter's line as it now reads; peak reserved and the calls are the record's."""

import inspect
import time

import gpumem.estimate.workload as W
from gpumem.estimate.fit import replay_inference
from gpumem.estimate.shape import ModelShape
from gpumem.specs import open_device

LLAMA_7B = ModelShape(4096, 11008, 32, 32000, 32, 32)
SHIPPED = W._emit_inference


def _replace(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:  # the emitter's source moved on: say so rather than replay another variant
        raise SystemExit(f"emitter_variants.py: the emitter's source no longer has the line to patch: {old.strip()[:70]!r}")
    return src.replace(old, new)


def _held_variant():
    """_emit_inference with the workspace allocated once after the prefill (where the slack is given: the gpumem
    replay, Note [The decode slack for stolen pages] since the twelfth session) and freed at the end."""
    src = inspect.getsource(SHIPPED)
    src = _replace(src, """    if on_step is not None:
        on_step(0)
    steps = list(steps)
""", """    steps = list(steps)
    ws = e.alloc(DECODE_SLACK_PER_Q_NBYTES * shape.q_dim, Category.OVERHEAD) \\
        if decode_slack and shape.n_kv_heads == shape.n_heads and steps else -1
    if on_step is not None:
        on_step(0)
""")
    src = _replace(src, """        slack = DECODE_SLACK_PER_Q_NBYTES * shape.q_dim if decode_slack and shape.n_kv_heads == shape.n_heads else 0
        _forward(e, shape, batch_size, 1, d_act, cache, prompt_len + step, slack)""", """        _forward(e, shape, batch_size, 1, d_act, cache, prompt_len + step, 0)""")
    src = _replace(src, """    e.free(ids, mask)
""", """    e.free(ids, mask)
    if ws >= 0:
        e.free(ws)
""")
    ns = dict(vars(W))
    exec(compile(src, "<held variant>", "exec"), ns)
    return ns["_emit_inference"]


def run(variant: str, prompt: int, tokens: int) -> None:
    W._emit_inference = SHIPPED
    W.DECODE_SLACK_PER_Q_NBYTES = 0 if variant == "none" else 6 * 1024  # before the variant copies the module
    if variant == "held":
        W._emit_inference = _held_variant()
    dev = open_device("sim:h200-141gb")
    t0 = time.process_time()
    try:
        r = replay_inference(LLAMA_7B, 2, ("gpumem",), dev, prompt_len=prompt, new_tokens=tokens)[0]
        calls = dict(dev.stats.calls)
    finally:
        dev.close()
    print(f"{variant:8} prompt {prompt:5} tokens {tokens:5}  peak allocated {r.peak_allocated_bytes:,}  "
          f"peak reserved {r.peak_reserved_bytes:,}  device calls {sum(calls.values()):,}  "
          f"mem_map {calls.get('mem_map', 0):,}  {time.process_time() - t0:.2f} CPU s", flush=True)


if __name__ == "__main__":
    for variant in ("shipped", "none", "held"):
        for prompt, tokens in ((4096, 2000), (2048, 4500), (2048, 6000)):
            run(variant, prompt, tokens)
