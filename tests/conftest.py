"""Shared test configuration: the gpumem_hil plugin and the Hypothesis profiles.

``gpumem.testing`` is loaded through its pytest11 entry point (``gpumem_hil``) when gpumem is
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

# pytest puts this directory (tests/) on sys.path to import this conftest, so a test folder named like
# a package the tests import is found as a namespace package where that package is absent or installed
# through an editable install's import hook: a folder "cuda" would make `import cuda` succeed without
# cuda-bindings (hence tests/cuda_adapter and tests/pytorch). tests/sim and tests/hil are safe:
# the checkout's sim/ and hil/ are regular packages on the root appended here, and a regular package wins
# over a namespace folder. Appending the checkout's root lets an uninstalled checkout import gpumem, and
# every checkout import the tooling at its top (hil, sim), without overriding an installed gpumem.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def pytest_addoption(parser, pluginmanager):
    import gpumem.testing

    if not pluginmanager.is_registered(gpumem.testing) and not pluginmanager.is_blocked("gpumem_hil"):
        pluginmanager.register(gpumem.testing, "gpumem_hil")


settings.register_profile("dev", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
