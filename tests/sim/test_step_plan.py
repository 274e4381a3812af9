"""sim.step_plan: the planners never overlap two live allocations and never go under the most bytes live, the
period is found, a repeating trace is served from the plan with no driver call per steady step, and bad input
is refused with a specific error."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import open_device
from gpumem.allocator import CachingAllocator
from gpumem.errors import InvalidArgumentError, InvalidPointerError
from gpumem.trace import Trace
from sim import step_plan as sp

KiB = 1024
MiB = 1024 * KiB


@st.composite
def plan_items(draw: st.DrawFn) -> sp.PlanItems:
    """Items of a step of ``horizon`` op positions: one segment each, or two (one that wraps the boundary:
    from its alloc to the end, and from the start to its free, before its alloc)."""
    n = draw(st.integers(1, 40))
    horizon = draw(st.integers(2, 60))
    rows = []
    for _ in range(n):
        size = draw(st.integers(1, 64)) * 512
        if draw(st.booleans()) and horizon >= 3:
            a = draw(st.integers(1, horizon - 1))
            f = draw(st.integers(0, a))
            rows.append((size, a, horizon, 0, f))
        else:
            a = draw(st.integers(0, horizon - 1))
            e = draw(st.integers(a + 1, horizon))
            rows.append((size, a, e, 0, 0))
    cols = list(zip(*rows))
    return sp.PlanItems(*(np.array(c, dtype=np.int64) for c in cols))


def _alive(items: sp.PlanItems, i: int, t: int) -> bool:
    return bool(items.s1[i] <= t < items.e1[i] or items.s2[i] <= t < items.e2[i])


def _brute_overlaps(items: sp.PlanItems, offsets: np.ndarray) -> list[tuple[int, int]]:
    horizon = int(max(items.e1.max(), items.e2.max()))
    bad = []
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            together = any(_alive(items, i, t) and _alive(items, j, t) for t in range(horizon))
            apart = offsets[i] + items.nbytes[i] <= offsets[j] or offsets[j] + items.nbytes[j] <= offsets[i]
            if together and not apart:
                bad.append((i, j))
    return bad


def _brute_max_live(items: sp.PlanItems) -> int:
    horizon = int(max(items.e1.max(), items.e2.max()))
    return max(sum(int(items.nbytes[i]) for i in range(len(items)) if _alive(items, i, t)) for t in range(horizon))


@settings(max_examples=150, deadline=None)
@given(plan_items(), st.sampled_from(list(sp.Planner)))
def test_no_plan_overlaps_two_live_items_nor_goes_under_the_most_bytes_live(items: sp.PlanItems,
                                                                             planner: sp.Planner) -> None:
    offsets = sp.plan(items, planner)
    assert (offsets >= 0).all() and (offsets % 512 == 0).all()
    assert _brute_overlaps(items, offsets) == []
    sp.check_plan(items, offsets)   # the study's own check agrees
    assert items.max_live_nbytes() == _brute_max_live(items)
    assert sp.plan_height(items, offsets) >= items.max_live_nbytes()


def test_greedy_best_is_never_above_greedy_size() -> None:
    rng = np.random.default_rng(5)
    for _ in range(20):
        n = 60
        a = rng.integers(0, 100, n)
        e = a + rng.integers(1, 40, n)
        items = sp.PlanItems(rng.integers(1, 200, n) * 512, a, e, np.zeros(n), np.zeros(n))
        best = sp.plan_height(items, sp.plan(items, "greedy-best"))
        assert best <= sp.plan_height(items, sp.plan(items, "greedy-size"))


def test_check_plan_finds_an_overlap() -> None:
    items = sp.PlanItems([1024, 1024], [0, 1], [3, 4], [0, 0], [0, 0])
    with pytest.raises(InvalidArgumentError, match="items 0 and 1"):
        sp.check_plan(items, np.array([0, 512]))
    sp.check_plan(items, np.array([0, 1024]))
    # a wrapped item (alive at the step's end and again at its start) clashes with one alive at the start
    wrapped = sp.PlanItems([1024, 1024], [5, 0], [8, 2], [0, 0], [1, 0])
    with pytest.raises(InvalidArgumentError):
        sp.check_plan(wrapped, np.array([0, 0]))


@pytest.mark.parametrize("args, match", [
    (([0], [0], [1], [0], [0]), "sizes must be positive"),
    (([512], [3], [3], [0], [0]), "first segment"),
    (([512], [0], [1], [2], [1]), "second"),
    (([512, 512], [0], [1], [0], [0]), "one length"),
    (([512], [-1], [1], [0], [0]), "starts >= 0"),
])
def test_bad_items_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        sp.PlanItems(*(np.array(a) for a in args))


def test_an_unknown_planner_and_a_bad_offset_array_are_refused() -> None:
    items = sp.PlanItems([512], [0], [1], [0], [0])
    with pytest.raises(InvalidArgumentError, match="unknown planner"):
        sp.plan(items, "tetris")
    with pytest.raises(InvalidArgumentError, match="1 items"):
        sp.check_plan(items, np.array([0, 0]))
    with pytest.raises(InvalidArgumentError, match="negative"):
        sp.check_plan(items, np.array([-512]))


# -- the period and the steps -------------------------------------------------------------------------------


def test_the_period_of_a_repeated_step_after_a_warm_up_is_found() -> None:
    rng = np.random.default_rng(0)
    step = rng.integers(1, 50, 137)
    # a layer repeated inside the step must not be taken for the step
    step[20:40] = step[40:60] = step[60:80]
    sig = np.concatenate([rng.integers(100, 200, 300), np.tile(step, 6), rng.integers(100, 200, 11)])
    per = sp.find_period(sig)
    assert per is not None and per.period == 137
    assert per.run_start <= 300 and per.repeats >= 5.9


def test_no_period_in_a_sequence_that_never_repeats() -> None:
    assert sp.find_period(np.arange(1000)) is None
    assert sp.find_period(np.arange(5)) is None   # shorter than two windows


def test_bad_period_input_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="one-dimensional"):
        sp.find_period(np.zeros((4, 4)))
    with pytest.raises(InvalidArgumentError, match="k must be"):
        sp.find_period(np.zeros(100), k=0)


def _training_trace(n_steps: int = 10) -> Trace:
    """Weights, then ``n_steps`` steps: a batch, then the last step's gradients freed, activations freed in
    reverse order as each layer's gradient is made, optimizer state made in the first step only, the batch
    freed last. Fewest bytes are live between the gradients' free and the first activation, so the batch
    (allocated before that point, freed after it) wraps the step boundary."""
    ops: list[tuple] = []
    live: dict[int, tuple[int, int]] = {}
    next_id = [0]
    t = [0.0]

    def alloc(nbytes: int) -> int:
        aid = next_id[0]
        next_id[0] += 1
        live[aid] = (nbytes, 0x1000 * (aid + 1))
        t[0] += 1
        ops.append((0, aid, nbytes, 0, t[0], live[aid][1]))
        return aid

    def free(aid: int) -> None:
        nbytes, addr = live.pop(aid)
        t[0] += 1
        ops.append((1, aid, nbytes, 0, t[0], addr))

    layers = [(3 + i % 4) * MiB + 512 * i for i in range(8)]
    for w in layers:
        alloc(w)
    grads: list[int] = []
    for s in range(n_steps):
        batch = alloc(MiB)
        for g in grads:
            free(g)
        acts = [alloc(2 * w) for w in layers]
        tmp = alloc(5 * MiB)
        free(tmp)
        grads = []
        for a, w in zip(reversed(acts), reversed(layers)):
            grads.append(alloc(w))
            free(a)
        if s == 0:
            for w in layers:
                alloc(w)   # optimizer state, made once
        free(batch)
    return Trace.from_ops("synthetic-train", "recorded", ops)


def test_a_repeating_trace_is_planned_at_its_live_bytes_and_served_with_no_call_per_step() -> None:
    trace = _training_trace()
    life = sp.Lifetimes.of(trace)
    live = trace.live_nbytes()
    for kind in sp.Signature:
        row = sp.study_variant(trace, life, live, kind, "tuning")
        assert row.period == 1 + 8 + 1 + 8 and row.steps >= 6
        best = min(p.height_over_planned for p in row.plans)
        assert best == pytest.approx(0.0, abs=1e-9)
        assert row.serve, "the trace has enough steps to be served"
        for name, sv in row.serve.items():
            assert sv["calls_per_steady_step"] == 0 and sv["event_calls_per_steady_step"] == 0, name
            assert sv["planned_share"] > 0.4, name
            assert sv["occupied"] == 0, name


def test_split_steps_puts_the_boundary_where_the_fewest_bytes_are_live() -> None:
    trace = _training_trace()
    life = sp.Lifetimes.of(trace)
    live = trace.live_nbytes()
    per = sp.find_period(sp.signatures(life, sp.Signature.EXACT))
    steps = sp.split_steps(life, per, live)
    before = live[life.alloc_op[steps.starts] - 1]
    assert (before == before.min()).all()
    tmpl = sp.cut_template(life, steps, live, steps.n_steps - 2)
    # the batch wraps the boundary: alive at the step's end and again at its start, up to its free
    wraps = np.flatnonzero(tmpl.items.e2 > tmpl.items.s2)
    assert len(wraps) == 1 and tmpl.items.nbytes[wraps[0]] == MiB
    assert tmpl.items.e1[wraps[0]] == tmpl.step_ops and tmpl.items.s2[wraps[0]] == 0
    with pytest.raises(InvalidArgumentError, match="step must be"):
        sp.cut_template(life, steps, live, steps.n_steps - 1)


# -- the resource ------------------------------------------------------------------------------------------


def test_the_resource_refuses_bad_plans_and_unknown_pointers() -> None:
    with open_device("sim:h200-141gb") as dev:
        fb = CachingAllocator(dev)
        with pytest.raises(InvalidArgumentError, match="multiple of 2 MiB"):
            sp.PlanResource(fb, np.array([512]), np.array([0]), np.array([0]), 1000, sp.SyncMode.MARKED)
        with pytest.raises(InvalidArgumentError, match="past the arena"):
            sp.PlanResource(fb, np.array([4 * MiB]), np.array([0]), np.array([0]), 2 * MiB, sp.SyncMode.MARKED)
        with pytest.raises(InvalidArgumentError, match="one non-zero length"):
            sp.PlanResource(fb, np.array([512]), np.array([0, 1]), np.array([0]), 2 * MiB, sp.SyncMode.MARKED)
        res = sp.PlanResource(fb, np.array([MiB, MiB]), np.array([0, MiB]), np.array([0, 0]), 2 * MiB,
                              sp.SyncMode.MARKED)
        try:
            res.activate()
            with pytest.raises(InvalidArgumentError, match="already active"):
                res.activate()
            res.mark_step()
            a = res.allocate(MiB)
            b = res.allocate(MiB - 512)     # fits its slot (marked mode: at most the slot's size)
            assert (a, b) == (res.base, res.base + MiB)
            assert res.mapped_nbytes == 2 * MiB and res.count.planned == 2
            res.mark_step()
            c = res.allocate(MiB)           # slot 0's range is still held by `a`: the fallback serves it
            assert not res.base <= c < res.base + 2 * MiB and res.count.occupied == 1
            res.free(a)
            with pytest.raises(InvalidPointerError):
                res.free(a)
            before = (dataclasses.replace(res.count), res.cursor, res.mapped_nbytes)
            for bad in (0, -1, 1.5):
                with pytest.raises(InvalidArgumentError, match="positive int"):
                    res.allocate(bad)  # type: ignore[arg-type]
            assert (res.count, res.cursor, res.mapped_nbytes) == before   # bad input changes nothing
            res.free(b)
            res.free(c)
        finally:
            res.close()


def test_detect_mode_finds_its_place_again_after_a_mismatch() -> None:
    sizes = [(i + 1) * 512 for i in range(40)]
    with open_device("sim:h200-141gb") as dev:
        fb = CachingAllocator(dev)
        offs = np.cumsum([0] + sizes[:-1])
        res = sp.PlanResource(fb, np.array(sizes), offs, np.zeros(40, dtype=np.int64), 2 * MiB, sp.SyncMode.DETECT)
        try:
            res.activate()
            ptrs = [res.allocate(n) for n in sizes]    # not placed yet: a full window of the plan first
            assert res.count.resyncs == 1 and res.count.planned == 40 - res.window
            for p in ptrs:
                res.free(p)
            ptrs = [res.allocate(n) for n in sizes]    # in place: every slot from the plan
            assert res.count.planned == 80 - res.window
            for p in ptrs:
                res.free(p)
            res.free(res.allocate(12345))              # a stranger: the place is lost
            assert res.count.mismatched == 1 and res.cursor is None
        finally:
            res.close()


def test_the_cli_explains_itself_and_refuses_an_unknown_trace(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sp.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "python -m sim.step_plan" in out and "paged" in out
    with pytest.raises(SystemExit) as exc:
        sp.main(["--traces", "no_such_trace"])
    assert exc.value.code == 2
    assert "no corpus trace starts with no_such_trace" in capsys.readouterr().err


def test_size_classes_are_quarter_octaves_of_at_least_512_bytes() -> None:
    got = sp.size_class(np.array([1, 512, 513, 1024, 1025, 2 * MiB, 2 * MiB + 1, 3 * MiB + 5]))
    assert got.tolist() == [512, 512, 1024, 1024, 1536, 2 * MiB, 2 * MiB + MiB // 2, 3 * MiB + MiB // 2]
    sizes = np.arange(1, 200_000, 37)
    classes = sp.size_class(sizes)
    assert (classes >= sizes).all() and (classes % 512 == 0).all()
    big = sizes > 4096
    assert (classes[big] <= sizes[big] * 1.25 + 512).all()


def test_a_trace_whose_sizes_wobble_repeats_by_class_not_exactly() -> None:
    """Every step's sizes move by a few hundred bytes (a sequence length varying a little): the exact
    signature finds no whole-trace repeat, the class signature does and plans every step."""
    rng = np.random.default_rng(3)
    base = [int(x) + KiB for x in rng.integers(4, 60, 30) * 64 * KiB]   # inside a class, with room to wobble
    ops: list[tuple] = []
    aid = 0
    for step in range(8):
        ids = []
        for j, b in enumerate(base):
            n = b + int(rng.integers(0, 8)) * 512
            ops.append((0, aid, n, 0, float(len(ops)), 0x1000 * (aid + 1)))
            ids.append((aid, n))
            aid += 1
            if j % 3 == 2:   # free the oldest but one, so lifetimes overlap
                a, m = ids.pop(0)
                ops.append((1, a, m, 0, float(len(ops)), 0x1000 * (a + 1)))
        for a, m in ids:
            ops.append((1, a, m, 0, float(len(ops)), 0x1000 * (a + 1)))
    trace = Trace.from_ops("wobble", "recorded", ops)
    life = sp.Lifetimes.of(trace)
    live = trace.live_nbytes()
    exact = sp.find_period(sp.signatures(life, sp.Signature.EXACT))
    assert exact is None or exact.repeats < 3
    row = sp.study_variant(trace, life, live, sp.Signature.CLASS, "tuning")
    assert row.period == 30 and row.steps >= 7
    assert row.plans and all(p.height_over_planned >= 0 for p in row.plans)


def test_a_corpus_trace_round_trips_through_the_record(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The smallest served corpus trace, end to end: its record prints the same tables again."""
    out = tmp_path / "rec.json"
    assert sp.main(["--traces", "multistream_infer", "--signatures", "exact", "--json", str(out)]) == 0
    first = capsys.readouterr().out
    assert "multistream_infer_h200.snapshot.pickle | 31 / 9" in first
    assert sp.main(["--from-json", str(out)]) == 0
    assert capsys.readouterr().out == first
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        sp.main(["--from-json", str(bad)])
    assert exc.value.code == 2
    assert "cannot read" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(list(sp.SyncMode)))
