"""Note [One BLAS thread for the estimate] (gpumem/cli.py): ``estimate`` and ``fit`` ask numpy's OpenBLAS for one thread
where nothing loaded numpy or set the variable; every other command keeps the environment it was given."""

import os
import subprocess
import sys

import gpumem.cli as cli

_PROBE = """
import os, sys
import gpumem.cli as c
assert 'numpy' not in sys.modules, 'gpumem.cli imports numpy'
print(c._one_blas_thread(sys.argv[1:]), os.environ.get('OPENBLAS_NUM_THREADS'))
"""


def _probe(*argv: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_estimate_and_fit_ask_for_one_blas_thread_before_numpy_loads():
    assert _probe("estimate", "--layers", "2") == "True 1"
    assert _probe("-v", "fit", "--json") == "True 1"


def test_other_commands_and_a_users_setting_are_left_alone():
    assert _probe("record", "--", "python", "estimate") == "False None"   # record's program gets the environment
    assert _probe("replay", "t.gmt") == "False None"
    assert _probe("estimate", OPENBLAS_NUM_THREADS="4") == "False 4"


def test_a_process_that_loaded_numpy_is_left_alone(monkeypatch):
    import numpy  # noqa: F401 - loaded: OpenBLAS has read its variables already

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert not cli._one_blas_thread(["estimate"])
    assert "OPENBLAS_NUM_THREADS" not in os.environ


def test_cmd_replay_is_still_importable_from_gpumem_cli():
    from gpumem.cli import cmd_replay
    from gpumem.commands.replay import cmd_replay as direct

    assert cmd_replay is direct
