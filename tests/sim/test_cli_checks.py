"""sim.cli_checks.json_target_problem: what a study's --json may be (review attacker 8: a FIFO hung a study
after its run, /dev/full, a file that takes no writes and a dangling link passed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sim.cli_checks import json_target_problem


def test_a_regular_file_or_a_new_one_in_a_folder_passes_and_is_left_as_it_was(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text("keep")
    before = old.stat()
    assert json_target_problem(old) == "" and old.read_text() == "keep"
    assert old.stat().st_mtime_ns == before.st_mtime_ns
    assert json_target_problem(tmp_path / "new.json") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]   # the trial file is gone


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert json_target_problem(fifo) == f"{fifo} is not a regular file"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_device_is_refused() -> None:
    assert json_target_problem(Path("/dev/full")) == "/dev/full is not a regular file"


def test_a_link_to_a_missing_file_a_folder_and_a_missing_folder_are_refused(tmp_path: Path) -> None:
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "x.json")
    assert json_target_problem(link) == f"{link} is a link to a missing file"
    assert json_target_problem(tmp_path) == f"{tmp_path} is a folder"
    assert json_target_problem(tmp_path / "no" / "x.json") == f"no folder {tmp_path / 'no'}"


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="no procfs")
def test_a_file_that_takes_no_writes_is_refused_even_for_root() -> None:
    """os.access(W_OK) is true for root on any file; the check tries a write of no bytes."""
    assert json_target_problem(Path("/proc/version")).startswith("cannot write /proc/version")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_file_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro.json"
    ro.write_text("x")
    ro.chmod(0o444)
    assert json_target_problem(ro).startswith(f"cannot write {ro}")