def test_the_resource_never_hands_out_overlapping_live_ranges(data: st.DataObject, mode: sp.SyncMode) -> None:
    """Whatever the program does (sizes off the plan, frees in any order, steps marked anywhere), no two live
    allocations overlap and every arena allocation lies on mapped pages."""
    n_slots = data.draw(st.integers(1, 12))
    sizes = [data.draw(st.integers(1, 8)) * 256 * KiB for _ in range(n_slots)]
    # a plan where every slot overlaps every other in time: offsets side by side
    offs = np.cumsum([0] + [sp.round_up(s, 512) for s in sizes[:-1]])
    arena = sp.round_up(int(offs[-1]) + sizes[-1], sp.PAGE_NBYTES)
    with open_device("sim:h200-141gb") as dev:
        fb = CachingAllocator(dev)
        res = sp.PlanResource(fb, np.array(sizes), offs, np.zeros(n_slots, dtype=np.int64), arena, mode)
        live: dict[int, int] = {}
        try:
            res.activate()
            for _ in range(data.draw(st.integers(1, 60))):
                op = data.draw(st.sampled_from(["plan", "other", "free", "mark"]))
                if op == "mark":
                    res.mark_step()
                elif op == "free" and live:
                    p = data.draw(st.sampled_from(sorted(live)))
                    res.free(p)
                    del live[p]
                elif op in ("plan", "other"):
                    j = res.cursor if res.cursor is not None else data.draw(st.integers(0, n_slots - 1))
                    n = sizes[j] if op == "plan" else data.draw(st.integers(1, 3 * MiB))
                    p = res.allocate(n)
                    live[p] = sp.round_up(n, 512)
                    if res.base <= p < res.base + arena:
                        first, last = (p - res.base) // sp.PAGE_NBYTES, (p - res.base + n - 1) // sp.PAGE_NBYTES
                        assert all(res._mapped[pg] for pg in range(first, last + 1))
                spans = sorted(live.items())
                for (a, na), (b, _) in zip(spans, spans[1:]):
                    assert a + na <= b, "two live allocations overlap"
            for p in list(live):
                res.free(p)
        finally:
            res.close()


