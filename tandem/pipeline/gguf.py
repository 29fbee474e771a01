"""Convert a llama-architecture GGUF file (as mlx loads it) into an mlx-lm model directory.

``mx.load(gguf, return_metadata=True)`` already returns Q4_0/Q4_1/Q8_0 tensors in
mlx's affine quantized layout (packed ``weight`` + ``scales`` + ``biases``, group size
32), so conversion is renaming, undoing llama.cpp's Q/K row permutation, and
rebuilding the tokenizer and chat template from the metadata.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

import tandem  # noqa: F401  (BLAS choice precedes mlx)
import mlx.core as mx

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL_TOKEN = 3  # llama.cpp token type for special/control tokens


class GGUFError(ValueError):
    """The GGUF file cannot be converted; the message says why."""


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.scales``) to its mlx-lm name."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise GGUFError(f"unsupported tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    m = re.fullmatch(r"(\w+)\.(weight|scales|biases)", gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"unsupported tensor {gguf_name!r}")


def unpermute_rows(n_heads: int, rows: int) -> np.ndarray:
    """Row gather that undoes llama.cpp's Q/K permutation.

    llama.cpp stores each head's rotary pairs interleaved (rows 2i, 2i+1 of a head
    form a pair) so that it can run RoPE in the "traditional" layout; Hugging Face
    and mlx-lm's default RoPE pair row i with row i + head_dim/2. Returns ``src`` such
    that ``hf_rows = gguf_rows[src]``.
    """
    head_dim = rows // n_heads
    if head_dim * n_heads != rows or head_dim % 2:
        raise GGUFError(f"{rows} rows do not split into {n_heads} heads of even size")
    return np.arange(rows).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _scalar(meta: dict, key: str):
    if key not in meta:
        raise GGUFError(f"metadata key {key!r} is missing")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def model_config(meta: dict, n_tensors_vocab: int) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"architecture {arch!r} is not supported (only llama)")
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": hidden // n_heads,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": n_tensors_vocab,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "tie_word_embeddings": True,
        "rope_traditional": False,
    }
    return config


def convert_weights(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    perms = {
        "attn_q": unpermute_rows(config["num_attention_heads"], config["num_attention_heads"] * config["head_dim"]),
        "attn_k": unpermute_rows(config["num_key_value_heads"], config["num_key_value_heads"] * config["head_dim"]),
    }
    for name, value in weights.items():
        part = name.split(".")[2] if name.startswith("blk.") else None
        if part in perms:
            # Quantization groups run along the input dimension, so a row gather
            # permutes packed weights, scales and biases alike.
            value = value[mx.array(perms[part])]
        out[hf_name(name)] = value
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    return out


def tokenizer_files(meta: dict) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json contents for a gpt2-style BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"tokenizer model {_scalar(meta, 'tokenizer.ggml.model')!r} is not supported (only gpt2 BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = np.array(meta["tokenizer.ggml.token_type"]) if "tokenizer.ggml.token_type" in meta else np.ones(len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # SmolLM's tokenizer splits numbers into single digits before byte-level BPE.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i in np.flatnonzero(types == _CONTROL_TOKEN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos = tokens[int(_scalar(meta, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_scalar(meta, "tokenizer.ggml.eos_token_id"))]
    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tokens[int(pad_id.item())] if pad_id is not None else eos,
        "unk_token": None,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in meta else False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "additional_special_tokens": [t for t in special if t not in (bos, eos)],
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(tok_config, indent=1)}


def convert(gguf_path: Path, out_dir: Path, progress=None) -> dict:
    """Write an mlx-lm model directory for ``gguf_path`` into ``out_dir`` (which must exist).

    ``progress(step, total, what)`` is called between stages. Returns the config.
    """
    steps = ("reading GGUF", "mapping weights", "writing weights", "writing tokenizer")
    report = progress or (lambda *a: None)
    report(0, len(steps), steps[0])
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError with its own text
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    vocab = int(weights["token_embd.weight"].shape[0]) if "token_embd.weight" in weights else 0
    config = model_config(meta, vocab)
    report(1, len(steps), steps[1])
    converted = convert_weights(weights, config)
    if any(k.endswith(".scales") for k in converted):
        # mlx-lm infers each layer's bits from the packed shapes; this is the default.
        config["quantization"] = {"group_size": 32, "bits": 4}
    report(2, len(steps), steps[2])
    mx.save_safetensors(str(out_dir / "model.safetensors"), converted, metadata={"format": "mlx"})
    report(3, len(steps), steps[3])
    for name, text in tokenizer_files(meta).items():
        (out_dir / name).write_text(text)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return config
