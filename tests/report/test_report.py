"""``gpumem report``: the files, the numbers (equal to a plain replay's), every trace format, a PyTorch snapshot
the project never saw, bad traces (a clear error and nothing written), reproducibility."""

import gzip
import json
import os
import pickle
import random

import pytest

from gpumem.cli import main
from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import replay_trace
from gpumem.report import ReportExistsError, ReportOptions, build_report
from gpumem.trace import load_trace, save_trace, write_rmm_log

pytest.importorskip("matplotlib")

MiB = 1 << 20
DEVICE = "sim:rtx-3060-12gb"
POLICIES = ("pytorch", "expandable", "gpumem")
SITES = {  # function, file, line -> sizes it allocates
    ("forward", "models/net.py", 41): (48 * MiB, 96 * MiB),
    ("attention", "models/net.py", 77): (3 * MiB, 5 * MiB),
    ("load_batch", "train/data.py", 12): (700_000, 900_000),
}


def _frames(name, filename, line):
    # innermost first, as PyTorch writes them: PyTorch's own frames first, then the model's
    return [{"name": "_call_impl", "filename": "site-packages/torch/nn/modules/module.py", "line": 1790},
            {"name": name, "filename": filename, "line": line},
            {"name": "main", "filename": "train/run.py", "line": 5}]


def make_snapshot(path, steps=6, seed=7, scale=1):
    """A PyTorch memory snapshot written the way PyTorch writes one (a gzipped pickle of plain containers),
    with stack frames: a training-like loop whose largest live tensors come from ``forward``."""
    rng = random.Random(seed)
    entries = []
    addr = 0x7F0000000000
    t = 1_000_000
    live = []
    for _ in range(steps):
        for (name, filename, line), (lo, hi) in SITES.items():
            for _ in range(rng.randint(3, 6)):
                size = rng.randrange(lo, hi, 512) * scale
                addr += 1 << 28
                t += rng.randint(5, 50)
                entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t,
                                "frames": _frames(name, filename, line)})
                live.append((addr, size))
        rng.shuffle(live)
        while len(live) > 6:
            a, s = live.pop()
            t += rng.randint(5, 50)
            entries.append({"action": "free_requested", "addr": a, "size": s, "stream": 0, "time_us": t,
                            "frames": []})
            entries.append({"action": "free_completed", "addr": a, "size": s, "stream": 0, "time_us": t,
                            "frames": []})
    data = {"segments": [], "device_traces": [entries], "allocator_settings": {}}
    with gzip.open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)
    return path


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return make_snapshot(tmp_path_factory.mktemp("snap") / "unseen_model.pickle.gz")


