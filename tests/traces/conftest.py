"""Fixtures for the trace tests: the project's small derived traces and the shared real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parent / "data"
SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``tests/traces/data``: small traces derived from the real ResNet-50 trace (see make_fixtures.py)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """``../shared/traces`` next to the repository; the test is skipped when it is absent."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_TRACES}")
    return SHARED_TRACES
