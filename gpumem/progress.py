"""A minimal terminal progress bar (no dependency), shown only on a terminal and only for long work."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``bar.update(done)`` redraws at most ten times a second, and only after ``delay_s``
    has passed and when ``stream`` is a terminal; ``bar.close()`` ends the line."""

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None, delay_s: float = 0.5,
                 enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._start < self.delay_s or now - self._last_draw < 0.1:
            return
        self._last_draw = now
        self._draw(done, now)

    def _draw(self, done: int, now: float) -> None:
        frac = min(done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        elapsed = now - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {frac:6.1%} "
                          f"{done:,}/{self.total:,}  {elapsed:5.1f}s elapsed, {eta:5.1f}s left ")
        self.stream.flush()
        self._drawn = True

    def close(self, done: int | None = None) -> None:
        if self._drawn:
            self._draw(self.total if done is None else done, time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
