"""The README and the guides say what the command line does: the README's synopsis of ``gpumem replay``
names every option ``gpumem replay --help`` has, and the out-of-memory guide's commands run one after
another as written (a ``gpumem report --out`` into a folder an earlier command wrote is refused
without ``--force``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

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
