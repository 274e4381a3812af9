"""Progress bars, drawn by tqdm, shown only on a terminal and only for long work.

The rest of gpumem calls :func:`progress`, which returns a ``tqdm`` bar, or a
:class:`NoProgress` that does nothing when the bar is disabled or the output is
not a terminal (so logs, pipes and tests stay clean)::

    bar = progress(total_nbytes, "load gpt2_train", "B")
    bar.update(64 * 1024)     # relative steps, as in tqdm
    bar.close()

:class:`ProgressBar` keeps the older absolute-count interface (``update(done)``)
used by :func:`gpumem.replay.replay`.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["NoProgress", "ProgressBar", "progress"]

#: Seconds before a bar appears: work that finishes sooner draws nothing.
DELAY_S = 0.5


class NoProgress:
    """The bar used when progress is off: every method does nothing."""

    n = 0

    def update(self, n: float = 1) -> None:
        """Ignore ``n`` steps."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: float | None, desc: str = "", unit: str = "it", *, enabled: bool | None = None,
             stream: TextIO | None = None, delay_s: float = DELAY_S) -> Any:
    """A tqdm bar of ``total`` steps named ``desc``, or a :class:`NoProgress`.

    ``enabled=None`` shows the bar only when ``stream`` (default: ``sys.stderr``)
    is a terminal; ``False`` never, ``True`` always. ``unit="B"`` scales to
    KB/MB/GB. The bar appears only after ``delay_s`` seconds of work.
    """
    out = stream if stream is not None else sys.stderr
    if enabled is None:
        isatty = getattr(out, "isatty", None)
        enabled = bool(isatty()) if callable(isatty) else False
    if not enabled:
        return NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=out, delay=delay_s, leave=False, dynamic_ncols=True)


class ProgressBar:
    """``bar.update(done)`` moves the bar to ``done`` of ``total`` steps; ``bar.close()`` ends it.

    A thin absolute-count wrapper over :func:`progress`, with the same visibility rules.
    """

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None, delay_s: float = DELAY_S,
                 enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self._bar = progress(self.total, label, "op", enabled=enabled, stream=stream, delay_s=delay_s)
        self.enabled = not isinstance(self._bar, NoProgress)
        self._done = 0

    def update(self, done: int) -> None:
        """Advance to ``done`` steps in all (never backwards)."""
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done

    def close(self, done: int | None = None) -> None:
        """Finish the bar (at ``done`` steps when given) and clear its line."""
        if done is not None:
            self.update(done)
        self._bar.close()
