"""The one recorder of PyTorch's allocations (gpumem/_native/recorder.h), without a GPU.

recorder_check.cpp compares it, over random sequences of events and of the history and the trace turned
on and off, with the two recorders torch_api.cpp had before (a bounded history of every device for
``gpumem record``, a per-device trace for GPUMEM_TRACE_OUT): both outputs must be what they were.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cxx() -> str | None:
    configured = (sysconfig.get_config_var("CXX") or "").split()
    for name in configured[:1] + ["c++", "g++", "clang++"]:
        if shutil.which(name):
            return name
    return None


def test_one_recorder_hands_out_what_the_two_did(tmp_path: Path) -> None:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / "recorder_check"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'gpumem' / '_native'}",
                            str(Path(__file__).with_name("recorder_check.cpp")), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-4000:] + run.stderr[-2000:]
