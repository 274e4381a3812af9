"""Builds gpumem's native allocator engine (``gpumem._engine``) when a C++ compiler is present.

Everything else about the package is in ``pyproject.toml``. The engine needs only a C++17
compiler and Python's headers: no CUDA toolkit (``libcuda`` is loaded at run time) and nothing
downloaded. Where the build fails (no compiler), the install still succeeds and gpumem runs on
its pure-Python engine, saying so once (``gpumem.engine()`` returns ``"python"``).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Note [An optional extension]: the engine is an accelerator, not a requirement. A failed compile
# is reported and the install goes on; GPUMEM_REQUIRE_NATIVE=1 turns that into an error (for CI
# and packagers who want to be sure they ship the native engine).
REQUIRE_NATIVE = os.environ.get("GPUMEM_REQUIRE_NATIVE", "") not in ("", "0")


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns (once) instead of failing when the engine cannot be compiled."""

    failed = False

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler at all (DistutilsPlatformError...)
            self._failed(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - CompileError, LinkError
            self._failed(exc)

    def copy_extensions_to_source(self) -> None:
        # editable installs copy the built library into the source tree: there is none to copy
        if not self.failed:
            super().copy_extensions_to_source()

    def _failed(self, exc: BaseException) -> None:
        if REQUIRE_NATIVE:
            raise exc
        if self.failed:
            return
        self.failed = True
        # Note [A failed build leaves no stale engine]: a library built from older sources would
        # otherwise stay importable beside the new sources, and gpumem would run code that is not
        # in the checkout.
        here = os.path.dirname(os.path.abspath(__file__))
        for stale in glob.glob(os.path.join(here, "gpumem", "_engine*.so")) + \
                glob.glob(os.path.join(here, "gpumem", "_engine*.pyd")):
            try:
                os.remove(stale)
            except OSError:
                pass
        sys.stderr.write(f"warning: gpumem's native engine was not built ({exc}); gpumem will run on its "
                         "pure-Python engine, which is slower. Install a C++ compiler and reinstall to build it.\n")


SOURCES = sorted(glob.glob(os.path.join("gpumem", "_native", "*.cpp")))

setup(
    ext_modules=[
        Extension(
            "gpumem._engine",
            sources=SOURCES,
            depends=sorted(glob.glob(os.path.join("gpumem", "_native", "*.h"))),
            include_dirs=[os.path.join("gpumem", "_native")],
            language="c++",
            # -O3: the engine's hot path inlines further (the 7B decode's replay under `gpumem`: 5 % less time than
            # -O2, reports/estimate-speed.md round 8); Python's own extensions are built -O3 too
            extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
        )
    ] if SOURCES else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
