"""A tiny random-weight mlx-lm model directory, built in seconds, for tests.

It has a real byte-level BPE tokenizer (so text round-trips) and a chat template,
so every code path that loads a model directory runs against it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out: Path, corpus: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "unk_token": None,
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )
    return tok.get_vocab_size()


def build_tiny_model(out: Path, *, seed: int = 0, quantize: bool = False, model_type: str = "llama",
                     head_dim: int = 16, dtype: str = "float32", hidden: int = 64, ffn: int = 128,
                     heads: int = 4, kv_heads: int = 2, tie: bool = True, vocab_multiple: int = 1) -> Path:
    """Write an mlx-lm model directory (config.json, model.safetensors, tokenizer) to ``out``.

    ``head_dim`` 64 and ``dtype`` float16 give the shape the GPU's tile-wise attention
    kernels take (they cover fp16/bf16 and head sizes 64 and 128 only); ``hidden`` and
    ``ffn`` multiples of 1024 (quantized, fp16) the one-row layer-tail kernel's. ``tie``
    False gives the model a head of its own; ``vocab_multiple`` pads the vocabulary (rows
    no token id reaches) to a multiple, as real checkpoints are (the argmax kernel reads
    rows of whole 16-byte chunks)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    corpus = [
        "The quick brown fox jumps over the lazy dog. " * 4,
        "What is the capital of France? Paris is the capital of France.",
        "Hello, world! Numbers: 0123456789. Ünïcödé and emoji 😀 too.",
        "user assistant system im_start im_end",
    ]
    vocab = build_tokenizer(out, corpus)
    vocab = -(-vocab // vocab_multiple) * vocab_multiple
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "max_position_embeddings": 4096,
        "eos_token_id": SPECIAL.index("<|im_end|>"),
    }
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Scale weights up a little so greedy decoding does not collapse to one token.
    params = dict(tree_flatten(model.parameters()))
    params = {k: (v * 4.0 if v.ndim == 2 else v).astype(getattr(mx, dtype)) for k, v in params.items()}
    model.load_weights(list(params.items()))
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_tiny_gguf(model_dir: Path, path: Path) -> Path:
    """Write ``model_dir`` (an fp32 tiny llama) as a llama.cpp-style GGUF file.

    Q/K rows are permuted the way llama.cpp's converter does it, and the tokenizer
    goes into the metadata, so converting the file back must reproduce the model.
    """
    import mlx.core as mx
    import numpy as np

    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    hd = config["head_dim"]
    out = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            part = names[module]
            if part in ("attn_q", "attn_k"):
                heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
                # llama.cpp convert_hf_to_gguf.py's permute(): interleave each head's rotary halves.
                w = w.reshape(heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            out[f"blk.{layer}.{part}.{kind}"] = w
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    types = np.ones(len(tokens), dtype=np.int32)
    for t in SPECIAL:
        types[tokens.index(t)] = 3
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types),
        "tokenizer.ggml.bos_token_id": u32(tokens.index("<|im_start|>")),
        "tokenizer.ggml.eos_token_id": u32(tokens.index("<|im_end|>")),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    mx.save_gguf(str(path), out, meta)
    return path
