"""Allocation sites in leak and OOM reports (issue 20 item 1 and 7).

A user's program in a folder named ``gpumem`` (what ``git clone`` of this project makes) must keep its
allocation sites: gpumem's own frames are told apart by the package's directory, not by the path.
"""

from __future__ import annotations

import importlib.util
import sys

from gpumem.managers.tracker import NO_STACK_SITE, AllocationTracker, Location


def _load_user_module(tmp_path, folder: str):
    """A user's module under ``tmp_path/folder/`` that registers a buffer on the tracker it is given."""
    d = tmp_path / folder / "project"
    d.mkdir(parents=True)
    path = d / "train_user.py"
    path.write_text("def make(tracker):\n    return tracker.register(4096, location=Location.GPU)\n")
    spec = importlib.util.spec_from_file_location(f"train_user_{folder}", path)
    mod = importlib.util.module_from_spec(spec)
    mod.Location = Location
    spec.loader.exec_module(mod)
    return mod, path


def test_user_code_under_a_folder_named_gpumem_keeps_its_site(tmp_path):
    mod, path = _load_user_module(tmp_path, "gpumem")
    tracker = AllocationTracker(capture_stacks=True)
    bid = mod.make(tracker)
    site = tracker.get(bid).site()
    assert site.startswith(f"{path}:2 in make"), site


def test_gpumem_frames_are_still_skipped(tmp_path):
    tracker = AllocationTracker(capture_stacks=True)
    bid = tracker.register(4096, location=Location.GPU)   # this test's frame is the innermost outside gpumem
    assert "test_sites.py" in tracker.get(bid).site()
    assert "gpumem/managers" not in tracker.get(bid).site()


def test_site_without_a_stack_says_that_capture_is_off():
    tracker = AllocationTracker(capture_stacks=False)
    bid = tracker.register(4096, location=Location.GPU)
    assert tracker.get(bid).site() == NO_STACK_SITE
    report = tracker.leak_report().format()
    assert "stacks not captured" in report and "GPUMEM_CAPTURE_STACKS=1" in report