def _record() -> dict:
    sv = {k: 0.5 for k in sp._SERVE_FLOATS} | {k: 7 for k in sp._SERVE_INTS}
    base = sp.BaselineRow("tuning", "t", 1 << 20, 0.1, 0.2, 0.0, 0.0, 0.05, 1.0, 0.0, 3)
    row = sp.VariantRow("tuning", "t", "exact", 4, 3, 0.9, 0.9, 10, 1 << 20, 0, 1 << 19,
                        [sp.PlanFigures("first-fit", 1 << 19, 0.0, 0.1, 0.001)], {"after 2 steps, idle": sv})
    return {"device": "sim:h200-141gb", "baseline": [dataclasses.asdict(base)],
            "variants": [dataclasses.asdict(row)]}


def _bad(rec: dict, where: str, key: str, value: object) -> dict:
    rec[where][0][key] = value
    return rec


@pytest.mark.parametrize("mutate, match", [
    (lambda r: _bad(r, "baseline", "overhead_idle", "x"), r"baseline\[0\].overhead_idle: float expected, got str"),
    (lambda r: _bad(r, "baseline", "steady_steps", 2.5), r"baseline\[0\].steady_steps: int expected"),
    (lambda r: _bad(r, "baseline", "peak_live_nbytes", 10**30), "int of over 40 digits|int expected"),
    (lambda r: _bad(r, "baseline", "steady_steps", True), "int expected, got bool"),
    (lambda r: _bad(r, "variants", "serve", [1]), r"variants\[0\].serve: a JSON object expected, got list"),
    (lambda r: _bad(r, "variants", "serve", {"x": {}}), r"serve\['x'\]: missing overhead"),
    (lambda r: _bad(r, "variants", "serve", {"x": 1}), r"serve\['x'\]: a JSON object expected, got int"),
    (lambda r: _bad(r, "variants", "plans", {"a": 1}), r"plans: a JSON list expected, got dict"),
    (lambda r: _bad(r, "variants", "plans", [{"planner": "x"}]), r"plans\[0\]: missing height_nbytes"),
    (lambda r: _bad(r, "variants", "nonsense", 1), r"variants\[0\]: unknown nonsense"),
    (lambda r: {k: v for k, v in r.items() if k != "baseline"}, "baseline: a JSON list expected, got NoneType"),
    (lambda r: [r], "a JSON object expected, got list"),
])
def test_a_hostile_record_is_refused_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str], mutate,
                                                 match: str) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_record()))
    assert sp.main(["--from-json", str(good)]) == 0
    assert "| t |" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(mutate(_record())))
    with pytest.raises(SystemExit) as exc:
        sp.main(["--from-json", str(bad)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m sim.step_plan: error: --from-json: cannot read") and re.search(match, err)


def test_a_record_nested_too_deep_is_refused_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(SystemExit) as exc:
        sp.main(["--from-json", str(deep)])
    assert exc.value.code == 2 and "nested too deep" in capsys.readouterr().err


def test_a_json_target_that_cannot_be_written_is_refused_before_the_study(tmp_path, monkeypatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def no_study(*args: object, **kw: object) -> None:
        raise AssertionError("the study ran")

    monkeypatch.setattr(sp, "load_trace", no_study)
    for target, match in ((tmp_path, "is a folder"), (tmp_path / "no" / "r.json", "no folder")):
        with pytest.raises(SystemExit) as exc:
            sp.main(["--traces", "multistream_infer", "--json", str(target)])
        assert exc.value.code == 2 and match in capsys.readouterr().err


def test_the_engine_study_refuses_a_json_target_before_it_runs(tmp_path, monkeypatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from sim import step_plan_engine

    def no_study(*args: object, **kw: object) -> None:
        raise AssertionError("the study ran")

    monkeypatch.setattr(step_plan_engine, "load_trace", no_study)
    with pytest.raises(SystemExit) as exc:
        step_plan_engine.main(["--json", str(tmp_path)])
    assert exc.value.code == 2 and f"--json: {tmp_path} is a folder" in capsys.readouterr().err


def test_the_engine_study_checks_timings_and_traces_before_any_replay(tmp_path, monkeypatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Review attacker 8: a bad --timings failed after loading (or after the rows before it), a file that is no
    trace or a trace with no step to mark gave a traceback."""
    from sim import step_plan_engine

    def no_study(*args: object, **kw: object) -> None:
        raise AssertionError("the study ran")

    monkeypatch.setattr(step_plan_engine, "run", no_study)
    not_trace = tmp_path / "config.json"
    not_trace.write_text('{"model_type": "llama"}')
    no_steps = tmp_path / "t.gmt"
    no_steps.write_text('{"format": "gpumem-trace", "version": 1, "name": "t", "source": "gpumem", "n_ops": 2, '
                        '"n_allocs": 1, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}\n'
                        "a 0 512 0 1 1000\nf 0 0 2\n")
    for argv, message in ((["--timings", "idle,,model"], "--timings: unknown gpu timing ''"),
                          (["--timings", "foo"], "--timings: unknown gpu timing 'foo'"),
                          (["--traces", str(not_trace)], "--traces: ") ,
                          (["--traces", str(no_steps)], "--traces: t: no stretch repeats twice")):
        with pytest.raises(SystemExit) as exc:
            step_plan_engine.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err
