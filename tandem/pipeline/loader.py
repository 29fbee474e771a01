"""Load an mlx-lm model directory in the weight format that runs fastest here.

On the CPU the quantized matmul kernel of ``mlx[cpu]`` runs at a few GFLOP/s while
a dense fp32 matmul through MKL runs at ~150, so ``auto`` dequantizes quantized
checkpoints to fp32 there (docs/cpu-performance.md has the measurements). On a GPU
``auto`` loads a checkpoint as stored: the runner then chooses per layer and per device
memory (on CUDA, tandem's 4-bit kernels read a quantized checkpoint at a quarter of the
fp16 bytes, and a dense copy joins them only where memory allows:
``kernels/cuda/linear.choose_weight_format``). ``dense`` dequantizes everywhere;
``quantized`` runs the weights as stored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import tandem
import mlx.core as mx
import mlx.nn as nn

from tandem.pipeline.model_store import ModelError

log = logging.getLogger("tandem.loader")

WEIGHT_FORMATS = ("auto", "dense", "quantized")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    model_id: str
    path: Path
    config: dict
    eos_token_ids: set[int]
    weights: str  # what actually runs: "quantized", "dense-float32", "dense-float16", ...

    def describe(self) -> str:
        return f"model {self.model_id}: weights {self.weights}, device {mx.default_device()}, BLAS {tandem.BLAS}"


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def dense_dtype() -> mx.Dtype:
    return mx.float16 if _on_gpu() else mx.float32


def load_model(path: str | Path, weights: str = "auto", *, lazy: bool = False) -> LoadedModel:
    """Load model and tokenizer; raise :class:`ModelError` with one clear line on failure."""
    from mlx_lm.utils import dequantize_model, load_model as mlx_load_model, load_tokenizer

    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"weights={weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} has no config.json: not an mlx-lm model directory") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    try:
        model, config = mlx_load_model(path, lazy=True)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (FileNotFoundError, ValueError, KeyError, RuntimeError, OSError) as exc:
        raise ModelError(f"cannot load the model in {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    if _is_quantized(model) and (weights == "dense" or (weights == "auto" and not _on_gpu())):
        packed = _packed_weights(model)
        model = dequantize_model(model)
        # The 4-bit codes stay alongside the dense weights: the CPU decode step can multiply
        # them directly (q4_kernels; it checks they expand to exactly these dense values).
        model._tandem_packed = packed
        _cast_floating(model, dense_dtype())
        what = f"dense-{str(dense_dtype()).split('.')[-1]} (dequantized)"
    elif _is_quantized(model):
        what = "quantized"
    else:
        if mx.default_device() == mx.cpu:
            _cast_floating(model, mx.float32)  # fp16/bf16 matmuls are not BLAS-backed on the CPU
        what = "dense-" + str(next(iter(_float_dtypes(model)), "float32")).split(".")[-1]
    if not lazy:
        try:
            mx.eval(model.parameters())
        except (RuntimeError, ValueError) as exc:
            raise ModelError(f"the weights in {path} are corrupt or truncated: {exc}") from None
    eos = set(tokenizer.eos_token_ids or [])
    loaded = LoadedModel(model, tokenizer, path.name, path, config, eos, what)
    log.info(loaded.describe())
    return loaded


def _packed_weights(model: nn.Module) -> dict:
    """name -> (weight, scales, biases, group_size, fp16 scales) of every 4- and 8-bit affine
    layer, as numpy."""
    import numpy as np

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits in (4, 8) \
                and getattr(m, "mode", "affine") == "affine" and m.get("biases") is not None:
            mx.eval(m.weight, m.scales, m.biases)
            fp16 = m.scales.dtype == mx.float16
            if m.scales.dtype not in (mx.float16, mx.float32):
                continue
            out[name] = (np.array(m.weight), np.array(m.scales.astype(mx.float32)),
                         np.array(m.biases.astype(mx.float32)), m.group_size, fp16)
    return out


def _float_dtypes(model: nn.Module) -> set:
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def _cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