@pytest.fixture(scope="module")
def report(snapshot, tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "report"
    result = build_report(snapshot, out, ReportOptions(devices=(DEVICE,), policies=POLICIES, samples=50),
                          progress=False)
    return out, result


def test_files_are_there_and_the_page_shows_every_figure(report):
    out, result = report
    names = set(os.listdir(out))
    assert set(result.files) == names
    pngs = sorted(n for n in names if n.endswith(".png"))
    assert len(pngs) == 5  # timeline, occupancy, fragmentation (one device), sites, fit
    for n in pngs:
        assert (out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.html").read_text()
    for n in names - {"index.html"}:
        assert n in page, f"{n} is not linked from index.html"
    for stem in ("summary", "sites", "fit"):
        assert (out / f"{stem}.csv").stat().st_size > 0
        json.loads((out / f"{stem}.json").read_text())
    assert "/" not in "".join(names)  # all beside index.html
    assert not [n for n in os.listdir(out.parent) if n.startswith(".report.tmp-")]


def test_numbers_equal_a_plain_replay(report, snapshot):
    out, _ = report
    rows = json.loads((out / "summary.json").read_text())
    assert [r["policy"] for r in rows] == list(POLICIES)
    for row in rows:
        plain = replay_trace(snapshot, DEVICE, row["policy"], progress=False).as_json()
        for key in ("n_ops", "completed_ops", "peak_live_bytes", "peak_reserved_bytes", "overhead", "ooms",
                    "device_calls", "cache_hits", "cache_misses", "external_fragmentation_at_end", "engine",
                    "sim_time_s"):
            assert row[key] == plain[key], (row["policy"], key)
        assert row["status"] == "runs"
        assert plain["peak_live_bytes"] <= row["smallest_limit_bytes"] <= plain["peak_reserved_bytes"]
    timeline = json.loads((out / f"timeline-sim-rtx-3060-12gb.json").read_text())
    for row in rows:
        cols = timeline["policies"][row["policy"]]
        assert max(cols["reserved_bytes"]) <= row["peak_reserved_bytes"]
        assert max(cols["live_bytes"]) <= row["peak_live_bytes"]
        assert cols["op"][-1] == row["n_ops"]


def test_who_holds_the_memory_comes_from_the_stack_frames(report):
    out, _ = report
    sites = json.loads((out / "sites.json").read_text())
    assert sites["kind"] == "stack frame"
    assert sites["sites"][0]["site"] == "forward (models/net.py:41)"  # the model's frame, not PyTorch's
    assert sum(s["live_nbytes"] for s in sites["sites"]) == sites["total_live_bytes"]


def test_occupancy_accounts_for_every_byte_held(report):
    out, _ = report
    occ = json.loads((out / "occupancy-sim-rtx-3060-12gb.json").read_text())["policies"]
    assert set(occ) == set(POLICIES)
    for policy, data in occ.items():
        held = sum(s["mapped_bytes"] for s in data["segments"])
        assert held == data["reserved_bytes"], policy
        assert all(s["live_bytes"] <= s["mapped_bytes"] <= s["extent_bytes"] for s in data["segments"])


@pytest.mark.parametrize("fmt", ["gmt", "rmm"])
def test_every_trace_format_gives_the_same_numbers(report, snapshot, tmp_path, fmt):
    out, _ = report
    trace = load_trace(snapshot)
    path = tmp_path / ("t.gmt" if fmt == "gmt" else "t.csv")
    save_trace(trace, path) if fmt == "gmt" else write_rmm_log(trace, path)
    res = build_report(path, tmp_path / "r", ReportOptions(devices=(DEVICE,), policies=POLICIES, samples=20,
                                                            fit=False), progress=False)
    want = {r["policy"]: r for r in json.loads((out / "summary.json").read_text())}
    for row in res.summary:
        for key in ("peak_live_bytes", "peak_reserved_bytes", "ooms", "n_ops"):
            assert row[key] == want[row["policy"]][key]
    sites = json.loads((tmp_path / "r" / "sites.json").read_text())
    assert sites["kind"] == "requested size"  # no stacks in these formats


def test_reproducible(snapshot, tmp_path):
    opts = ReportOptions(devices=(DEVICE,), policies=("expandable",), samples=30, fit=False)
    a = build_report(snapshot, tmp_path / "a", opts, progress=False)
    b = build_report(snapshot, tmp_path / "b", opts, progress=False)
    strip = [{k: v for k, v in r.items() if k != "ns_per_op"} for r in a.summary]
    assert strip == [{k: v for k, v in r.items() if k != "ns_per_op"} for r in b.summary]
    for name in ("timeline-sim-rtx-3060-12gb.json", "occupancy-sim-rtx-3060-12gb.json", "sites.csv", "fit.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("content", [b"", b"not a trace at all\n", gzip.compress(b"\x80\x04garbage"),
                                     gzip.compress(pickle.dumps({"segments": []}))])
def test_bad_trace_gives_a_clear_error_and_writes_nothing(tmp_path, capsys, content):
    bad = tmp_path / "bad.pickle.gz"
    bad.write_bytes(content)
    out = tmp_path / "out" / "report"
    code = main(["report", str(bad), "--out", str(out), "--policy", "gpumem"])
    err = capsys.readouterr().err
    assert code == 2
    assert "gpumem report: cannot read the trace" in err and "nothing was written" in err
    assert not out.exists()
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    with pytest.raises((TraceFormatError, InvalidArgumentError)):
        build_report(bad, out, ReportOptions(policies=("gpumem",)), progress=False)
    assert not out.exists()


def test_a_bad_trace_leaves_an_existing_report_untouched(report, tmp_path):
    out, _ = report
    before = {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)}
    bad = tmp_path / "bad.csv"
    bad.write_text("Thread,Time,Action\nnonsense\n")
    with pytest.raises((TraceFormatError, InvalidArgumentError)):
        build_report(bad, out, ReportOptions(policies=("gpumem",)), force=True, progress=False)
    assert {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)} == before
    with pytest.raises(ReportExistsError):
        build_report(bad, out, ReportOptions(policies=("gpumem",)), progress=False)


