"""Load an mlx-lm model directory in the weight format that runs fastest here.

On the CPU the quantized matmul kernel of ``mlx[cpu]`` runs at a few GFLOP/s while
a dense fp32 matmul through MKL runs at ~150 (docs/cpu-performance.md has the
measurements), so ``auto`` keeps a quantized checkpoint packed only where tandem's own
4-bit kernels run it (a llama-family model the fused CPU forward supports, AVX-512):
decode multiplies the codes directly and a prefill expands one matrix at a time into a
reused buffer for BLAS, so the weights are resident once, as stored (a 4-bit 8B model
fits a 24 GB machine; its dense fp32 copy would not). Elsewhere on the CPU ``auto``
dequantizes to fp32. On a GPU
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
        from tandem import _blas

        text = f"model {self.model_id}: weights {self.weights}, device {mx.default_device()}, BLAS {tandem.BLAS}"
        if not _on_gpu() and _blas.openblas_sgemm() is not None:
            text += f", prefill products on OpenBLAS's {_blas.openblas_core()} kernels"
            if tandem.OPENBLAS_REPLACED:
                text += f" (not the environment's OPENBLAS_CORETYPE={tandem.OPENBLAS_REPLACED}, which leaves AVX-512 unused)"
        return text


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

    if weights == "auto" and _is_quantized(model) and not _on_gpu() and _runs_packed(model):
        # The CPU's fused forward multiplies the packed codes directly (decode) and expands
        # one matrix at a time into a reused buffer (prefill): no dense copy is made.
        model._tandem_packed = PackedModules(model)
        _cast_floating(model, mx.float32, keep_quantization=True)  # norms, biases: the C kernels' fp32
        what = "quantized (packed, tandem's 4-bit kernels)"
    elif _is_quantized(model) and (weights == "dense" or (weights == "auto" and not _on_gpu())):
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


def _as_numpy(m: nn.Module) -> tuple:
    import numpy as np

    mx.eval(m.weight, m.scales, m.biases)
    # Widened in numpy: an mlx astype would leave its result's memory in mlx's cache.
    return (np.array(m.weight), np.array(m.scales).astype(np.float32), np.array(m.biases).astype(np.float32),
            m.group_size, m.scales.dtype == mx.float16)


def _packed_weights(model: nn.Module) -> dict:
    """name -> (weight, scales, biases, group_size, fp16 scales) of every 4- and 8-bit affine
    layer, as numpy."""
    from tandem.pipeline.runners.cpu.fast_llama import kernel_layout

    return {name: _as_numpy(m) for name, m in model.named_modules() if kernel_layout(m)}


class PackedModules:
    """The packed weights of a model that stays quantized: what :func:`_packed_weights`
    returns, read from the model's own modules one at a time when asked (so the kernels'
    copy is made a matrix at a time, never the whole model twice), and ``dense(name)``:
    a module's values as mlx dequantizes them, to check the kernels' expansion against."""

    packed_only = True  # what fast_llama.packed_only looks for

    def __init__(self, model: nn.Module):
        from tandem.pipeline.runners.cpu.fast_llama import kernel_layout

        self._modules = {name: m for name, m in model.named_modules() if kernel_layout(m)}

    def __contains__(self, name: str) -> bool:
        return name in self._modules

    def __getitem__(self, name: str) -> tuple:
        return _as_numpy(self._modules[name])

    def __len__(self) -> int:
        return len(self._modules)

    def dense(self, name: str, rows=None) -> mx.array:
        """Module ``name``'s values as mlx dequantizes them (only ``rows``, where given)."""
        m = self._modules[name]
        w, s, b = m.weight, m.scales, m.biases
        if rows is not None:
            idx = mx.array(rows)
            w, s, b = w[idx], s[idx], b[idx]
        return mx.dequantize(w, s, b, m.group_size, m.bits).astype(mx.float32)


def packed_only(model: nn.Module) -> bool:
    """Whether ``model`` holds its projections only as packed codes (no dense copy)."""
    from tandem.pipeline.runners.cpu.fast_llama import packed_only as check

    return check(model)


def dequantize_in_place(model: nn.Module) -> None:
    """Turn a packed-only model into the dense fp32 model ``auto`` used to load, its packed
    codes kept for the 4-bit decode step: for a runner that cannot run it packed (the C
    kernels switched off)."""
    from mlx_lm.utils import dequantize_model

    packed = _packed_weights(model)
    dequantize_model(model)
    for attr in ("_tandem_native", "_tandem_fused"):  # built for the packed form
        if hasattr(model, attr):
            delattr(model, attr)
    model._tandem_packed = packed
    _cast_floating(model, dense_dtype())
    mx.eval(model.parameters())


def _runs_packed(model: nn.Module) -> bool:
    """Whether the CPU runner can run ``model`` from its packed weights alone: the fused
    forward supports it and tandem's 4-bit kernels build here."""
    from tandem.kernels.cpu import q4_kernels
    from tandem.pipeline.runners.cpu import fast_llama

    return fast_llama.supports_packed(model) is None and q4_kernels.available()


def _float_dtypes(model: nn.Module) -> set:
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def _cast_floating(model: nn.Module, dtype: mx.Dtype, keep_quantization: bool = False) -> None:
    """Cast every floating parameter to ``dtype``; with ``keep_quantization`` not the scales
    and offsets of quantized layers (their precision is part of the values they give)."""
    from mlx.utils import tree_flatten, tree_unflatten

    def cast(k: str) -> bool:
        return not (keep_quantization and k.rsplit(".", 1)[-1] in ("scales", "biases"))

    params = [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and cast(k) else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
