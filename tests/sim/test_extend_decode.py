"""sim.extend_decode: a short recorded decode extended to N tokens is the N-token decode, op for op; what is not
one template grown per token is refused with the op that differs."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError
from gpumem.trace import Trace, load_trace, save_trace
from gpumem.trace.model import StreamUse
from sim import extend_decode as ed

FIRST, GROWTH = 1 << 20, 256


def decode_ops(tokens: int, layers: int = 2, first: int = FIRST, growth: int = GROWTH, mask_growth: int = 8,
               bad_token: int | None = None, old_free_token: int | None = None, head_tail: bool = True,
               chained: bool = False, token1_extra: bool = False) -> list[tuple]:
    """A generate()-like trace: weights, a prefill making one cache tensor per layer, then tokens 1 .. tokens - 1
    (each cache tensor replaced by one ``growth`` larger, a mask growing by ``mask_growth``, a temporary, and
    logits freed in the next token), then the end (everything freed)."""
    ops: list[tuple] = []
    clock = [0.0]

    def alloc(nbytes: int) -> int:
        aid = sum(1 for o in ops if o[0] == 0)
        clock[0] += 3.0
        ops.append((0, aid, nbytes, 0, clock[0], 0))
        return aid

    def free(aid: int) -> None:
        clock[0] += 2.0
        ops.append((1, aid, sizes[aid], 0, clock[0], 0))

    sizes: dict[int, int] = {}

    def a(nbytes: int) -> int:
        aid = alloc(nbytes)
        sizes[aid] = nbytes
        return aid

    weights = a(64 << 20)
    scratch = a(3 << 20)
    free(scratch)
    if chained:   # the request before ended with caches one token short of this prompt's
        earlier = [a(first - growth) for _ in range(layers)]
        for e in earlier:
            free(e)
    cache = [a(first) for _ in range(layers)]
    logits = a(4000) if head_tail else None
    kept_from = {}
    for j in range(1, tokens):
        if head_tail:
            free(logits)
        if token1_extra and j == 1:
            kept_from["workspace"] = a(777)
        for layer in range(layers):
            new = a(first + growth * j + (1 if j == bad_token and layer == layers - 1 else 0))
            free(cache[layer])
            cache[layer] = new
            if head_tail:
                tmp = a(4096)
                mask = a(100 + mask_growth * j)
                free(tmp)
                free(mask)
        if old_free_token is not None and j == old_free_token:
            kept_from[j] = a(512)
        if old_free_token is not None and j == old_free_token + 2:
            free(kept_from[old_free_token])
        if head_tail:
            logits = a(4000)
    if head_tail:
        free(logits)
    if token1_extra:
        free(kept_from["workspace"])
    for c in cache:
        free(c)
    free(weights)
    return ops


def trace_of(ops: list[tuple], name: str = "decode") -> Trace:
    return Trace.from_ops(name, "test", ops)


def same_ops(a: Trace, b: Trace, n: int) -> bool:
    return all(np.array_equal(np.asarray(getattr(a, f))[:n], np.asarray(getattr(b, f))[:n])
               for f in ("kinds", "alloc_ids", "nbytes", "streams"))


def test_extended_is_the_long_decode_op_for_op():
    short, full = trace_of(decode_ops(12)), trace_of(decode_ops(60))
    ext = ed.extend_decode(short, 60, FIRST, GROWTH)
    assert 0 < ext.n_ops < full.n_ops
    assert same_ops(ext, full, ext.n_ops)
    assert np.all(np.diff(np.asarray(ext.times_us)) >= 0)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), recorded=st.integers(7, 14), tokens=st.integers(3, 70),
       growth=st.sampled_from([8, 256, 8192]), mask_growth=st.integers(0, 16))
def test_extension_matches_for_any_shape(layers, recorded, tokens, growth, mask_growth):
    short = trace_of(decode_ops(recorded, layers, growth=growth, mask_growth=mask_growth))
    full = trace_of(decode_ops(max(tokens, recorded), layers, growth=growth, mask_growth=mask_growth))
    ext = ed.extend_decode(short, tokens, FIRST, growth)
    assert same_ops(ext, full, ext.n_ops)
    assert ext.peak_live_nbytes <= full.peak_live_nbytes


def test_reading_the_recording():
    rec = ed.read_decode(trace_of(decode_ops(12)), FIRST, GROWTH)
    assert sorted(rec.starts) == list(range(1, 12)) and rec.template.token == 6 and rec.checked_tokens == 8


@pytest.mark.parametrize("kwargs, tokens, message", [
    (dict(first_nbytes=FIRST + 1, growth_nbytes=GROWTH), 50, "no allocation of --first-nbytes"),
    (dict(first_nbytes=FIRST, growth_nbytes=GROWTH + 8), 50, "need at least 6"),
    (dict(first_nbytes=0, growth_nbytes=GROWTH), 50, "first_nbytes must be"),
    (dict(first_nbytes=FIRST, growth_nbytes=True), 50, "growth_nbytes must be"),
    (dict(first_nbytes=FIRST, growth_nbytes=GROWTH), 2, "tokens must be"),
    (dict(first_nbytes=FIRST, growth_nbytes=GROWTH), ed.MAX_TOKENS + 1, "tokens must be"),
])
def test_bad_numbers_are_refused(kwargs, tokens, message):
    trace = trace_of(decode_ops(12))
    before = np.asarray(trace.nbytes).copy()
    with pytest.raises(InvalidArgumentError, match=message):
        ed.extend_decode(trace, tokens, **kwargs)
    assert np.array_equal(np.asarray(trace.nbytes), before)


def test_too_few_tokens_recorded():
    with pytest.raises(InvalidArgumentError, match="found 3 decode tokens"):
        ed.extend_decode(trace_of(decode_ops(4)), 50, FIRST, GROWTH)


def test_a_size_off_the_line_is_refused_with_its_op():
    with pytest.raises(InvalidArgumentError, match=r"not one template grown per token: op \d+ \(token 9"):
        ed.extend_decode(trace_of(decode_ops(12, bad_token=9)), 50, FIRST, GROWTH)


def test_a_free_of_an_older_token_is_refused():
    with pytest.raises(InvalidArgumentError, match="frees a block made before token|not the template's|ops, token"):
        ed.extend_decode(trace_of(decode_ops(14, old_free_token=4)), 50, FIRST, GROWTH)


def test_a_size_that_would_shrink_below_one_byte_is_refused():
    with pytest.raises(InvalidArgumentError, match="cannot be extended this far"):
        ed.extend_decode(trace_of(decode_ops(12, mask_growth=-8)), 50, FIRST, GROWTH)


def test_stream_uses_inside_the_decode_are_refused():
    t = trace_of(decode_ops(12))
    late = Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
                 stream_uses=(StreamUse(at_op=t.n_ops - 20, alloc_id=0, stream=7),))
    with pytest.raises(InvalidArgumentError, match="record_stream calls inside its decode"):
        ed.extend_decode(late, 50, FIRST, GROWTH)
    early = Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
                  stream_uses=(StreamUse(at_op=3, alloc_id=0, stream=7),))
    assert ed.extend_decode(early, 50, FIRST, GROWTH).stream_uses == early.stream_uses


# -- the command line ---------------------------------------------------------------------------------------------

@pytest.fixture
def short_file(tmp_path):
    path = tmp_path / "short.gmt.gz"
    save_trace(trace_of(decode_ops(12)), path)
    return path


def test_cli_extends_saves_and_replays(short_file, tmp_path, capsys):
    out, rows = tmp_path / "long.gmt.gz", tmp_path / "rows.json"
    argv = [str(short_file), "--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "40",
            "--out", str(out), "--replay", "idle,trace", "--json", str(rows)]
    assert ed.main(argv) == 0
    text = capsys.readouterr().out
    assert "11 decode tokens found, 8 checked against token 6" in text and "exact" in text
    saved = load_trace(out)
    assert same_ops(saved, trace_of(decode_ops(40)), saved.n_ops)
    data = json.loads(rows.read_text())
    assert [r["timing"] for r in data["rows"]] == ["idle", "trace"]
    assert all(r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] > 0 and r["ooms"] == 0 for r in data["rows"])


@pytest.mark.parametrize("extra, message", [
    (["--replay", "fast"], "GPU timings from"),
    (["--tokens", "2"], "must be from 3"),
    (["--first-nbytes", "x"], "whole number"),
])
def test_cli_bad_arguments(short_file, extra, message, capsys):
    argv = [str(short_file), "--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "40"]
    with pytest.raises(SystemExit) as exc:
        ed.main(argv + extra)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_refusals_in_one_line(short_file, tmp_path, capsys):
    base = ["--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "40"]
    before = short_file.read_bytes()
    cases = [
        ([str(tmp_path / "missing.gmt.gz")] + base, "missing.gmt.gz"),
        ([str(short_file)] + base + ["--out", str(short_file)], "overwrite the input"),
        ([str(short_file)] + base + ["--json", str(tmp_path)], "is a folder"),
        ([str(short_file)] + base + ["--out", str(tmp_path / "a.gmt.gz"), "--json", str(tmp_path / "a.gmt.gz")],
         "same file"),
        ([str(short_file), "--first-nbytes", "12345", "--growth-nbytes", str(GROWTH), "--tokens", "40"],
         "no allocation of --first-nbytes"),
    ]
    for argv, message in cases:
        assert ed.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert short_file.read_bytes() == before


# -- found by review (attacker 18) ------------------------------------------------------------------------------

def _token_one_short_ops(tokens: int = 12) -> list[tuple]:
    """Token 1 is one allocation; tokens 2.. make x and y and free the token before's y (x at token 2)."""
    F, G = 1 << 20, 256
    ops, ids = [], {}

    def a(key, nbytes):
        aid = len(ids)
        ids[key] = (aid, nbytes)
        ops.append((0, aid, nbytes, 0, float(len(ops)), 0))

    def f(key):
        aid, nbytes = ids[key]
        ops.append((1, aid, nbytes, 0, float(len(ops)), 0))

    a("w", 1 << 26)
    a("c0", F)
    a(("c", 1), F + G)
    for j in range(2, tokens):
        a(("c", j), F + j * G)
        a(("x", j), 100)
        a(("y", j), 200)
        f(("x", j) if j == 2 else ("y", j - 1))
    return ops