def test_out_of_memory_and_pressure_are_recorded(tmp_path):
    # a 2 GB board with a quarter of it taken by another tenant, and a trace of about 2 GiB live at its peak
    big = make_snapshot(tmp_path / "big.pickle.gz", scale=3)
    res = build_report(big, tmp_path / "r", ReportOptions(devices=("sim:gtx-1050-2gb",),
                                                                policies=("pytorch", "gpumem"), pressure="step",
                                                                samples=40), progress=False)
    timeline = json.loads((tmp_path / "r" / "timeline-sim-gtx-1050-2gb-pressure-step.json").read_text())
    for row in res.summary:
        cols = timeline["policies"][row["policy"]]
        assert max(cols["tenant_bytes"]) > 0
        assert len(cols["ooms"]) == row["ooms"]
        assert row["status"] == ("runs" if row["ooms"] == 0 else "out of memory")
    assert any(r["ooms"] for r in res.summary)
    fit = json.loads((tmp_path / "r" / "fit.json").read_text())
    assert {c["status"] for c in fit} <= {"runs", "out of memory"}
    peak = load_trace(big).peak_live_nbytes
    for c in fit:  # bisected without pressure (on a larger card when this one is too small): what it needs
        assert c["smallest_limit_nbytes"] >= peak
        if c["status"] == "out of memory" and c["policy"] == "pytorch":
            assert c["smallest_limit_nbytes"] > peak


def test_unsupported_policy_is_a_cell_not_a_failure(snapshot, tmp_path):
    res = build_report(snapshot, tmp_path / "r", ReportOptions(devices=("sim:jetson-nano-4gb",),
                                                                policies=("expandable", "cupy"), samples=20,
                                                                fit=False), progress=False)
    by = {r["policy"]: r for r in res.summary}
    assert by["expandable"]["status"] == "unsupported" and "virtual memory" in by["expandable"]["reason"]
    assert by["cupy"]["status"] == "runs"


