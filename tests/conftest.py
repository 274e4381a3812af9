"""Shared test configuration: the gpumem_hil plugin and the Hypothesis profiles.

``gpumem.hil.plugin`` is loaded through its pytest11 entry point (``gpumem_hil``) when gpumem is
installed (``pip install -e .``). In a bare checkout (``PYTHONPATH=. pytest``) the entry
point is not there, so it is registered here, under the same name: never twice, and not
when it was disabled with ``-p no:gpumem_hil``. The plugin acts only in projects that opt in:
this one does, with ``gpumem_hil = true`` in ``pyproject.toml``.

Hypothesis profiles: ``dev`` (default, quick) and ``ci`` (more examples, derandomised);
choose with ``HYPOTHESIS_PROFILE=ci``.
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# pytest puts this directory (tests/) on sys.path to import this conftest, so no test folder may be
# named like a package the tests import: a folder "sim", "cuda" or "trace" there would be found as a
# namespace package before an editable install's import hook runs (hence tests/simulator,
# tests/cuda_adapter, tests/traces). Appending the checkout's root also lets an uninstalled checkout
# import gpumem (and gpumem.sim, gpumem.hil), without overriding an installed copy.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def pytest_addoption(parser, pluginmanager):
    import gpumem.hil.plugin

    if not pluginmanager.is_registered(gpumem.hil.plugin) and not pluginmanager.is_blocked("gpumem_hil"):
        pluginmanager.register(gpumem.hil.plugin, "gpumem_hil")


settings.register_profile("dev", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
