"""Extend a recorded short ``generate()`` decode to thousands of tokens, for replays of a decode too long to record.

A 7B decode of 4,500 tokens makes 13 million allocator operations; recording them on the GPU machine outlasts the
device tool's time for one call (``reports/hil/long-decode-sdpa-h200-2026-11-29.md``). But every decode token of a
Hugging Face ``generate()`` with a ``DynamicCache`` makes the same operations, in the same order, freeing the same
blocks, with sizes that grow by a fixed number of bytes per token (the KV cache's ``torch.cat`` results by one
token's row, an attention mask or score row by a few bytes). So a short recording (a few dozen tokens) holds the
whole decode:

1. the decode's tokens are found in the trace's last request: token ``j`` starts at the first allocation of
   ``--first-nbytes + j * --growth-nbytes`` after the last allocation of ``--first-nbytes`` (the cache tensor
   the prefill made; e.g. Llama-7B, prompt 2048: ``16777216`` and ``8192``);
2. every recorded token from 3 to the second-to-last is checked against a template token (the middle one):
   the same kinds of operations, each free of a block made in the same token or the one before at the same
   place, and each size the template's plus a fixed growth per token (learnt from the template and the token
   before it). One difference anywhere stops the tool with the first op that differs: the model is exact on
   the recording or not used;
3. the trace is kept up to the start of token 3 (so tokens 1 and 2, which may differ, are as recorded) and
   continued with tokens 3 to ``--tokens - 1`` made from the template, each op's clock advanced by the
   template's gap (so ``--gpu-timing trace`` paces it as recorded). A token runs from one cache update of the
   first layer to the next, so the last one made ends with the few operations that begin a next forward pass
   (the embedding, masks), which ``generate()`` does not run; they come after the last token's peak. The last
   recorded token's tail (``generate()``'s end) is not kept. Every made token takes the template's
   time: a recording whose pace drifts (the 7B SDPA decode's tokens took 39-112 ms) is paced at its middle
   token's.

What is refused, each in one line: a token that is not the template grown (the first op that differs is named), a
token made of identical parts (``--growth-nbytes`` a multiple of the real growth), a ``--first-nbytes`` that is a
decode token's size rather than the prefill's, a free of a block older than the token before, ``record_stream``,
wait or step-plan events inside the decode, sizes that would shrink below 1 byte or pass 2**62, and more than
:data:`MAX_OPS` operations.

Then ``--out`` saves it (any trace format :func:`gpumem.trace.save_trace` writes; 13 million operations take about
two minutes) and ``--replay`` replays it at once under each listed GPU timing, one line each::

    python -m sim.extend_decode short.gmt.gz --first-nbytes 16777216 --growth-nbytes 8192 --tokens 4500 \\
        --replay idle,trace
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpumem.errors import GpumemError, InvalidArgumentError
from gpumem.sim.gpu_work import GpuWorkModel
from gpumem.trace import Trace, load_trace, save_trace

log = logging.getLogger(__name__)

ALLOC, FREE = 0, 1
MAX_TOKENS = 1_000_000
"""Tokens ``--tokens`` may ask for (a 7B decode makes about 2,900 operations per token)."""
FIRST_MADE = 3
"""The first decode token made from the template: tokens 1 and 2 are kept as recorded (the first decode steps may
make what later ones do not, e.g. a workspace)."""
MAX_OPS = 200_000_000
"""Operations an extended trace may have: building one takes about 60 bytes per operation (12 GB here)."""


@dataclass(frozen=True)
class DecodeTemplate:
    """One decode token's operations, with what changes from one token to the next."""

    kinds: tuple[int, ...]
    nbytes: tuple[int, ...]
    """Each op's size at :attr:`token` (a free's: its block's)."""
    growth_nbytes: tuple[int, ...]
    """Each allocation's growth per token (0 for frees)."""
    free_refs: tuple[tuple[bool, int], ...]
    """Per op: for a free, ``(made in the token before, offset of its allocation there or in this token)``;
    ``(False, -1)`` for an allocation."""
    streams: tuple[int, ...]
    gaps_us: tuple[float, ...]
    """Each op's clock less the op before it."""
    token: int


