"""The corpus of real traces (data/traces) and its one tuning/check split (gpumem.trace.corpus, issue 18)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumem.cli import EXIT_OK, main
from gpumem.errors import InvalidArgumentError
from gpumem.trace import load_trace
from gpumem.trace.corpus import CHECK, TUNING, CorpusPart, corpus_part, corpus_traces

#: the traces recorded for issue 18 (the others predate the split)
NEW = sorted(n for n in TUNING + CHECK if "_h200." in n)


def _trace_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(".gz"))


def test_every_trace_is_in_exactly_one_part(shared_traces: Path) -> None:
    assert not set(TUNING) & set(CHECK)
    assert sorted(TUNING + CHECK) == _trace_files(shared_traces)
    assert len(NEW) >= 8 and sum(n in CHECK for n in NEW) >= 4


def test_the_readme_lists_the_split(shared_traces: Path) -> None:
    readme = (shared_traces / "README.md").read_text()
    for name in TUNING + CHECK:
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| {name} |")), None)
        assert row is not None, name
        assert f"| {corpus_part(name).value} |" in row, name


def test_corpus_part_and_corpus_traces(shared_traces: Path) -> None:
    assert corpus_part("data/traces/gpt2_train.snapshot.pickle.gz") is CorpusPart.TUNING
    assert corpus_part(CHECK[0]) is CorpusPart.CHECK
    assert [p.name for p in corpus_traces("check")] == list(CHECK)
    assert [p.name for p in corpus_traces()] == list(TUNING + CHECK)
    assert all(p.is_file() for p in corpus_traces(folder=shared_traces))
    with pytest.raises(InvalidArgumentError, match="neither the tuning nor the check part"):
        corpus_part("my_trace.pickle.gz")
    with pytest.raises(InvalidArgumentError, match="unknown corpus part"):
        corpus_traces("training")


@pytest.mark.parametrize("name", NEW)
def test_new_traces_read_whole_and_stay_small(shared_traces: Path, name: str) -> None:
    path = shared_traces / name
    assert path.stat().st_size < 2 * 2**20
    trace = load_trace(path)
    assert trace.n_allocs > 100 and trace.peak_live_nbytes > 2**20


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_gpumem_replay_accepts_each_new_trace(shared_traces: Path, name: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(shared_traces / name), "--device", "sim:h200-141gb"]) == EXIT_OK
    assert "peak reserved" in capsys.readouterr().out
