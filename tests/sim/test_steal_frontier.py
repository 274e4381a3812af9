"""sim.steal_frontier: the grid it replays, and bad arguments refused (no replay runs here)."""

from __future__ import annotations

import pytest

from sim import steal_frontier as sf


def test_the_grid_is_every_cap_steal_and_slack_once() -> None:
    grid = sf.settings()
    assert len(grid) == len(sf.FRACTIONS) * 2 * len(sf.SLACKS) == len({p.name for p in grid})
    by_name = {p.name: p for p in grid}
    c = by_name["f1024-s1-p0.005"]
    assert (c.chunk_max_fraction, c.stream_ordered_steal, c.page_slack) == (1 / 1024, True, 0.005)
    assert not by_name["f256-s0-p0.02"].stream_ordered_steal


def test_an_unknown_trace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sf.main(["--traces", "bert"])
    assert exc.value.code == 2
    assert "invalid choice: 'bert'" in capsys.readouterr().err