def test_a_token_one_shorter_than_the_template_is_extended_not_crashed():
    # tokens 1 and 2 are kept as recorded (token 2 frees its own x), the later ones made from the template
    ext = ed.extend_decode(trace_of(_token_one_short_ops()), 20, 1 << 20, 256)
    assert same_ops(ext, trace_of(_token_one_short_ops(20)), ext.n_ops)


def test_a_growth_twice_the_real_one_is_refused():
    with pytest.raises(InvalidArgumentError, match="is --growth-nbytes 2 times"):
        ed.extend_decode(trace_of(decode_ops(24)), 40, FIRST, 2 * GROWTH)


def test_a_first_size_of_a_decode_token_is_refused():
    with pytest.raises(InvalidArgumentError, match="looks like a decode token's size"):
        ed.extend_decode(trace_of(decode_ops(24)), 40, FIRST + 3 * GROWTH, GROWTH)


def test_too_many_operations_are_refused_before_building(monkeypatch):
    monkeypatch.setattr(ed, "MAX_OPS", 1000)
    with pytest.raises(InvalidArgumentError, match="more than"):
        ed.extend_decode(trace_of(decode_ops(12)), 100, FIRST, GROWTH)


def test_sizes_that_would_pass_2_62_are_refused():
    with pytest.raises(InvalidArgumentError, match="too large"):
        ed.extend_decode(trace_of(decode_ops(12, growth=1 << 45)), 300_000, FIRST, 1 << 45)


