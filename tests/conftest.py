"""Shared test configuration: the gpumem_hil plugin and the Hypothesis profiles.

``hil.plugin`` is loaded through its pytest11 entry point (``gpumem_hil``) when gpumem is
installed (``pip install -e .``). In a bare checkout (``PYTHONPATH=. pytest``) the entry
point is not there, so it is registered here, under the same name: never twice, and not
when it was disabled with ``-p no:gpumem_hil``.

Hypothesis profiles: ``dev`` (default, quick) and ``ci`` (more examples, derandomised);
choose with ``HYPOTHESIS_PROFILE=ci``.
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# pytest puts this directory (tests/) on sys.path to import this conftest, and there tests/sim
# looks like a namespace package "sim". Under an editable install (whose import hook runs after
# sys.path) `import sim` would find tests/sim instead of the simulator. A regular package anywhere
# on sys.path beats a namespace one, so appending the checkout's root fixes that without
# overriding an installed copy.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def pytest_addoption(parser, pluginmanager):
    import hil.plugin

    if not pluginmanager.is_registered(hil.plugin) and not pluginmanager.is_blocked("gpumem_hil"):
        pluginmanager.register(hil.plugin, "gpumem_hil")


settings.register_profile("dev", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
