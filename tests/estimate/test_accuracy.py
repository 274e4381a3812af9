"""The accuracy table against measurements."""

import json

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.estimate.accuracy import compare, main, to_markdown

CFG = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 1000}


def doc(measured):
    return {"meta": {"device": "test"}, "rows": [
        {"kind": "generate", "model": "tiny", "config": CFG, "batch_size": 2, "prompt_len": 32, "new_tokens": 2,
         "status": "ok", "peak_allocated_bytes": measured, "peak_reserved_bytes": measured + 2**20},
        {"kind": "generate", "model": "tiny", "config": CFG, "batch_size": 64, "prompt_len": 32, "new_tokens": 2,
         "status": "oom", "peak_allocated_bytes": 0, "peak_reserved_bytes": 0},
    ]}


def test_compare_reports_the_error_and_skips_failed_rows():
    (row,) = compare(doc(50 * 2**20), reserved=False)
    assert row.error == pytest.approx(row.estimated_peak_allocated_bytes / (50 * 2**20) - 1)
    assert "+" in to_markdown([row]) or "-" in to_markdown([row])


def test_compare_refuses_a_document_without_rows():
    with pytest.raises(InvalidArgumentError, match="rows"):
        compare({"meta": {}})


def test_main_writes_markdown_and_json(tmp_path, capsys):
    src = tmp_path / "m.json"
    src.write_text(json.dumps(doc(60 * 2**20)))
    assert main([str(src), "--out", str(tmp_path / "acc")]) == 0
    assert "1 rows" in (tmp_path / "acc.md").read_text()
    assert json.loads((tmp_path / "acc.json").read_text())["rows"][0]["model"] == "tiny"