@dataclass(frozen=True)
class DecodeRecording:
    """Where the tokens of a trace's last decode start (op indices), and the checked template."""

    starts: dict[int, int]
    template: DecodeTemplate
    checked_tokens: int


def _token_starts(kinds: np.ndarray, nbytes: np.ndarray, first_nbytes: int,
                  growth_nbytes: int) -> tuple[int, dict[int, int]]:
    """The op of the last allocation of ``first_nbytes`` (the prefill's cache tensor), and each token's first op."""
    allocs = np.nonzero((kinds == ALLOC) & (nbytes == first_nbytes))[0]
    if not len(allocs):
        raise InvalidArgumentError(f"no allocation of --first-nbytes {first_nbytes} in the trace: give the size "
                                   "of one cache tensor right after the prefill (e.g. Llama-7B, prompt 2048, bf16: "
                                   "2048 * 4096 * 2 = 16777216)")
    starts: dict[int, int] = {}
    j = 1
    anchor = int(allocs[-1])
    for i in range(anchor + 1, len(kinds)):
        if kinds[i] == ALLOC and nbytes[i] == first_nbytes + j * growth_nbytes:
            starts[j] = i
            j += 1
    return anchor, starts


def _template(kinds: np.ndarray, nbytes: np.ndarray, ids: np.ndarray, times_us: np.ndarray, streams: np.ndarray,
              starts: dict[int, int], token: int) -> DecodeTemplate:
    a, b, prev = starts[token], starts[token + 1], starts[token - 1]
    made: dict[int, int] = {}
    for i in range(prev, b):
        if kinds[i] == ALLOC:
            made[int(ids[i])] = i
    refs: list[tuple[bool, int]] = []
    growth: list[int] = []
    sizes: list[int] = []
    for i in range(a, b):
        if kinds[i] == ALLOC:
            refs.append((False, -1))
            growth.append(int(nbytes[i]) - int(nbytes[prev + i - a]) if kinds[prev + i - a] == ALLOC else 0)
        else:
            w = made.get(int(ids[i]))
            if w is None or w >= i:
                raise InvalidArgumentError(f"op {i} (token {token}) frees a block made before token {token - 1}: "
                                           "not a decode this tool can extend")
            refs.append((w < a, w - (prev if w < a else a)))
            growth.append(0)
        sizes.append(int(nbytes[i]))
    gaps = [float(times_us[i]) - float(times_us[i - 1]) for i in range(a, b)]
    return DecodeTemplate(tuple(int(k) for k in kinds[a:b]), tuple(sizes), tuple(growth), tuple(refs),
                          tuple(int(x) for x in streams[a:b]), tuple(gaps), token)


def _mismatch(kinds: np.ndarray, nbytes: np.ndarray, ids: np.ndarray, streams: np.ndarray, starts: dict[int, int],
              template: DecodeTemplate, token: int) -> str:
    """Why ``token`` of the recording is not the template moved to ``token``, or ``""``."""
    a, b, prev = starts[token], starts[token + 1], starts[token - 1]
    if b - a != len(template.kinds):
        return f"token {token} has {b - a} ops, token {template.token} {len(template.kinds)}"
    shift = token - template.token
    for off in range(b - a):
        i = a + off
        if int(kinds[i]) != template.kinds[off] or int(streams[i]) != template.streams[off]:
            return f"op {i} (token {token}, op {off} of it): not the template's kind or stream"
        if kinds[i] == ALLOC:
            want = template.nbytes[off] + template.growth_nbytes[off] * shift
            if int(nbytes[i]) != want:
                return f"op {i} (token {token}, op {off} of it): {int(nbytes[i])} bytes, the template grown gives {want}"
        else:
            before, where = template.free_refs[off]
            j = (prev if before else a) + where
            if not (0 <= where and j < (a if before else i) and kinds[j] == ALLOC and ids[j] == ids[i]):
                return f"op {i} (token {token}, op {off} of it): frees another block than the template's"
    return ""


