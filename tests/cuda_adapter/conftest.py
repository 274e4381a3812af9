"""Fixtures: a CudaDevice over fake CUDA libraries (see cuda_fakes.py, which also has ``Fakes``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cuda_fakes import Fakes  # noqa: E402

from gpumem.cuda import CudaDevice  # noqa: E402


@pytest.fixture
def fakes() -> Fakes:
    return Fakes()


@pytest.fixture
def dev(fakes: Fakes) -> Iterator[CudaDevice]:
    d = fakes.open()
    yield d
    d.close()
