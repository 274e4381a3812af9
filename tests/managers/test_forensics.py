"""OOM forensics: a PyTorch-format snapshot and a text report, written before the error propagates."""

from __future__ import annotations

import pickle

import pytest

from gpumem.errors import InvalidArgumentError, OutOfMemoryError
from gpumem.managers import GpuMemoryManager, MemoryConfig, region
from gpumem.managers.forensics import ForensicsLayer, build_oom_snapshot, write_oom_forensics
from gpumem.managers.layers import LimitingLayer, TrackingLayer
from gpumem.managers.resource import DeviceResource
from gpumem.trace import read_pytorch_snapshot
from gpumem.units import MiB


def _fill(m):
    held = []
    with region("model"):
        with region("weights"):
            held += [m.allocate(200 * MiB, tag="layer") for _ in range(3)]
        held.append(m.allocate(50 * MiB, tag="kv-cache"))
    with region("step"):
        held.append(m.allocate(30 * MiB, tag="activations"))
    return held


def test_manager_writes_snapshot_and_report(tmp_path):
    cfg = MemoryConfig().with_oom_forensics(tmp_path / "oom").with_tracking(True, capture_stacks=True)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        held = _fill(m)
        live_before = len(m.tracker)
        with pytest.raises(OutOfMemoryError) as err:
            m.allocate(m.usable_memory)
        rec = err.value.forensics
        assert str(rec.snapshot_path) in str(err.value) and str(rec.report_path) in str(err.value)
        assert len(m.tracker) == live_before            # nothing changed
        assert rec.n_buffers == 5

        # gpumem's own reader loads the PyTorch-format file back
        trace = read_pytorch_snapshot(rec.snapshot_path)
        assert trace.n_allocs == 5 and trace.n_failed_allocs == 1
        assert sorted(trace.nbytes[trace.kinds == 0].tolist()) == sorted(a.nbytes for a in held)

        snap = pickle.loads(rec.snapshot_path.read_bytes())
        entries = snap["device_traces"][-1]
        allocs = [e for e in entries if e["action"] == "alloc"]
        assert {e["addr"] for e in allocs} == {a.ptr for a in held}
        kv = next(e for e in allocs if "tag=kv-cache" in e["user_metadata"])
        assert kv["frames"][0]["filename"] == "<gpumem region>"
        assert "region=model" in kv["frames"][0]["name"]
        assert any("test_forensics.py" in f["filename"] for f in kv["frames"][1:])   # the Python stack
        assert entries[-1]["action"] == "oom" and entries[-1]["size"] == m.usable_memory
        blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        assert len(blocks) == 5 and all(b["frames"] for b in blocks)

        report = rec.report_path.read_text()
        assert "top regions:" in report and "model/weights" in report and "600.00 MiB" in report
        assert "top tags:" in report and "kv-cache" in report
        assert "top allocation sites:" in report and "test_forensics.py" in report
        for a in held:
            m.deallocate(a)


def test_without_tracking_the_report_says_so(tmp_path):
    cfg = MemoryConfig().with_tracking(False).with_oom_forensics(tmp_path)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        with pytest.raises(OutOfMemoryError) as err:
            m.allocate(m.usable_memory + 1)
        text = err.value.forensics.report_path.read_text()
        assert "track_allocations" in text
        assert read_pytorch_snapshot(err.value.forensics.snapshot_path).n_failed_allocs == 1


