"""Child processes of the HIL runner: each in its own process group, killed whole when it runs too long
or when the runner is interrupted (a pytest run, a peer benchmark or a sanitizer run leaves no orphan
behind that would keep holding the GPU). Their logs name files relative to the checkout they ran in,
so a record's logs carry no path of the machine that made them."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Sequence

__all__ = ["MAX_TIMEOUT_S", "kill_group", "run_in_group", "timeout_seconds"]

#: The longest timeout accepted: beyond it (or ``inf``, ``nan``) a timeout means nothing, and an infinite one
#: overflowed in a child's wait.
MAX_TIMEOUT_S = 1e6


def timeout_seconds(text: str) -> float:
    """An argparse type for a timeout: a finite number of seconds above 0, at most :data:`MAX_TIMEOUT_S`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, finite and at most "
                                         f"{MAX_TIMEOUT_S:g}, got {text!r}")
    return value


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc`` (started in a session of its own) and every process it started, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()  # if the group could not be signalled
    proc.wait()


def _relativize(log_path: Path, root: Path) -> None:
    """Write ``log_path`` again with ``root/`` taken off every path in it."""
    prefix = f"{root.resolve()}/"
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if prefix in text:
        log_path.write_text(text.replace(prefix, ""), encoding="utf-8")


def run_in_group(cmd: Sequence[str], *, cwd: Path, log_path: Path, env: dict[str, str] | None,
                 timeout_s: float) -> int | None:
    """Run ``cmd`` in ``cwd`` in a new session, its stdout and stderr into ``log_path``, and return its exit
    status, or None when it ran past ``timeout_s`` and was killed with every process it started. Any
    exception while waiting (a ``KeyboardInterrupt`` above all) kills the group too, then propagates.
    The log's paths under ``cwd`` are made relative to it."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None
        except BaseException:
            kill_group(proc)
            raise
        finally:
            log.flush()
            _relativize(log_path, cwd)
