"""Every ``python`` block of docs/estimation.md runs as written, so the page cannot rot."""

import json
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "estimation.md"
TEXT = DOC.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _config() -> dict:
    """The config.json the page writes in its shell example (the Python blocks read it)."""
    (body,) = re.findall(r"<<'JSON'\n(.*?)\nJSON\n", TEXT, re.S)
    return json.loads(body)


def test_the_page_has_python_blocks():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    exec(compile(BLOCKS[index], f"{DOC.name} python block {index + 1}", "exec"), {"__name__": "__doc_block__"})
    assert capsys.readouterr().out
