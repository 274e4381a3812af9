"""How long after a fence (a CUDA event without timing, as gpumem's engine records) a timing event recorded right
after it is seen done (H200 probe of ``reports/hil/gpu-clock-bounds-h200-2026-11-30.md``): 3,000 times on an idle
stream (synchronized, then 20 us of sleep) and 3,000 on a busy one (three small kernels queued first), the fence and
the timing event recorded back to back, each polled with ``query()`` until done. Both events are made before the
loop (PyTorch makes a CUDA event at its first record), so no event creation is timed. Prints percentiles 1, 50
and 90, in microseconds, of: record to fence seen done, record to timing event seen done, and the difference; and
what one ``query()`` costs::

    python reports/hil/gpu-clock-bounds-h200-2026-11-30/event_latency.py      # a CUDA GPU and PyTorch; ~10 s

The times include PyTorch's Python overhead; the difference is the figure Note [A stamp lies between its event's
record and its completion seen] in ``gpumem/_native/torch_api.cpp`` rests on.
"""

import time

import numpy as np
import torch


def seen_done_us(fence: torch.cuda.Event, timed: torch.cuda.Event, x: torch.Tensor, busy: bool,
                 n: int = 3000) -> np.ndarray:
    """(n, 2): microseconds from the records to the fence seen done, and to the timing event seen done."""
    out = np.empty((n, 2))
    for i in range(n):
        if busy:
            for _ in range(3):
                x.add_(1)   # small kernels: the GPU keeps up
        else:
            torch.cuda.synchronize()
            time.sleep(20e-6)
        t0 = time.perf_counter_ns()
        fence.record()
        timed.record()
        while not fence.query():
            pass
        t_fence = time.perf_counter_ns()
        while not timed.query():
            pass
        out[i] = ((t_fence - t0) / 1e3, (time.perf_counter_ns() - t0) / 1e3)
    return out


def main() -> None:
    torch.cuda.init()
    x = torch.zeros(1024, device="cuda")
    fence, timed = torch.cuda.Event(), torch.cuda.Event(enable_timing=True)
    fence.record()
    timed.record()   # both made now, outside the timed loop
    torch.cuda.synchronize()
    for busy in (False, True, False, True):
        d = seen_done_us(fence, timed, x, busy)
        cells = [np.percentile(v, [1, 50, 90]) for v in (d[:, 0], d[:, 1], d[:, 1] - d[:, 0])]
        print(f"{'busy' if busy else 'idle'}: fence " + "/".join(f"{v:.1f}" for v in cells[0]) + ", timing event "
              + "/".join(f"{v:.1f}" for v in cells[1]) + ", difference " + "/".join(f"{v:.1f}" for v in cells[2])
              + " us (p1/p50/p90)", flush=True)
    fence.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(10000):
        fence.query()
    print(f"query() {(time.perf_counter_ns() - t0) / 1e7:.2f} us")


if __name__ == "__main__":
    main()
