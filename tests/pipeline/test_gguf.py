"""GGUF → mlx-lm conversion: names, Q/K row order, tokenizer, and a full round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tandem  # noqa: F401
import mlx.core as mx

from tandem.pipeline import gguf
from tandem.pipeline.gguf import GGUFError, convert, hf_name, unpermute_rows
from tandem.pipeline.generate import generate_tokens
from tandem.pipeline.loader import load_model
from tests.tiny_model import build_tiny_gguf


@pytest.mark.parametrize(
    "src,dst",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.biases", "model.layers.12.self_attn.k_proj.biases"),
        ("blk.3.attn_v.scales", "model.layers.3.self_attn.v_proj.scales"),
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("blk.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"),
        ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ],
)
def test_tensor_names_map_to_mlx_lm(src, dst):
    assert hf_name(src) == dst


@pytest.mark.parametrize("bad", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.x.attn_q.weight"])
def test_unknown_tensor_names_are_refused(bad):
    with pytest.raises(GGUFError, match="unsupported tensor"):
        hf_name(bad)


@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (4, 16), (1, 2)])
def test_unpermute_inverts_llama_cpp_permute(heads, head_dim):
    rows = heads * head_dim
    hf = np.arange(rows * 3).reshape(rows, 3)
    # llama.cpp convert_hf_to_gguf.py permute()
    stored = hf.reshape(heads, 2, head_dim // 2, 3).swapaxes(1, 2).reshape(rows, 3)
    assert not np.array_equal(stored, hf) or head_dim == 2
    np.testing.assert_array_equal(stored[unpermute_rows(heads, rows)], hf)


def test_unpermute_rejects_odd_head_split():
    with pytest.raises(GGUFError):
        unpermute_rows(3, 10)


def test_round_trip_reproduces_the_model(tiny_model_dir, tmp_path):
    """tiny model → llama.cpp-style GGUF → convert → identical greedy tokens and tokenizer."""
    path = build_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    out = tmp_path / "converted"
    out.mkdir()
    steps = []
    config = convert(path, out, progress=lambda i, n, what: steps.append((i, n)))
    assert steps == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert config["rope_traditional"] is False and config["tie_word_embeddings"] is True

    original = load_model(tiny_model_dir, "dense")
    converted = load_model(out, "dense")
    prompt = original.tokenizer.encode("The quick brown fox")
    assert converted.tokenizer.encode("The quick brown fox") == prompt
    assert generate_tokens(converted, prompt, max_tokens=24) == generate_tokens(original, prompt, max_tokens=24)
    assert converted.eos_token_ids == original.eos_token_ids


def test_keeping_gguf_row_order_needs_traditional_rope(tiny_model_dir, tmp_path):
    """The two documented ways to handle llama.cpp's Q/K order agree; the wrong pairing does not."""
    from mlx_lm.utils import load_model as mlx_load_model

    path = build_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    out = tmp_path / "converted"
    out.mkdir()
    convert(path, out)
    weights, _ = mx.load(str(path), return_metadata=True)
    reference, _ = mlx_load_model(out)
    x = mx.array([[5, 17, 42, 3, 99, 7]])
    expected = reference(x)

    raw = {gguf.hf_name(k): v for k, v in weights.items()}  # GGUF row order kept
    config = json.loads((out / "config.json").read_text())
    for traditional, should_match in ((True, True), (False, False)):
        config["rope_traditional"] = traditional
        (out / "config.json").write_text(json.dumps(config))
        model, _ = mlx_load_model(out)
        model.load_weights(list(raw.items()))
        matches = mx.allclose(model(x), expected, atol=1e-4).item()
        assert matches is should_match


def test_non_llama_and_unreadable_files_are_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file, just text")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert(bad, tmp_path)
    other = tmp_path / "other.gguf"
    mx.save_gguf(str(other), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "mamba"})
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        convert(other, tmp_path)
