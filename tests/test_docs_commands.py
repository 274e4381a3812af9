"""The README and the guides say what the command line does: the README's synopsis of ``gpumem replay``
names every option ``gpumem replay --help`` has, and the out-of-memory guide's commands run one after
another as written (a ``gpumem report --out`` into a folder an earlier command wrote is refused
without ``--force``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gpumem.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _subparser(name: str):
    parser = build_parser()
    for action in parser._actions:  # argparse keeps the subcommands here
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and name in choices:
            return choices[name]
    raise LookupError(name)


def test_readme_replay_synopsis_names_every_option():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("gpumem replay TRACE [")
    synopsis = readme[start:readme.index("```", start)]
    options = {s for a in _subparser("replay")._actions for s in a.option_strings
               if s.startswith("--") and s not in ("--help", "--verbose")}
    missing = sorted(o for o in options if o not in synopsis)
    assert not missing, f"README's gpumem replay synopsis lacks {missing}"


def _commands(text: str) -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("gpumem "):
                out.append(shlex.split(line))
    return out


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_out_of_memory_guide_never_reports_into_a_folder_already_written():
    written: set[str] = set()
    for argv in _commands((ROOT / "docs" / "out-of-memory.md").read_text(encoding="utf-8")):
        cmd = argv[1]
        out = _opt(argv, "--out")
        if cmd == "record" and out:
            written.add(out)
            if "--report" in argv[:argv.index("--")]:
                written.add(f"{out}/report")
        elif cmd == "report" and out:
            assert out not in written or "--force" in argv, \
                f"`{shlex.join(argv)}` is refused: an earlier command of the guide wrote {out}"
            written.add(out)


def _table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of the markdown table whose header line starts with ``header_start``."""
    lines = text[text.index(header_start):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _pct(cell: str) -> float:
    return float(re.search(r"([\d.]+) %", cell).group(1))


#: Traces of the docs' tables cheap enough to replay in a test (the others take up to a minute each).
_FAST = ("gpt2_train", "gpt2_bf16_train_h200", "cudagraph_train_h200", "multistream_infer_h200",
         "resnet_train")



@pytest.mark.slow
def test_allocator_and_backends_tables_match_what_gpumem_replay_prints():
    """docs/allocator.md's table of every trace (GPU idle and behind) and docs/backends.md's gpumem rows say
    their GPU timing and give what `gpumem replay` prints under it: two rows were stale (llama_generate 2.16 %
    where it prints 3.45 %), and backends.md gave GPU-idle figures under the default command."""
    from gpumem.replay import replay_trace

    from gpumem.trace import load_trace

    def overhead(trace: str, timing: str, step_marks: bool = True) -> float:
        path = next((ROOT / "data" / "traces").glob(f"{trace}.*"))
        return round(replay_trace(load_trace(path, progress=False, step_marks=step_marks), "sim:h200-141gb",
                                  "gpumem", progress=False, gpu_timing=timing).overhead * 100, 2)

    allocator = (ROOT / "docs" / "allocator.md").read_text(encoding="utf-8")
    rows = _table_rows(allocator, "| trace | part | step marks | GPU idle (`--gpu-timing idle`) | GPU behind "
                                  "(`--gpu-timing trace`")
    checked = 0
    for name, _, _, idle, behind, unmarked in rows:
        trace = name.split(" ")[0]
        if trace in _FAST:
            assert (_pct(idle), _pct(behind)) == (overhead(trace, "idle"), overhead(trace, "trace")), name
            assert _pct(unmarked) == overhead(trace, "trace", step_marks=False), name
            checked += 1
    assert checked >= 4
    backends = (ROOT / "docs" / "backends.md").read_text(encoding="utf-8")
    header = "| trace | allocator | peak live | peak reserved | overhead, GPU idle |"
    assert "GPU behind (default) |" in backends[backends.index(header):].splitlines()[0]
    for cells in _table_rows(backends, header):
        if cells[1] == "gpumem" and cells[0] in _FAST:
            assert (_pct(cells[4]), _pct(cells[8])) == (overhead(cells[0], "idle"), overhead(cells[0], "trace"))
