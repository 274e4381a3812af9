"""gpumem's native CUDA driver backend (``gpumem/_native/cuda_backend.cpp``), checked by a C++ program.

The backend never touches Python, so it is checked from C++: ``cuda_backend_check.cpp`` is compiled
with the C++ compiler that builds gpumem's extension and run. Without a GPU it checks that a missing
driver is a clear error; on a real device (``--gpumem-device cuda:0``) it drives every Backend call.

(This folder is ``tests/pytorch``, not ``tests/torch``: a ``tests/torch`` folder would be found as a
namespace package ``torch`` when PyTorch is not installed; see ``tests/conftest.py``.)
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parent.parent / "gpumem" / "_native"


def _compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no C++ compiler on PATH")


@pytest.fixture(scope="module")
def check_program(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("cuda_backend") / "cuda_backend_check"
    cmd = [_compiler(), "-std=c++17", "-O1", "-Wall", f"-I{NATIVE}", str(HERE / "cuda_backend_check.cpp"),
           str(NATIVE / "cuda_backend.cpp"), "-ldl", "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"compile failed:\n{done.stderr}"
    return exe


def _run(exe: Path, mode: str) -> str:
    done = subprocess.run([str(exe), mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "FAIL" not in done.stdout, done.stdout + done.stderr
    return done.stdout


def test_without_a_driver_the_backend_says_why(check_program):
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    out = _run(check_program, "no-driver")
    assert "cannot load the CUDA driver (libcuda.so.1)" in out


@pytest.mark.cuda
def test_every_backend_call_on_the_device(check_program, device_spec):
    if not device_spec.startswith("cuda:"):
        pytest.skip("needs a real CUDA device")
    out = _run(check_program, "device")
    assert "OK memory reads back what was written" in out
    assert "OK mem_create past the device's memory -> kind 1" in out
