"""Reading Hugging Face configs."""

import json

import pytest

from gpumem.errors import InvalidArgumentError
from gpumem.estimate import ModelShape, from_hf_config

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_llama3_8b_from_dict_and_file(tmp_path):
    shape, nbytes = from_hf_config(LLAMA3_8B)
    assert nbytes == 2
    assert shape.kv_dim == 1024 and shape.head_dim == 128
    assert shape.n_params == 8_030_261_248  # Llama-3-8B's published count
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    assert from_hf_config(path) == (shape, 2)
    assert from_hf_config(str(path)) == (shape, 2)


def test_defaults_dtype_tied_embeddings_and_text_config():
    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "torch_dtype")}
    shape, nbytes = from_hf_config({**cfg, "tie_word_embeddings": True, "head_dim": 64})
    assert nbytes == 2 and shape.n_kv_heads == 32 and shape.head_dim == 64 and shape.tie_word_embeddings
    shape2, nbytes2 = from_hf_config({"text_config": cfg, "torch_dtype": "float32"})
    assert nbytes2 == 4 and shape2.hidden_size == 4096
    assert from_hf_config({**cfg, "dtype": "torch.float16"})[1] == 2


def test_tied_embeddings_drop_one_matrix():
    a = ModelShape(1024, 2816, 4, 32000, 16, 16)
    b = ModelShape(1024, 2816, 4, 32000, 16, 16, tie_word_embeddings=True)
    assert a.n_params - b.n_params == 32000 * 1024


@pytest.mark.parametrize("content, match", [
    ("{not json", "not a JSON file"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"hidden_size": 8}), "missing intermediate_size, num_hidden_layers, vocab_size, num_attention_heads"),
    (json.dumps({**LLAMA3_8B, "torch_dtype": "float64"}), "unknown dtype"),
])
def test_bad_config_is_refused(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=match):
        from_hf_config(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        from_hf_config(tmp_path / "nope.json")