def test_zero_byte_allocations_are_kept():
    ops = decode_ops(12, mask_growth=0)
    ops = [(k, i, 0 if n == 100 else n, s, t, a) for k, i, n, s, t, a in ops]   # the mask: 0 bytes each token
    ext = ed.extend_decode(trace_of(ops), 30, FIRST, GROWTH)
    assert int(np.count_nonzero(np.asarray(ext.nbytes) == 0)) > 0


def test_numpy_integers_are_accepted():
    ext = ed.extend_decode(trace_of(decode_ops(12)), np.int64(30), np.int64(FIRST), np.int32(GROWTH))
    assert same_ops(ext, trace_of(decode_ops(30)), ext.n_ops)


def test_events_after_the_last_token_are_left_out_with_it():
    t = trace_of(decode_ops(12))
    from gpumem.trace.model import PlanEvent, PlanEventKind
    tail = Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
                 plan_events=(PlanEvent(at_op=t.n_ops, kind=PlanEventKind.MARK),))
    assert ed.extend_decode(tail, 30, FIRST, GROWTH).plan_events == ()


def test_cli_never_writes_over_its_input(short_file, tmp_path, capsys):
    base = [str(short_file), "--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "40"]
    before = short_file.read_bytes()
    sym, hard = tmp_path / "sym.json", tmp_path / "hard.json"
    sym.symlink_to(short_file)
    import os
    os.link(short_file, hard)
    for argv in (base + ["--json", str(short_file)], base + ["--json", str(sym)], base + ["--json", str(hard)],
                 base + ["--out", str(sym.with_name("x.gmt.gz")), "--json", str(hard)]):
        assert ed.main(argv) == 2
        err = capsys.readouterr().err
        assert "overwrite the input" in err and err.count("\n") == 1
    assert short_file.read_bytes() == before


def test_cli_refuses_bad_policy_and_out_name_before_work(short_file, tmp_path, capsys):
    base = [str(short_file), "--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "40"]
    out = tmp_path / "x.gmt.gz"
    assert ed.main(base + ["--out", str(out), "--replay", "idle", "--policy", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err and not out.exists()
    assert ed.main(base + ["--out", str(tmp_path / "x.csv")]) == 2
    assert "name it .gmt or .gmt.gz" in capsys.readouterr().err


def test_cli_cpu_op_us(short_file, tmp_path, capsys):
    rows = tmp_path / "rows.json"
    base = [str(short_file), "--first-nbytes", str(FIRST), "--growth-nbytes", str(GROWTH), "--tokens", "30",
            "--replay", "trace", "--json", str(rows)]
    assert ed.main(base + ["--cpu-op-us", "10"]) == 0
    assert json.loads(rows.read_text())["rows"][0]["cpu_op_us"] == 10.0
    assert ed.main(base + ["--cpu-op-us", "-1"]) == 2
    assert "cpu_op_us" in capsys.readouterr().err


# -- found by review (attacker 20): false refusals --------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(layers=1, head_tail=False),      # a token of one layer's two cache updates: no identical tokens in it
    dict(layers=3, head_tail=False),      # identical layers, nothing else
    dict(chained=True),                   # the request before ended one token short of this prompt
    dict(token1_extra=True),              # the first decode step makes a workspace the later ones keep
])
def test_real_decodes_are_not_refused(kwargs):
    short, full = trace_of(decode_ops(12, **kwargs)), trace_of(decode_ops(50, **kwargs))
    ext = ed.extend_decode(short, 50, FIRST, GROWTH)
    assert same_ops(ext, full, ext.n_ops) and ext.n_ops > short.n_ops
