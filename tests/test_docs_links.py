"""The README and the guides point at things that exist: every relative link resolves to a file of the
checkout (and its ``#anchor`` to a heading of a Markdown target), every ``python -m MODULE`` and
``python SCRIPT.py`` they show names a module or script of the checkout, and every dotted ``gpumem.``
name they quote is importable (a newcomer after a reorganisation follows these first)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def _slugs(doc: Path) -> set[str]:
    """GitHub's anchors of the headings of ``doc`` (outside code blocks)."""
    out = set()
    for line in FENCE.sub("", _text(doc)).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _relative_links() -> list[tuple[Path, str]]:
    return [(doc, link) for doc in DOCS for link in LINK.findall(FENCE.sub("", _text(doc)))
            if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


def test_the_pages_have_relative_links():
    assert len(_relative_links()) >= 20  # the pattern still finds them


@pytest.mark.parametrize("doc, link", _relative_links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_resolves(doc, link):
    path, _, anchor = link.partition("#")
    target = (doc.parent / path).resolve() if path else doc
    assert target.exists(), f"{doc.relative_to(ROOT)} links to {link}, which does not exist"
    assert ROOT in target.parents or target == ROOT, f"{doc.relative_to(ROOT)} links outside the checkout: {link}"
    if anchor and target.suffix == ".md":
        assert anchor in _slugs(target), f"{doc.relative_to(ROOT)} links to {link}: no such heading"


def _commands(pattern: str) -> list[tuple[str, str]]:
    return sorted({(doc.name, m) for doc in DOCS for m in re.findall(pattern, _text(doc))})


@pytest.mark.parametrize("doc, module", _commands(r"python3? -m ((?:gpumem|hil|sim)(?:\.\w+)*)(?!\w|\.<)"))
def test_python_dash_m_module_exists(doc, module):
    base = ROOT.joinpath(*module.split("."))
    assert (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()), \
        f"{doc} shows `python -m {module}`, which is not a module of the checkout"


@pytest.mark.parametrize("doc, script", _commands(r"python3? ((?:benchmarks|sim|hil|examples)/[\w/]+\.py)"))
def test_python_script_exists(doc, script):
    assert (ROOT / script).is_file(), f"{doc} shows `python {script}`, which does not exist"


def _resolves(name: str) -> bool:
    """Whether ``gpumem.a.b`` is a module, or an attribute reached from the longest importable module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("gpumem"):
                pytest.skip(f"{name}: needs {exc.name}, not installed")
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc, name", _commands(r"`[^`]*?\b(gpumem(?:\.[A-Za-z_]\w*)+)"))
def test_quoted_gpumem_name_exists(doc, name):
    assert _resolves(name), f"{doc} names `{name}`, which gpumem does not have"


def _architecture_paths() -> list[tuple[str, str]]:
    """``(row, path)`` for every file or folder docs/architecture.md's tables name: a path as written, from the
    checkout's root, ``gpumem/`` or ``tests/``, or (a bare file name) inside the folder its row is about."""
    out = []
    for row in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        if not row.startswith("| ") or row.startswith("|---"):
            continue
        cells = row.split(" | ")
        for token in re.findall(r"`([\w./-]+)`", row):
            if "/" in token or re.search(r"\.(py|cpp|h|md|toml)$", token):
                out.append((cells[0].strip("| "), token))
    return out


@pytest.mark.parametrize("row, path", _architecture_paths())
def test_architecture_names_paths_that_exist(row, path):
    bases = [ROOT, ROOT / "gpumem", ROOT / "tests"]
    bases += [ROOT / d.strip("`") for d in re.findall(r"`([\w/]+/)`", row)]
    assert any((base / path).exists() for base in bases), \
        f"docs/architecture.md (row {row}) names {path}, which is not in the checkout"


TOOLS = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for folder in ("sim", "hil/probes")
               for p in (ROOT / folder).glob("*.py") if "ArgumentParser(" in p.read_text(encoding="utf-8"))


@pytest.mark.parametrize("module", TOOLS)
def test_tool_help_names_the_command_the_docs_give(module):
    """docs/architecture.md and docs/hil.md: ``python -m sim.<study>``, ``python -m hil.probes.<probe>``; the
    usage line of ``--help`` says that command (it said the file, ``soak.py``, before)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: python -m {module} "), res.stdout.splitlines()[:1]
