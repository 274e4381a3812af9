"""The native engine is built wherever it can be, and its absence is a clear, single warning.

``test_native_engine_is_built_where_a_compiler_exists`` is how CI fails when ``pip install`` did not
build ``gpumem._engine``: on a machine with a C++ compiler the extension must be importable. Where
no compiler exists it skips (gpumem then runs on its pure-Python engine, which the other tests
cover).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import gpumem
from gpumem import native
from gpumem.errors import BackendUnavailableError

ROOT = Path(__file__).resolve().parent.parent


def _cxx_on_path() -> str | None:
    """The C++ compiler setuptools would use, if it is on PATH."""
    candidates = []
    configured = sysconfig.get_config_var("CXX")
    if configured:
        candidates.append(configured.split()[0])
    candidates += ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def test_native_engine_is_built_where_a_compiler_exists():
    compiler = _cxx_on_path()
    if compiler is None:
        pytest.skip("no C++ compiler on PATH: gpumem runs on its pure-Python engine here")
    try:
        import gpumem._engine  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"a C++ compiler is on PATH ({compiler}) but gpumem's native engine is not built ({exc}); "
                    "build it with `pip install -e .` (or `python setup.py build_ext --inplace`)")
    assert gpumem.engine() == "native"
    lib = Path(native.library_path())
    assert lib.is_file() and lib.name.startswith("_engine")


def _run_without_engine(code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter where ``gpumem._engine`` cannot be imported."""
    prelude = textwrap.dedent("""
        import sys
        class _NoEngine:
            def find_spec(self, name, path=None, target=None):
                if name == "gpumem._engine":
                    raise ImportError("gpumem._engine hidden by the test")
                return None
        sys.meta_path.insert(0, _NoEngine())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-W", "default", "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_without_the_engine_gpumem_warns_once_and_runs_on_python():
    done = _run_without_engine("""
        import warnings, gpumem
        from gpumem.native import NativeEngineWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = gpumem.engine(), gpumem.engine()
        mine = [w for w in caught if issubclass(w.category, NativeEngineWarning)]
        print(first, second, len(mine))
        print(mine[0].message)
    """)
    assert done.returncode == 0, done.stderr
    first_line, message = done.stdout.splitlines()[:2]
    assert first_line == "python python 1"
    assert "gpumem._engine hidden by the test" in message
    assert "C++ compiler" in message and "reinstall" in message


def test_without_the_engine_the_library_path_is_a_clear_error():
    done = _run_without_engine("""
        from gpumem import native
        from gpumem.errors import BackendUnavailableError
        try:
            native.library_path()
        except BackendUnavailableError as exc:
            print("raised:", exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "raised: gpumem's native engine is not available" in done.stdout
    assert "C++ compiler" in done.stdout


def test_without_the_engine_devices_says_python():
    done = _run_without_engine("""
        import sys
        from gpumem.cli import main
        sys.exit(main(["devices"]))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "engine: python"
    assert "native engine is not available" in done.stderr


@pytest.mark.filterwarnings("ignore::gpumem.native.NativeEngineWarning")
def test_devices_names_the_engine(capsys):
    import json

    from gpumem.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(f"engine: {gpumem.engine()}")
    assert main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # the native engine is the default in virtual-memory mode only: devices without VMM say "python"; a real GPU's row
    # (VMM unknown, None, until a context exists) names the engine the allocator tries (a KeyError on the H200 once)
    assert rows and all(r["engine"] == ("python" if r["vmm_supported"] is False else gpumem.engine()) for r in rows)
    assert any(r["vmm_supported"] is False for r in rows)  # the Jetson profiles
    assert all(r["vmm_supported"] is None for r in rows if r["kind"] == "cuda")


@pytest.mark.filterwarnings("ignore::gpumem.native.NativeEngineWarning")
def test_native_module_raises_when_missing_and_returns_when_built():
    if gpumem.engine() == "native":
        assert native.native_module().__name__ == "gpumem._engine"
    else:
        with pytest.raises(BackendUnavailableError, match="not available"):
            native.native_module()



def test_cuda_allocator_without_a_driver_says_why():
    """gpumem._engine.CudaAllocator (the native engine over the CUDA driver, from Python) raises a clear
    BackendUnavailableError where libcuda cannot be loaded, and checks its arguments first."""
    import ctypes.util

    if gpumem.engine() != "native":
        pytest.skip("the native engine is not built")
    from gpumem.native import native_module

    cuda_allocator = native_module().CudaAllocator
    with pytest.raises(TypeError):
        cuda_allocator("zero")
    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    with pytest.raises(gpumem.BackendUnavailableError, match="libcuda"):
        cuda_allocator(0)
