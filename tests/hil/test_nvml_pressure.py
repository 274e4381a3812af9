"""hil/probes/nvml_pressure.py on the simulator: a tenant follows the second process's schedule; the
monitor gives the cache back in time (and, as a control, without release the tenant is refused)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import gpumem

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def nvp():
    spec = importlib.util.spec_from_file_location("gpumem_nvml_pressure", REPO / "hil" / "probes" / "nvml_pressure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpumem_nvml_pressure"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpumem_nvml_pressure", None)


def _plan(nvp):
    return nvp.Plan(step_s=0.02, hold_s=0.1, pause_s=0.1, cycles=2, pattern_nbytes=4096)


def test_schedule_ramps_holds_and_returns_everything(nvp):
    plan = nvp.Plan(cycles=2, hog_steps=4)
    sched = plan.schedule(1000 * 2**20)
    assert [t for t, _ in sched] == sorted(t for t, _ in sched)
    assert sum(d for _, d in sched) == 0 and sum(1 for _, d in sched if d > 0) == 8
    assert max(d for _, d in sched) * 4 <= 0.4 * 1000 * 2**20


@pytest.mark.parametrize("profile", ["t4-16gb", "a100-80gb"])
def test_on_the_simulator_the_cache_goes_back_and_nothing_runs_out(nvp, profile, tmp_path):
    with gpumem.open_device(f"sim:{profile}") as dev:
        rec = nvp.run_check(dev, _plan(nvp), out_dir=tmp_path)
    assert rec.problems == [] and rec.ok
    assert rec.hog_ooms == 0 and rec.live_intact and rec.released_nbytes >= rec.cache_nbytes
    assert rec.peak_level in ("HIGH", "CRITICAL")
    md = list(tmp_path.glob("nvml-pressure-sim*.md"))
    js = list(tmp_path.glob("nvml-pressure-sim*.json"))
    assert len(md) == len(js) == 1
    data = json.loads(js[0].read_text())
    assert data["ok"] is True and data["device"] == f"sim:{profile}"
    assert "Result: passed" in md[0].read_text()


def test_control_run_without_release_fails_as_it_should(nvp, tmp_path):
    with gpumem.open_device("sim:t4-16gb") as dev:
        rec = nvp.run_check(dev, _plan(nvp), out_dir=tmp_path, release=False)
    assert not rec.ok and rec.hog_ooms > 0
    assert any("other process ran out of memory" in p for p in rec.problems)
    assert list(tmp_path.glob("*-no-release.md"))


def test_cli_needs_an_out_folder_and_reports_a_missing_device(nvp, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit) as info:
        nvp.main(["--device", "sim:t4-16gb"])
    assert info.value.code == 2
    assert nvp.main(["--device", "sim:no-such-gpu", "--out", str(tmp_path)]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_cli_on_the_simulator_passes(nvp, tmp_path, capsys):
    assert nvp.main(["--device", "sim:t4-16gb", "--out", str(tmp_path), "--cycles", "1"]) == 0
    assert "Result: passed" in capsys.readouterr().out


# -- the other process's events reach the parent, all of them ------------------------------------------
FAKE_CHILD = r"""
import json, os, sys, time
n, fd = int(sys.argv[1]), int(sys.argv[3])
seq = 0
def line(**kw):
    global seq
    kw["seq"] = seq
    seq += 1
    return (json.dumps(kw) + "\n").encode()
print("noise on stdout, not an event", flush=True)
os.write(fd, line(event="ready", backend="fake 1.0"))
i = 0
while i < n:
    k = min(n - i, 1 + i % 7)  # bursts: several lines in one write
    os.write(fd, b"".join(line(event="took", nbytes=3, attempts=1) for _ in range(k)))
    i += k
    if i % 50 < 7:  # a line in two halves, with a pause between them
        data = line(event="oom", nbytes=3, attempt=1)
        os.write(fd, data[:20]); time.sleep(0.01); os.write(fd, data[20:])
n_oom = seq - 1 - n
os.write(fd, line(event="returned", nbytes=3 * n))
done = line(event="done", backend="fake 1.0", events=seq, took=n, oom=n_oom, gave_up=0, skipped=0,
            returned=1, returned_nbytes=3 * n)
os.write(fd, done[:-1])  # the last line without its newline, and exit at once
os._exit(0)
"""


def test_every_event_of_a_fake_child_arrives_while_the_parent_polls(nvp):
    stop = False

    def busy():  # another thread holds the GIL often, as the monitor's does
        while not stop:
            sum(range(5000))

    th = __import__("threading").Thread(target=busy)
    th.start()
    try:
        n = 1500
        hog = nvp.SubprocessHog(n, [], script=FAKE_CHILD, start_timeout_s=30)
        hog.start()
        polls = 0
        while not hog.finished():
            hog.events()
            polls += 1
        assert hog.wait(10) == 0
    finally:
        stop = True
        th.join()
    events = hog.events()
    assert polls > 0 and hog.unparsed == []
    assert sum(1 for e in events if e["event"] == "took") == n
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[0]["event"] == "ready" and events[-1]["event"] == "done" and hog.backend == "fake 1.0"
    took, ooms, problems = nvp.tally_hog(events, n)
    assert (took, problems) == (n, []) and ooms > 0
    assert "noise on stdout" in hog.output()


def test_a_lost_event_is_reported_as_lost_and_the_steps_come_from_the_childs_count(nvp):
    events = [{"event": "ready", "seq": 0}]
    events += [{"event": "took", "seq": i} for i in range(1, 61)]
    events += [{"event": "returned", "seq": 61},
               {"event": "done", "seq": 62, "events": 62, "took": 60, "oom": 0, "returned": 1}]
    assert nvp.tally_hog(events, 60)[2] == []
    lost = [e for e in events if e["seq"] not in (0, 5, 6)]
    took, ooms, problems = nvp.tally_hog(lost, 60)
    assert took == 60 and ooms == 0
    assert any("lost" in p and "3 missing" in p for p in problems)
    assert any("reports 60 'took' events, 58 arrived" in p for p in problems)
    assert not any("took 60 of 60" in p or "of 60 steps" in p for p in problems)
    took, _, problems = nvp.tally_hog(events[:-1], 60)  # no "done": its end is unknown
    assert took == 60 and any("did not report its end" in p for p in problems)


def test_a_child_that_dies_before_ready_is_reported(nvp):
    hog = nvp.SubprocessHog(0, [], script="import sys; print('no GPU here'); sys.exit(3)", start_timeout_s=30)
    with pytest.raises(RuntimeError, match="no GPU here"):
        hog.start()


def test_the_record_names_the_other_process_and_the_cli_fails_with_status_1(nvp, tmp_path, capsys):
    with gpumem.open_device("sim:t4-16gb") as dev:
        rec = nvp.run_check(dev, _plan(nvp), out_dir=tmp_path)
    assert rec.hog_backend == "simulated tenant" and rec.hog_took == 2 * rec.plan["hog_steps"]
    assert "other process: simulated tenant" in nvp.render(rec)
    assert nvp.main(["--device", "sim:t4-16gb", "--out", str(tmp_path), "--cycles", "1", "--no-release"]) == 1
    assert "Result: failed" in capsys.readouterr().out
    assert list(tmp_path.glob("*-no-release.json"))