def test_cli_json_and_bad_options(snapshot, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", str(snapshot), "--out", str(out), "--device", DEVICE, "--policy", "expandable",
                 "--samples", "20", "--no-fit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"][0]["policy"] == "expandable" and (out / "index.html").exists()
    assert main(["report", str(snapshot), "--out", str(out), "--policy", "gpumem"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["report", str(snapshot), "--out", str(tmp_path / "x"), "--policy", "all", "--policy",
                 "gpumem"]) == 2
    assert main(["report", str(snapshot), "--out", str(tmp_path / "y"), "--device", "sim:nope"]) == 2
    assert "--device sim:nope: unknown simulated profile" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    with pytest.raises(SystemExit):
        main(["report", str(snapshot), "--out", str(tmp_path / "z"), "--policy", "tcmalloc"])


def test_fit_matrix_spans_profiles_and_gives_needs_without_virtual_memory(tmp_path):
    # about 2 GiB live at the peak: too much for a Jetson Nano 2GB (a device without virtual memory), whose
    # cell must still say what the trace needs (bisected on a larger twin of the same kind), as a VMM card's does
    big = make_snapshot(tmp_path / "big.pickle.gz", scale=3)
    extra = ("sim:gtx-1050-2gb", "sim:jetson-nano-4gb", "sim:rtx-3060-12gb")
    build_report(big, tmp_path / "r", ReportOptions(devices=("sim:jetson-nano-2gb",), policies=("pytorch", "cupy"),
                                                    samples=20, fit_devices=extra), progress=False)
    fit = json.loads((tmp_path / "r" / "fit.json").read_text())
    assert [c["device"] for c in fit[::2]] == ["sim:jetson-nano-2gb", *extra]
    peak = load_trace(big).peak_live_nbytes
    for c in fit:
        assert c["smallest_limit_nbytes"] is not None and c["smallest_limit_nbytes"] >= peak, c
        assert c["decided_by"] == ("replay" if c["device"] == "sim:jetson-nano-2gb" else "limit")
        if c["device"] == "sim:jetson-nano-2gb":
            assert c["status"] == "out of memory"
        else:  # the cell decided by the smallest limit agrees with a real replay on that profile
            runs = replay_trace(big, c["device"], c["policy"], progress=False).ooms == 0
            assert c["status"] == ("runs" if runs else "out of memory"), c
    assert {c["status"] for c in fit if c["device"] == "sim:rtx-3060-12gb"} == {"runs"}


def test_live_line_covers_the_run_that_went_furthest(tmp_path):
    # under pressure on a small card the policies run out of memory at different operations: the live (and
    # tenant) line must not stop where the first policy's run stopped
    from gpumem.report import figures
    from gpumem.report.build import _x_axis
    from gpumem.report.runs import run_policy

    trace = load_trace(make_snapshot(tmp_path / "big.pickle.gz", scale=3))
    spec = "sim:gtx-1050-2gb?pressure=spikes"
    runs = [run_policy(trace, spec, p, samples=40) for p in ("bestfit", "gpumem", "pytorch", "cupy")]
    ends = [r.timeline.op[-1] for r in runs]
    assert len(set(ends)) > 1 and ends[0] < max(ends), ends  # the case of the bug: the first run stops early
    xs, label = _x_axis(trace, runs)
    live_x = figures.timeline_figure(tmp_path / "t.png", runs, xs, label, "t")
    longest = runs[ends.index(max(ends))]
    assert list(live_x) == list(xs[longest.policy])
    assert (tmp_path / "t.png").stat().st_size > 0


def test_site_labels_say_tensor_for_one(tmp_path):
    from gpumem.report import figures
    from gpumem.report.sites import Site, SiteTable

    table = SiteTable(op=1, kind="requested size", sites=[Site("1 MiB", MiB, 1), Site("2 MiB", 4 * MiB, 2)],
                      total_live_nbytes=5 * MiB)
    import matplotlib.pyplot as plt

    texts = []
    orig = plt.Axes.text
    try:
        plt.Axes.text = lambda self, *a, **k: texts.append(a[2]) or orig(self, *a, **k)
        figures.sites_figure(tmp_path / "s.png", table, "t")
    finally:
        plt.Axes.text = orig
    assert any(t.endswith("(1 tensor)") for t in texts) and any(t.endswith("(2 tensors)") for t in texts)


def test_csv_cells_that_a_spreadsheet_reads_as_formulas_are_neutralised(tmp_path, monkeypatch):
    """issue 20 item 12: snapshot frame names and the trace's file name went verbatim into sites.csv and
    summary.csv; a cell starting with =, +, -, @ is a formula in a spreadsheet."""
    import csv

    from gpumem.outputs import csv_cell
    assert [csv_cell(v) for v in ("=1+1", "+x", "-x", "@x", "\tx", "\rx", "ok", -5, None)] == \
        ["'=1+1", "'+x", "'-x", "'@x", "'\tx", "'\rx", "ok", -5, None]
    monkeypatch.setitem(SITES, ("=HYPERLINK(\"http://x\")", "@evil.py", 1), (1 << 20, 2 << 20))
    snap = make_snapshot(tmp_path / "=cmd.pickle.gz")
    out = tmp_path / "r"
    build_report(snap, out, ReportOptions(devices=(DEVICE,), policies=("gpumem",), samples=10, fit=False),
                 progress=False)
    for name in ("sites.csv", "summary.csv"):
        with open(out / name, newline="") as f:
            cells = [c for row in csv.reader(f) for c in row]
        assert not any(c.startswith(("=", "+", "-", "@", "\t", "\r")) for c in cells), name
    assert any("=HYPERLINK" in c for c in open(out / "sites.csv").read().split(","))