def test_unwritable_directory_keeps_the_original_error(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with GpuMemoryManager("sim:gtx-1050-2gb", config=MemoryConfig().with_oom_forensics(blocker / "sub")) as m:
        with pytest.raises(OutOfMemoryError) as err:
            m.allocate(m.usable_memory + 1)
        assert not hasattr(err.value, "forensics")
        assert "could not write OOM forensics" in caplog.text


def test_layer_on_any_stack(tmp_path):
    from gpumem import open_device

    with open_device("sim:t4-16gb") as dev:
        tracking = TrackingLayer(LimitingLayer(DeviceResource(dev), 64 * MiB))
        top = ForensicsLayer(tracking, tmp_path, tracker=tracking.tracker)
        p = top.allocate(40 * MiB)
        with pytest.raises(OutOfMemoryError, match="OOM forensics"):
            top.allocate(40 * MiB)
        with pytest.raises(OutOfMemoryError):
            top.allocate(30 * MiB)
        assert len(top.records) == 2 and len(list(tmp_path.iterdir())) == 4
        top.deallocate(p, 40 * MiB)
        with pytest.raises(InvalidArgumentError):
            ForensicsLayer(tracking, "")
        with pytest.raises(InvalidArgumentError):
            write_oom_forensics(tmp_path, ValueError("x"))
        top.close()


def test_snapshot_of_nothing_is_just_the_oom():
    snap = build_oom_snapshot([], 123, 0)
    assert snap["device_traces"][-1] == [{"action": "oom", "addr": 0, "size": 123, "stream": 0, "time_us": 0,
                                          "frames": [], "device_free": 0}]


def test_report_with_tracking_on_and_nothing_live_does_not_advise_turning_it_on(tmp_path):
    cfg = MemoryConfig().with_oom_forensics(tmp_path / "oom").with_tracking(True)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        with pytest.raises(OutOfMemoryError) as err:
            m.allocate(m.usable_memory + 1)
        report = err.value.forensics.report_path.read_text()
    assert "no live tracked buffers" in report and "turn on MemoryConfig.track_allocations" not in report
    cfg = MemoryConfig().with_oom_forensics(tmp_path / "oom2").with_tracking(False)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        with pytest.raises(OutOfMemoryError) as err:
            m.allocate(m.usable_memory + 1)
        assert "turn on MemoryConfig.track_allocations" in err.value.forensics.report_path.read_text()


def test_recorded_stacks_start_at_the_users_code_and_depth_counts_after_stripping():
    """Note [Stacks start at the user's code]: no frame of gpumem's manager modules, and the caller's
    own frame is the innermost one recorded."""
    cfg = MemoryConfig().with_tracking(True, capture_stacks=True)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        m.tracker.stack_depth = 2

        def users_inner_function():
            return m.allocate(1 * MiB)

        a = users_inner_function()
        info = m.tracker.get(a.buffer_id)
        assert len(info.stack) == 2
        assert info.stack[-1].name == "users_inner_function"
        assert info.stack[-2].name == "test_recorded_stacks_start_at_the_users_code_and_depth_counts_after_stripping"
        assert not any("/gpumem/managers/" in f.filename.replace("\\", "/") for f in info.stack)


def test_export_snapshot_at_any_time_with_regions_and_stacks(tmp_path):
    """Issue 8: regions reach exported snapshots, not only OOM ones."""
    cfg = MemoryConfig().with_tracking(True, capture_stacks=True)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        held = _fill(m)
        path = m.export_snapshot(tmp_path / "now.pickle")
        assert path == tmp_path / "now.pickle" and path.exists()
        trace = read_pytorch_snapshot(path)                 # gpumem's own reader loads it
        assert trace.n_allocs == len(held) and trace.n_failed_allocs == 0
        assert sorted(trace.nbytes[trace.kinds == 0].tolist()) == sorted(a.nbytes for a in held)
        snap = pickle.loads(path.read_bytes())
        allocs = [e for e in snap["device_traces"][-1] if e["action"] == "alloc"]
        assert not any(e["action"] == "oom" for e in snap["device_traces"][-1])
        kv = next(e for e in allocs if "tag=kv-cache" in e["user_metadata"])
        assert kv["frames"][0]["filename"] == "<gpumem region>" and "region=model" in kv["frames"][0]["name"]
        assert "test_forensics.py" in kv["frames"][1]["filename"]   # the user's code first
        live_before = len(m.tracker)
        m.deallocate(held.pop())
        assert read_pytorch_snapshot(m.export_snapshot(tmp_path / "later.pickle")).n_allocs == len(held)
        assert len(m.tracker) == live_before - 1


def test_export_snapshot_needs_tracking(tmp_path):
    from gpumem.errors import InvalidArgumentError

    with GpuMemoryManager("sim:gtx-1050-2gb", config=MemoryConfig().with_tracking(False)) as m:
        with pytest.raises(InvalidArgumentError, match="track_allocations"):
            m.export_snapshot(tmp_path / "x.pickle")
    assert not (tmp_path / "x.pickle").exists()


def test_export_snapshot_to_a_folder_or_a_missing_folder_is_a_clear_error(tmp_path):
    """issue 20 item 12: a raw IsADirectoryError/FileNotFoundError; now a gpumem error naming the path and
    what is wrong, nothing written and the manager unchanged."""
    from gpumem.errors import InvalidArgumentError

    cfg = MemoryConfig().with_tracking(True)
    with GpuMemoryManager("sim:gtx-1050-2gb", config=cfg) as m:
        held = _fill(m)
        before = sorted(tmp_path.iterdir())
        with pytest.raises(InvalidArgumentError, match=f"{tmp_path}: it is a folder"):
            m.export_snapshot(tmp_path)
        with pytest.raises(InvalidArgumentError, match="no such folder"):
            m.export_snapshot(tmp_path / "missing" / "x.pickle")
        assert sorted(tmp_path.iterdir()) == before and len(m.tracker) == len(held)
        assert read_pytorch_snapshot(m.export_snapshot(tmp_path / "ok.pickle")).n_allocs == len(held)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.pickle"]


def test_the_error_with_forensics_keeps_every_figure_of_the_original(tmp_path):
    """Review rv21a: with_forensics rebuilt the error without ``rounded_nbytes`` (added to
    OutOfMemoryError by issue 21 step 3), so the raised error lost "rounded up to ..." from its
    message and said the allocator needed the request as given."""
    from gpumem.managers.forensics import with_forensics

    original = OutOfMemoryError(1000, 5 * MiB, 16 * MiB, device="sim:t4-16gb", allocated_nbytes=2 * MiB,
                                cached_nbytes=MiB, limit_nbytes=8 * MiB, hint="Try: less.", injected=True,
                                rounded_nbytes=2 * MiB)
    record = write_oom_forensics(tmp_path, original)
    new = with_forensics(original, record)
    for name in ("requested_nbytes", "rounded_nbytes", "free_nbytes", "total_nbytes", "device", "allocated_nbytes",
                 "cached_nbytes", "limit_nbytes", "injected"):
        assert getattr(new, name) == getattr(original, name), name
    assert str(new).startswith(str(original)) and str(record.report_path) in str(new)
    assert new.forensics is record
