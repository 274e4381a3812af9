"""Scenarios of PyTorch on gpumem's C++ shim, each run in a fresh process (PyTorch takes its allocator once).

``python shim_child.py SCENARIO ALLOCATOR`` with ALLOCATOR one of ``native`` (PyTorch's own caching
allocator), ``ctypes`` (gpumem.torch.install(): alloc and free only, record_stream ignored) and
``shim`` (gpumem.torch_shim.install()). Prints one line ``RESULT <json>`` with what it measured;
the checks are made by the caller (test_torch_shim.py, hil/probes/torch_shim.py), which compare
allocators. Exits non-zero with a traceback when the scenario itself cannot run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

ALLOCATORS = ("native", "ctypes", "shim")


def _install(allocator: str) -> str:
    if allocator == "ctypes":
        import gpumem.torch as gt

        gt.install()
        return "ctypes"
    if allocator == "shim":
        import gpumem.torch_shim as ts

        return ts.install().value
    if allocator != "native":
        raise SystemExit(f"unknown allocator {allocator!r} (expected one of {ALLOCATORS})")
    return "native"


def _bits(values: "list[float]") -> "list[str]":
    return [float(v).hex() for v in values]


def scenario_record_stream(allocator: str) -> "dict[str, Any]":
    """A tensor read on a side stream is freed on its own stream while the side stream still waits.

    The side stream sleeps, then copies ``x`` (all ones). ``x`` is announced with record_stream and
    freed at once; the main stream then allocates a tensor of the same size and fills it with twos.
    An allocator that honours record_stream gives the new tensor other memory and the copy reads
    ones; one that ignores it hands out ``x``'s memory again and the copy reads twos.
    """
    installed = _install(allocator)
    import torch

    n = 1 << 22
    side = torch.cuda.Stream()
    out = torch.empty(n, device="cuda")
    results = {}
    for recorded in (False, True):
        x = torch.ones(n, device="cuda")
        x_ptr = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)   # ~0.1 s: the main stream runs ahead
            out.copy_(x)
        if recorded:
            x.record_stream(side)
        del x
        y = torch.full((n,), 2.0, device="cuda")
        reused = y.data_ptr() == x_ptr
        torch.cuda.synchronize()
        results["with_record_stream" if recorded else "without_record_stream"] = {
            "memory_reused": reused, "wrong_elements": int((out != 1.0).sum().item())}
        del y
    return {"allocator": installed, **results}


def _mlp(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()


def _batches(torch: Any, steps: int) -> "list[tuple[Any, Any]]":
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 256, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda())
            for _ in range(steps)]


def scenario_cuda_graph(allocator: str) -> "dict[str, Any]":
    """A whole training step (forward, loss, backward, SGD step) captured in a CUDA graph and replayed."""
    installed = _install(allocator)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = _batches(torch, 20)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as PyTorch's whole-network capture does
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    losses = []
    for x, y in batches:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.item())
    out = {"allocator": installed, "losses": _bits(losses), "loss_first": losses[0], "loss_last": losses[-1]}
    if installed == "shim":
        import gpumem.torch_shim as ts

        out["pools_while_graph_lives"] = ts.pool_table()
        del graph, static_loss
        torch.cuda.synchronize()
        out["pools_after_graph_deleted"] = ts.pool_table()
    return out


def scenario_reduce_overhead(allocator: str) -> "dict[str, Any]":
    """torch.compile(mode="reduce-overhead") (CUDA-graph trees) on a training loop."""
    installed = _install(allocator)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    step_model = torch.compile(model, mode="reduce-overhead")
    losses = []
    for x, y in _batches(torch, 12):
        torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn(step_model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = {"allocator": installed, "losses": _bits(losses), "loss_first": losses[0], "loss_last": losses[-1]}
    if installed == "shim":   # the CUDA-graph trees' pool, when they did capture graphs
        import gpumem.torch_shim as ts

        out["pools"] = ts.pool_table()
    return out


def scenario_mem_pool(allocator: str) -> "dict[str, Any]":
    """torch.cuda.use_mem_pool with gpumem's pool: under PyTorch's allocator (native) or under the shim."""
    installed = _install(allocator)
    import torch

    import gpumem.torch as gt
    import gpumem.torch_shim as ts

    pool = ts.mem_pool()
    before = gt._raw_stats(0)
    with torch.cuda.use_mem_pool(pool):
        big = torch.ones(64 << 20, device="cuda", dtype=torch.uint8)
    outside = torch.ones(1 << 20, device="cuda", dtype=torch.uint8)
    torch.cuda.synchronize()
    after = gt._raw_stats(0)
    out = {"allocator": installed, "sum_ok": int(big.sum().item()) == 64 << 20,
           "gpumem_reserved_before": before["reserved_nbytes"], "gpumem_reserved_after": after["reserved_nbytes"],
           "gpumem_allocs_in_region": after["num_allocs"] - before["num_allocs"]}
    if installed == "shim":
        out["pools"] = ts.pool_table()
    del big, outside
    del pool
    torch.cuda.synchronize()
    if installed == "shim":
        out["pools_after"] = ts.pool_table()
    return out


def scenario_stats(allocator: str) -> "dict[str, Any]":
    """torch.cuda.memory_stats / empty_cache / memory fraction / peaks / cacheInfo reach gpumem."""
    installed = _install(allocator)
    import torch

    import gpumem.torch as gt

    xs = [torch.empty(n << 20, device="cuda", dtype=torch.uint8) for n in (1, 3, 64, 200)]
    st = torch.cuda.memory_stats()
    ours = gt.memory_stats()
    out: "dict[str, Any]" = {"allocator": installed}
    out["torch_allocated"] = st["allocated_bytes.all.current"]
    out["gpumem_allocated"] = ours["allocated_bytes.all.current"]
    out["torch_reserved"] = st["reserved_bytes.all.current"]
    out["gpumem_reserved"] = ours["reserved_bytes.all.current"]
    out["memory_allocated"] = torch.cuda.memory_allocated()
    out["summary_has_rows"] = "Allocated memory" in torch.cuda.memory_summary()
    del xs
    torch.cuda.synchronize()
    out["reserved_before_empty_cache"] = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    out["reserved_after_empty_cache"] = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    out["peak_after_reset"] = torch.cuda.max_memory_allocated()
    torch.cuda.set_per_process_memory_fraction(0.01)
    try:
        torch.empty(4 << 30, device="cuda", dtype=torch.uint8)
        out["fraction_oom"] = False
    except torch.OutOfMemoryError as exc:
        out["fraction_oom"] = True
        out["fraction_oom_message"] = str(exc)[:300]
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(4 << 30, device="cuda", dtype=torch.uint8)
    out["after_fraction_lifted"] = big.numel() == 4 << 30
    del big
    torch.backends.cudnn.benchmark = True   # cuDNN's benchmark sizes its workspace with cacheInfo
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    out["conv_benchmark_ok"] = tuple(conv(torch.randn(2, 3, 32, 32, device="cuda")).shape) == (2, 8, 30, 30)
    return out


def _ddp_rank(rank: int, allocator: str, port: int, queue: Any) -> None:
    _install(allocator)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = torch.nn.parallel.DistributedDataParallel(_mlp(torch), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for i, (x, y) in enumerate(_batches(torch, 16)):
        if i % 2 != rank:
            continue
        loss = loss_fn(model(x), y)
        loss.backward()   # NCCL all-reduce on its own stream, with record_stream on the buckets
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    figures = {}
    if allocator != "native":
        import gpumem.torch as gt

        st = gt.memory_stats(rank)
        figures = {k: st[k] for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "num_allocs")}
    queue.put((rank, _bits(losses), figures))
    dist.destroy_process_group()


def scenario_ddp(allocator: str) -> "dict[str, Any]":
    """DDP on two GPUs (NCCL): losses per rank and gpumem's figures per rank. Needs two GPUs."""
    import socket

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        return {"allocator": allocator, "skipped": f"DDP needs two GPUs; this machine has {torch.cuda.device_count()}"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(rank, allocator, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"DDP rank exited with {p.exitcode}")
    return {"allocator": allocator, "ranks": [{"rank": r, "losses": l, "gpumem": f} for r, l, f in got]}


SCENARIOS: "dict[str, Callable[[str], dict[str, Any]]]" = {
    name[len("scenario_"):]: fn for name, fn in list(globals().items()) if name.startswith("scenario_")}


def main(argv: "list[str]") -> int:
    if len(argv) != 2 or argv[0] not in SCENARIOS or argv[1] not in ALLOCATORS:
        print(f"usage: shim_child.py {{{','.join(SCENARIOS)}}} {{{','.join(ALLOCATORS)}}}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONHASHSEED", "0")
    result = SCENARIOS[argv[0]](argv[1])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
