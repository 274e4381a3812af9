"""Fixtures for the trace tests: the project's small derived traces and the shared real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parent / "data"
SHARED_TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"  # the real traces ship with the project


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``tests/trace/data``: small traces derived from the real ResNet-50 trace (see make_fixtures.py)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """``data/traces``: the real traces, shipped with the project (missing data is a failure, not a skip)."""
    if not SHARED_TRACES.is_dir():
        pytest.fail(f"the project's traces are missing: no folder {SHARED_TRACES}")
    return SHARED_TRACES
