"""`tandem generate` at temperature 0 is token-identical to mlx_lm.generate."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tandem  # noqa: F401
import mlx.core as mx
import mlx.nn as nn

from tandem.pipeline.generate import chat_prompt, generate_tokens, stream
from tandem.pipeline.loader import load_model
from tandem.pipeline.model_store import ModelError

PROMPTS = ["Hello", "The quick brown fox jumps over", "What is the capital of France?"]


def mlx_lm_tokens(model, tokenizer, prompt, max_tokens):
    from mlx_lm.generate import stream_generate

    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


@pytest.mark.parametrize("text", PROMPTS)
def test_quantized_matches_mlx_lm(tiny_quantized_model_dir, text):
    import mlx_lm

    loaded = load_model(tiny_quantized_model_dir, "quantized")
    assert loaded.weights == "quantized"
    model, tokenizer = mlx_lm.load(str(tiny_quantized_model_dir))
    prompt = chat_prompt(tokenizer, text)
    ours = generate_tokens(loaded, prompt, max_tokens=32)
    assert len(ours) > 1
    assert ours == mlx_lm_tokens(model, tokenizer, prompt, 32)


@pytest.mark.parametrize("text", PROMPTS)
def test_dense_matches_mlx_lm_on_dequantized_weights(tiny_quantized_model_dir, text):
    import mlx_lm
    from mlx_lm.utils import dequantize_model

    loaded = load_model(tiny_quantized_model_dir, "dense")
    assert loaded.weights.startswith("dense-float32")
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    model, tokenizer = mlx_lm.load(str(tiny_quantized_model_dir))
    model = dequantize_model(model)
    model.update(nn.utils.tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    prompt = chat_prompt(tokenizer, text)
    assert generate_tokens(loaded, prompt, max_tokens=32) == mlx_lm_tokens(model, tokenizer, prompt, 32)


@pytest.mark.parametrize("gpu,kernels", [(False, False), (False, True), (True, False)])
def test_auto_keeps_a_quantized_checkpoint_where_kernels_run_it(tiny_quantized_model_dir, monkeypatch, gpu, kernels):
    """On a GPU the runner picks the format per device memory (the CUDA 4-bit kernels read
    the checkpoint as stored); on the CPU tandem's 4-bit kernels run it packed, and without
    them it is dequantized (mlx's quantized CPU products are slow)."""
    from tandem.kernels.cpu import q4_kernels
    from tandem.pipeline import loader

    if kernels and not q4_kernels.available():
        pytest.skip("no AVX-512 C kernels here")
    monkeypatch.setattr(loader, "_on_gpu", lambda: gpu)
    monkeypatch.setattr(q4_kernels, "available", lambda: kernels)
    loaded = load_model(tiny_quantized_model_dir, "auto", lazy=True)
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert quantized is (gpu or kernels)
    assert loaded.weights == ("quantized" if gpu else "quantized (packed, tandem's 4-bit kernels)" if kernels
                              else "dense-float32 (dequantized)")
    assert loader.packed_only(loaded.model) is (kernels and not gpu)


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompt = chat_prompt(loaded.tokenizer, "Hello")
    a = generate_tokens(loaded, prompt, max_tokens=16, temperature=1.0, seed=7)
    b = generate_tokens(loaded, prompt, max_tokens=16, temperature=1.0, seed=7)
    c = generate_tokens(loaded, prompt, max_tokens=16, temperature=1.0, seed=8)
    assert a == b and a != c


def test_streamed_text_equals_full_decode(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompt = chat_prompt(loaded.tokenizer, "Numbers: 0123456789 Ünïcödé 😀")
    pieces = list(stream(loaded, prompt, max_tokens=40))
    tokens = [p.token for p in pieces if p.token not in loaded.eos_token_ids]
    assert "".join(p.text for p in pieces) == loaded.tokenizer.decode(tokens)


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_generate_prints_the_oracle_text(tiny_model_dir):
    import mlx_lm

    proc = _cli("generate", "Hello", "--model", str(tiny_model_dir), "--max-tokens", "20", "--quiet")
    assert proc.returncode == 0, proc.stderr
    loaded = load_model(tiny_model_dir)
    expected = "".join(p.text for p in stream(loaded, chat_prompt(loaded.tokenizer, "Hello"), max_tokens=20))
    assert proc.stdout == expected + "\n"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--model", "/nonexistent/model"], {}, "model directory /nonexistent/model does not exist"),
        (["--max-tokens", "0"], {}, "--max-tokens=0 must be at least 1"),
        ([], {"TANDEM_ENGINE_PARALLEL": "lots"}, "engine.parallel='lots' is not a valid int"),
        ([], {"TANDEM_MODEL_WEIGHTS": "int3"}, "choose one of: auto, dense, quantized"),
    ],
)
def test_cli_errors_are_one_line(args, env, message):
    proc = _cli("generate", "hi", *args, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_corrupt_model_file_is_one_clear_error(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError):
        load_model(broken)
    proc = _cli("generate", "hi", "--model", str(broken))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
