"""Which engine the allocator tests run on.

The unit, stream, stateful and replay modules look inside the pure-Python reference engine
(``alloc.backing``, free lists, fences, monkeypatched internals): they run on it, whatever the
default engine is. The native engine is held to exactly the same decisions by
``test_native_differential.py``, which drives both engines with the same operations, and the
contract, CLI and fault tests run on the default engine (native where it is built).
"""

import pytest

from gpumem.allocator import caching

REFERENCE_ENGINE_MODULES = frozenset({
    "test_allocator_units",
    "test_allocator_streams",
    "test_allocator_stateful",
    "test_allocator_replay",
})


@pytest.fixture(autouse=True)
def _reference_engine_for_internals(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] in REFERENCE_ENGINE_MODULES:
        monkeypatch.setattr(caching, "NATIVE_BY_DEFAULT", False)
    yield
