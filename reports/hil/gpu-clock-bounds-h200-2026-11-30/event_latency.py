"""How long after its record a CUDA event is seen done, with and without timing (H200 probe of
``reports/hil/gpu-clock-bounds-h200-2026-11-30.md``): 3,000 events of each kind on an idle stream (synchronized, then
20 us of sleep) and on a busy one (three small kernels queued before each), each polled with ``query()`` from
its record on; prints the 1st, 50th and 90th percentile in microseconds, and what one ``query()`` costs::

    python reports/hil/gpu-clock-bounds-h200-2026-11-30/event_latency.py      # a CUDA GPU and PyTorch; ~10 s

The times include PyTorch's Python overhead (the same for both kinds): the difference between the kinds is the
figure that matters (Note [A stamp lies between its event's record and its completion seen] in
``gpumem/_native/torch_api.cpp``).
"""

import time

import torch


def seen_done_us(stream: torch.cuda.Stream, x: torch.Tensor, timing: bool, busy: bool, n: int = 3000) -> tuple:
    """Percentiles 1, 50 and 90 of the microseconds from an event's record to its first query that finds it done."""
    out = []
    for _ in range(n):
        if busy:
            for _ in range(3):
                x.add_(1)   # small kernels: the GPU keeps up
        else:
            torch.cuda.synchronize()
            time.sleep(20e-6)
        e = torch.cuda.Event(enable_timing=timing)
        t0 = time.perf_counter_ns()
        e.record(stream)
        while not e.query():
            pass
        out.append((time.perf_counter_ns() - t0) / 1e3)
    out.sort()
    return out[n // 100], out[n // 2], out[9 * n // 10]


def main() -> None:
    torch.cuda.init()
    s = torch.cuda.current_stream()
    x = torch.zeros(1024, device="cuda")
    for busy in (False, True):
        for timing in (False, True, False, True):
            p1, p50, p90 = seen_done_us(s, x, timing, busy)
            print(f"{'busy' if busy else 'idle'} {'timing' if timing else 'no-timing'} p1/p50/p90 us: "
                  f"{p1:.1f} {p50:.1f} {p90:.1f}", flush=True)
    e = torch.cuda.Event()
    e.record(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(10000):
        e.query()
    print("query cost us", (time.perf_counter_ns() - t0) / 1e7)


if __name__ == "__main__":
    main()
