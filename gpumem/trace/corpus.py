"""The project's trace corpus (``data/traces``) and its split into a tuning part and a check part.

Note [Tuning and check traces]: a policy tuned on the traces that also judge it is judged by its own
training data: the CHUNKS growth rule held 0.53-0.71 % on the four traces it was tuned on and 3.37 % on
a Llama trace it had never seen (issue 18). So the corpus is split once, by the explicit lists below
(also in ``data/traces/README.md``): policy decisions (sweeps, defaults, knob choices) may look at
:data:`TUNING` only; :data:`CHECK` is what a decision is judged on, and every table that reports the
corpus reports the two parts apart (:func:`corpus_part`). The split is fixed: a trace never moves
from one part to the other, and a new trace is added to one part when it is added to the folder (the
test ``tests/trace/test_trace_corpus.py`` fails on a trace in neither list). The traces that existed
before the split were what the default policy was tuned on: they are tuning traces.
"""

from __future__ import annotations

import enum
from pathlib import Path

from ..errors import InvalidArgumentError

__all__ = ["CorpusPart", "TUNING", "CHECK", "corpus_part", "corpus_traces", "default_corpus_dir"]


class CorpusPart(str, enum.Enum):
    """Which part of the corpus a trace belongs to (Note [Tuning and check traces])."""

    TUNING = "tuning"
    CHECK = "check"


#: Traces policy decisions may look at.
TUNING: tuple[str, ...] = (
    "gpt2_train.snapshot.pickle.gz",
    "resnet_train.snapshot.pickle.gz",
    "resnet_train.rmm_log.csv.gz",
    "llama_generate.trace.pickle.gz",
    "bert_varlen.trace.pickle.gz",
    "gpt2_fp32_train_h200.snapshot.pickle.gz",
    "resnet50_train_h200.snapshot.pickle.gz",
    "moe_train_h200.snapshot.pickle.gz",
    "gpt2_bf16_train_h200.snapshot.pickle.gz",
    "cudagraph_train_h200.snapshot.pickle.gz",
)

#: Traces that judge policy decisions and are never looked at to make one.
CHECK: tuple[str, ...] = (
    "llama_varlen_train_h200.snapshot.pickle.gz",
    "vit_train_h200.snapshot.pickle.gz",
    "llama_kvcache_generate_h200.snapshot.pickle.gz",
    "unet_train_h200.snapshot.pickle.gz",
    "multistream_infer_h200.snapshot.pickle.gz",
)


def corpus_part(name: str | Path) -> CorpusPart:
    """The part of the corpus the trace file ``name`` (a file name or a path) belongs to.

    Raises:
        InvalidArgumentError: the file is in neither part (not a corpus trace).
    """
    base = Path(name).name
    if base in TUNING:
        return CorpusPart.TUNING
    if base in CHECK:
        return CorpusPart.CHECK
    raise InvalidArgumentError(f"{base!r} is not a trace of the corpus (data/traces): in neither the tuning nor the "
                               "check part (gpumem.trace.corpus)")


def default_corpus_dir() -> Path:
    """``data/traces`` of the checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "data" / "traces"


def corpus_traces(part: CorpusPart | str | None = None, folder: Path | None = None) -> list[Path]:
    """The corpus's trace paths in ``folder`` (default :func:`default_corpus_dir`), of one part or both.

    Raises:
        InvalidArgumentError: ``part`` is not ``tuning``/``check``/None.
    """
    try:
        which = None if part is None else CorpusPart(part)
    except ValueError:
        raise InvalidArgumentError(f"unknown corpus part {part!r}; choose 'tuning' or 'check'") from None
    names = (TUNING if which is not CorpusPart.CHECK else ()) + (CHECK if which is not CorpusPart.TUNING else ())
    root = folder or default_corpus_dir()
    return [root / n for n in names]