def _repeats(t: DecodeTemplate) -> int:
    """How many decode tokens ``t`` holds (1: one): ``k`` tokens of ``d`` ops when every op has the kind and stream of
    the op ``d`` before it, a free frees the block made as far back, and every allocation is larger than the one
    ``d`` before by ``1/k`` of its growth (a model's identical layers are as large as each other: not tokens)."""
    n = len(t.kinds)
    back = [0 if k == ALLOC else (i + n - w if before else i - w)
            for i, (k, (before, w)) in enumerate(zip(t.kinds, t.free_refs))]
    for d in range(1, n // 2 + 1):
        if n % d:
            continue
        k = n // d
        if all(t.kinds[i] == t.kinds[i - d] and t.streams[i] == t.streams[i - d] and back[i] == back[i - d]
               and (t.kinds[i] != ALLOC or (t.growth_nbytes[i] % k == 0
                                            and t.nbytes[i] - t.nbytes[i - d] == t.growth_nbytes[i] // k))
               for i in range(d, n)):
            return k
    return 1


def _token_before(kinds: np.ndarray, nbytes: np.ndarray, streams: np.ndarray, first: int, t: DecodeTemplate) -> bool:
    """Whether the ops just before token 1 (at ``first``) are the template grown back to token 0: the kinds, streams
    and allocation sizes of a decode token (then the size given as the prefill's is a decode token's)."""
    lo = first - len(t.kinds)
    if lo < 0:
        return False
    shift = -t.token
    for off in range(len(t.kinds)):
        i = lo + off
        if int(kinds[i]) != t.kinds[off] or int(streams[i]) != t.streams[off]:
            return False
        if kinds[i] == ALLOC and int(nbytes[i]) != t.nbytes[off] + t.growth_nbytes[off] * shift:
            return False
    return True


def read_decode(trace: Trace, first_nbytes: int, growth_nbytes: int) -> DecodeRecording:
    """Find and check the decode of ``trace``'s last request (module docstring, points 1 and 2).

    Raises:
        InvalidArgumentError: too few tokens found (at least 6 are needed), or a token that is not the template's.
    """
    kinds, nbytes, ids = np.asarray(trace.kinds), np.asarray(trace.nbytes), np.asarray(trace.alloc_ids)
    streams = np.asarray(trace.streams)
    anchor, starts = _token_starts(kinds, nbytes, first_nbytes, growth_nbytes)
    if len(starts) < 6:
        raise InvalidArgumentError(f"found {len(starts)} decode tokens after the last allocation of "
                                   f"{first_nbytes} bytes (op {anchor:,} of {len(kinds):,}), need at least 6: record "
                                   f"more tokens, or check --first-nbytes and --growth-nbytes ({growth_nbytes})")
    last = max(starts)   # its end is not known: tokens 3 .. last - 1 are whole (1 and 2 may differ)
    token = (2 + last) // 2
    template = _template(kinds, nbytes, ids, np.asarray(trace.times_us), streams, starts, token)
    parts = _repeats(template)
    if parts > 1:
        raise InvalidArgumentError(f"each token found is {parts} decode tokens ({len(template.kinds) // parts:,} ops "
                                   f"each, sizes growing by 1/{parts} of the growth): is --growth-nbytes {parts} times "
                                   "the growth of one token?")
    if _token_before(kinds, nbytes, streams, starts[1], template):
        raise InvalidArgumentError(
            f"the {len(template.kinds):,} ops before the first token found are a decode token too (the template "
            "grown back one token): --first-nbytes looks like a decode token's size, not the size the prefill made")
    for j in range(FIRST_MADE, last):
        why = _mismatch(kinds, nbytes, ids, streams, starts, template, j)
        if why:
            raise InvalidArgumentError(f"the recorded decode is not one template grown per token: {why}")
    return DecodeRecording(starts, template, last - FIRST_MADE)


def _whole_number(name: str, value: object, low: int, high: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a whole number, got {value!r}") from None
    if number < low or (high is not None and number > high):
        raise InvalidArgumentError(f"{name} must be from {low:,}" + (f" to {high:,}" if high else "") + f", got {number:,}")
    return number


def extend_decode(trace: Trace, tokens: int, first_nbytes: int, growth_nbytes: int) -> Trace:
    """``trace`` up to its decode's token 3, then tokens 3 .. ``tokens - 1`` from the checked template
    (module docstring, point 3): a trace of a ``generate()`` of ``tokens`` new tokens.

    Raises:
        InvalidArgumentError: bad numbers, or a recording :func:`read_decode` refuses.
    """
    first_nbytes = _whole_number("first_nbytes", first_nbytes, 1)
    growth_nbytes = _whole_number("growth_nbytes", growth_nbytes, 1)
    tokens = _whole_number("tokens", tokens, 3, MAX_TOKENS)
    return extend_recording(trace, read_decode(trace, first_nbytes, growth_nbytes), tokens)


def extend_recording(trace: Trace, rec: DecodeRecording, tokens: int) -> Trace:
    """:func:`extend_decode` of a decode :func:`read_decode` has already read from ``trace``."""
    tokens = _whole_number("tokens", tokens, 3, MAX_TOKENS)
    t = rec.template
    head = rec.starts[FIRST_MADE]
    tail = rec.starts[max(rec.starts)]   # the last recorded token's start: from there on, not kept
    named = (("record_stream calls", trace.stream_uses), ("stream waits", trace.stream_waits),
             ("step-plan events", trace.plan_events))
    inside = [name for name, events in named if any(head < e.at_op <= tail for e in events)]
    if inside:
        raise InvalidArgumentError(f"the trace has {' and '.join(inside)} inside its decode: not extended (a decode "
                                   "token of generate() makes none)")
    dropped = sum(e.at_op > tail for _, events in named for e in events)
    if dropped:
        log.info("%d record_stream, wait or step-plan events after the last recorded token are left out with it", dropped)
    kinds = np.asarray(trace.kinds)[:head]
    ids = np.asarray(trace.alloc_ids)[:head]
    n_head_allocs = int(np.count_nonzero(kinds == ALLOC))
    if n_head_allocs and int(ids[kinds == ALLOC].max()) != n_head_allocs - 1:
        raise InvalidArgumentError("the trace's allocation ids are not dense from 0")
    period, n_new = len(t.kinds), max(0, tokens - FIRST_MADE)
    total = head + period * n_new
    if total > MAX_OPS:
        raise InvalidArgumentError(f"{tokens:,} tokens make {total:,} operations ({period:,} per token), more than "
                                   f"{MAX_OPS:,} (about {MAX_OPS * 60 // 10**9} GB to build): ask for fewer tokens")
    for off, (kind, base, grow) in enumerate(zip(t.kinds, t.nbytes, t.growth_nbytes)):
        if kind != ALLOC or not grow:
            continue
        for j in (FIRST_MADE, max(FIRST_MADE, tokens - 1)):   # sizes are linear in j: the ends bound them
            size = base + grow * (j - t.token)
            if size < 1:
                raise InvalidArgumentError(f"token {j}: op {off} of the token would allocate {size} bytes (it shrinks "
                                           f"by {-grow} per token): the decode cannot be extended this far")
            if size >= 1 << 62:
                raise InvalidArgumentError(f"token {j}: op {off} of the token would allocate {size:,} bytes: too large")
    out_kinds = np.empty(total, dtype=np.asarray(trace.kinds).dtype)
    out_ids = np.empty(total, dtype=np.asarray(trace.alloc_ids).dtype)
    out_nbytes = np.empty(total, dtype=np.asarray(trace.nbytes).dtype)
    out_times = np.empty(total, dtype=np.asarray(trace.times_us).dtype)
    out_streams = np.empty(total, dtype=np.asarray(trace.streams).dtype)
    out_streams[:head] = np.asarray(trace.streams)[:head]
    out_kinds[:head], out_ids[:head] = kinds, ids
    out_nbytes[:head] = np.asarray(trace.nbytes)[:head]
    out_times[:head] = np.asarray(trace.times_us)[:head]
    # the ids and start of the token before (the recording's token 2 for the first one made)
    prev_ids = np.asarray(trace.alloc_ids)[rec.starts[FIRST_MADE - 1]:head].astype(np.int64)
    prev_lo = rec.starts[FIRST_MADE - 1]
    t_kinds = np.asarray(t.kinds)
    is_alloc = t_kinds == ALLOC
    n_allocs = int(np.count_nonzero(is_alloc))
    alloc_rank = np.cumsum(is_alloc) - 1          # an allocation's rank among the token's allocations
    base_nbytes = np.asarray(t.nbytes, dtype=np.int64)
    growth = np.asarray(t.growth_nbytes, dtype=np.int64)
    free_offs = [off for off in range(period) if not is_alloc[off]]
    gaps = np.cumsum(np.asarray(t.gaps_us, dtype=np.float64))
    clock = float(out_times[head - 1])
    next_id = n_head_allocs
    for j in range(FIRST_MADE, tokens):
        lo = head + (j - FIRST_MADE) * period
        cur = np.full(period, -1, dtype=np.int64)
        cur[is_alloc] = next_id + alloc_rank[is_alloc]
        sizes = base_nbytes + growth * (j - t.token)
        for off in free_offs:   # a free's size is its block's
            before, where = t.free_refs[off]
            cur[off] = prev_ids[where] if before else cur[where]
            sizes[off] = out_nbytes[prev_lo + where] if before else sizes[where]
        out_kinds[lo:lo + period] = t_kinds
        out_ids[lo:lo + period] = cur
        out_nbytes[lo:lo + period] = sizes
        out_streams[lo:lo + period] = t.streams
        out_times[lo:lo + period] = clock + gaps
        clock += float(gaps[-1])
        prev_ids, prev_lo = cur, lo
        next_id += n_allocs
    keep = lambda events: tuple(e for e in events if e.at_op <= head)  # noqa: E731
    return Trace(f"{trace.name}, decode extended to {tokens} tokens", "extend_decode", out_kinds, out_ids,
                 out_nbytes, out_streams, out_times, np.zeros(total, dtype=np.asarray(trace.addrs).dtype),
                 stream_uses=keep(trace.stream_uses), stream_waits=keep(trace.stream_waits),
                 plan_events=keep(trace.plan_events))


TIMINGS = ("idle", "model", "trace")


def _timings(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TIMINGS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"GPU timings from {', '.join(TIMINGS)}, comma-separated; got {text!r}")
    return names


def _whole(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be from {low:,}" + (f" to {high:,}" if high else "")
                                             + f", got {value:,}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.extend_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a recorded trace whose last request is a short generate() decode")
    p.add_argument("--first-nbytes", type=_whole(1), required=True,
                   help="bytes of one KV-cache tensor right after the prefill (batch * prompt * kv heads * head dim "
                        "* element bytes)")
    p.add_argument("--growth-nbytes", type=_whole(1), required=True,
                   help="bytes that tensor grows by per token (batch * kv heads * head dim * element bytes)")
    p.add_argument("--tokens", type=_whole(3, MAX_TOKENS), required=True,
                   help="new tokens of the extended decode (the request's max_new_tokens)")
    p.add_argument("--format", help="force the input's trace format (a name gpumem.trace.load_trace knows; default: "
                                    "from the file)")
    p.add_argument("--out", type=Path, help="save the extended trace here, in gpumem's trace format (a name ending in "
                                            ".gmt, or .gmt.gz for gzip)")
    p.add_argument("--replay", type=_timings, default=(),
                   help="replay the extended trace under these GPU timings (comma-separated: idle, model, trace)")
    p.add_argument("--cpu-op-us", type=float, default=None,
                   help="the simulated CPU's time per operation under the model and trace timings "
                        "(GpuWorkModel.cpu_op_us; default: the model's own, 4)")
    p.add_argument("--policy", default="gpumem", help="allocator policy of the replays (default gpumem)")
    p.add_argument("--device", default="sim:h200-141gb", help="simulated device of the replays (sim:h200-141gb)")
    p.add_argument("--json", type=Path, help="also write the replays' rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problem = _output_problem(args)
    if problem:
        print(f"extend_decode: {problem}", file=sys.stderr)
        return 2
    try:
        gpu_model = None if args.cpu_op_us is None else GpuWorkModel(cpu_op_us=args.cpu_op_us)
        if args.replay:   # a bad policy or device is refused before minutes of work, not after
            from gpumem.allocator import make_allocator
            from gpumem.specs import open_device

            with open_device(args.device) as dev:
                make_allocator(dev, args.policy).close()
        trace = load_trace(args.trace, args.format)
        rec = read_decode(trace, args.first_nbytes, args.growth_nbytes)
        print(f"{args.trace.name}: {len(rec.starts)} decode tokens found, {rec.checked_tokens} checked against token "
              f"{rec.template.token} ({len(rec.template.kinds):,} ops per token): exact", flush=True)
        extended = extend_recording(trace, rec, args.tokens)
        print(extended.summary(), flush=True)
        if args.out is not None:
            save_trace(extended, args.out)
            print(f"saved {args.out}", flush=True)
        rows = []
        if args.replay:
            from gpumem.replay import replay_trace

            print(f"{'timing':<7} {'peak allocated':>15} {'peak reserved':>15} {'overhead':>9} {'device calls':>13} "
                  f"{'event calls':>12} {'wall s':>7}")
            for timing in args.replay:
                r = replay_trace(extended, args.device, args.policy, gpu_timing=timing, gpu_model=gpu_model)
                row = {"timing": timing, "policy": args.policy, "device": args.device, "tokens": args.tokens,
                       "cpu_op_us": (gpu_model or GpuWorkModel()).cpu_op_us,
                       "peak_allocated_bytes": r.stats.peak_allocated_nbytes,
                       "peak_reserved_bytes": r.peak_reserved_bytes, "overhead": r.overhead,
                       "device_calls": r.stats.device_calls, "event_calls": r.stats.event_calls,
                       "ooms": r.ooms, "wall_s": round(r.wall_s, 3)}
                rows.append(row)
                print(f"{timing:<7} {row['peak_allocated_bytes']:>15,} {row['peak_reserved_bytes']:>15,} "
                      f"{r.overhead:>9.3%} {row['device_calls']:>13,} {row['event_calls']:>12,} {r.wall_s:>7.1f}"
                      + (f"  ({r.ooms} allocations failed)" if r.ooms else ""), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps({"trace": args.trace.name, "first_nbytes": args.first_nbytes,
                                             "growth_nbytes": args.growth_nbytes, "rows": rows}, indent=1) + "\n")
    except (GpumemError, OSError, ValueError) as exc:
        print(f"extend_decode: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("extend_decode: out of host memory building the trace: ask for fewer --tokens", file=sys.stderr)
        return 2
    return 0


def _output_problem(args: argparse.Namespace) -> str:
    """Why ``--out``/``--json`` cannot be written, or ``""``; checked before any work (links and hard links too)."""
    from sim.cli_checks import json_target_problem, same_file

    if args.out is not None and not (args.out.name.endswith(".gmt") or args.out.name.endswith(".gmt.gz")):
        return f"--out {args.out}: the extended trace is saved in gpumem's format: name it .gmt or .gmt.gz"
    for flag, target in (("--out", args.out), ("--json", args.json)):
        if target is None:
            continue
        if same_file(target, args.trace):
            return f"{flag} {target} would overwrite the input trace"
        why = json_target_problem(target)
        if why:
            return why
    if args.out is not None and args.json is not None and same_file(args.out, args.json):
        return "--out and --json name the same file"
    return ""


if __name__ == "__main__":
    sys.exit(main())
