"""Checks the studies' command lines share: a ``--json`` target checked before a study runs (minutes on the
corpus), so that a path that cannot be written is refused in one line, not after the study."""

from __future__ import annotations

import os
from pathlib import Path


def json_target_problem(path: Path) -> str:
    """Why rows cannot be written to ``path`` (a folder, a missing folder, no write permission), or ``""``."""
    if path.is_dir():
        return f"{path} is a folder"
    if not path.parent.is_dir():
        return f"no folder {path.parent}"
    if os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK):
        return ""
    return f"cannot write {path}"
