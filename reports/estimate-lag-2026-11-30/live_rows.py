"""The estimate's gpumem figure (``replay_inference``, the GPU's lag in the native twin) on the seven live 7B SDPA
decodes of ``reports/decode-lag-2026-11-29.md`` and ``reports/hil/lag-check-h200-2026-11-29.md``, against live and
against the simulator's ``model`` replay recorded there (``replay_trace(..., gpu_timing="model")``, minutes each)::

    PYTHONPATH=. python reports/estimate-lag-2026-11-30/live_rows.py > reports/estimate-lag-2026-11-30/live_rows.txt

CPU seconds of the estimate's gpumem replay alone (``time.process_time``) on the machine it ran on.
"""

import time

from benchmarks.estimate_speed import LLAMA_7B
from gpumem.estimate.fit import replay_inference

# prompt, new tokens, part, live peak reserved (gpumem.torch on the H200), the model replay's peak reserved
ROWS = [
    (4096, 2000, "tuning", 16_842_227_712, 16_848_519_168),
    (1024, 3000, "tuning", 15_730_737_152, 15_734_931_456),
    (2048, 4500, "tuning", 17_104_371_712, 17_110_663_168),
    (2048, 6000, "tuning", 17_928_552_448, 17_934_843_904),
    (3072, 2500, "check", 16_552_820_736, 16_557_015_040),
    (1536, 4800, "check", 16_989_028_352, 16_995_319_808),
    (2560, 4000, "check", 17_081_303_040, 17_085_497_344),
]


def main() -> None:
    print("| prompt + new | part | live peak reserved | estimate - live | estimate = model replay | cpu s |")
    print("|---|---|---:|---:|---|---:|")
    for prompt, new, part, live, model in ROWS:
        t0 = time.process_time()
        est = replay_inference(LLAMA_7B, 2, ("gpumem",), "sim:h200-141gb", prompt_len=prompt, new_tokens=new)[0]
        cpu_s = time.process_time() - t0
        got = est.peak_reserved_bytes
        print(f"| {prompt:,} + {new:,} | {part} | {live:,} | {got - live:+,} ({(got - live) / live * 100:+.3f} %) | "
              f"{'yes' if got == model else f'no ({got - model:+,})'} | {cpu_s:.2f} |")


if __name__ == "__main__":
    main()
