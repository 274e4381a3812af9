"""Child processes of the HIL runner: each in its own process group, killed whole when it runs too long
or when the runner is interrupted (a pytest run, a peer benchmark or a sanitizer run leaves no orphan
behind that would keep holding the GPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import IO, Sequence

__all__ = ["run_in_group"]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_in_group(cmd: Sequence[str], *, cwd: Path | None, stdout: IO[str], env: dict[str, str] | None,
                 timeout_s: float) -> int | None:
    """Run ``cmd`` in a new session (stderr into ``stdout``) and return its exit status, or None when it ran
    past ``timeout_s`` and was killed with every process it started. Any exception while waiting (a
    ``KeyboardInterrupt`` above all) kills the group too, then propagates."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    except BaseException:
        _kill_group(proc)
        raise
