"""Linear layers for serving: flattened rows, and a weight format chosen per backend.

Flattening: MLX's CUDA quantized matmul treats a ``(B, 1, K)`` input as B separate
one-row products and streams the weights B times; measured on an H200, batch-16 decode
went from 64 to 504 tok/s (4-bit) by reshaping every linear input to ``(B*L, K)`` first.
:func:`flatten_linears` wraps every ``nn.Linear`` / ``nn.QuantizedLinear`` of a model so it
does exactly that; the arithmetic per row is unchanged.

Weight formats (:func:`choose_weight_format`):

* ``quantized``: the stored 4/8-bit weights only (least memory).
* ``dense``: float16 (GPU) / float32 (CPU) weights only.
* ``dual``: both. Products of at most ``small_rows`` rows (default 4, the measured
  crossover: ``quantized_matmul.PREFERRED_MAX_ROWS``) use the quantized weights through
  the multirow CUDA kernel, which reads ~4x fewer bytes; larger ones (prefill, big decode
  batches) use the dense GEMM, which on the H200 is 15-25x faster than MLX's quantized
  GEMM for hundreds of rows. Costs dense + quantized memory.

Chunking: MLX's CUDA quantized GEMM fails to launch (``cudaGraphAddKernelNode ...
invalid argument``) for 64 x 512 rows in one product; :data:`QUANTIZED_MAX_ROWS` is the
most rows one quantized product is given here, larger inputs are split. The engine
should keep ``max_batch_prefill_tokens`` at or below it too.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from tandem.kernels.cuda import qgemv as qg
from tandem.kernels.cuda import quantized_matmul as qmm
from tandem.kernels.cuda import rms_norm_cuda
from tandem.kernels.cuda import swiglu_cuda
from tandem.kernels.cuda import w4gemm
from tandem.kernels.cuda import w4wgmma
from tandem.kernels.cuda import w4mma

log = logging.getLogger("tandem.kernels")

FUSE_MAX_ROWS = 1
"""Most rows for which :meth:`FlatLinear.fused` folds rms_norm / swiglu / residual into
the multirow kernel. The fused kernel re-reads every input row per warp (the norm's sum
of squares, the swiglu's exponentials), which at 4 rows made a decode step slower, not
faster (16.0 ms fused against 12.1 ms unfused at batch 4); from 2 rows the separate ops
are used."""

W4MMA_MAX_ROWS = 8
"""Most rows for which a layer holding 4-bit weights multiplies them on the tensor cores
(``w4mma``, large products only) rather than with the dense fp16 GEMM; 0 turns the kernel
off. It won at batch 6 and 8 and lost at batch 16, so 16 rows stay on the dense GEMM."""

W4G_ROWS = (9, 16)
"""Rows (lowest, highest) for which a layer with packed 4-bit weights multiplies them with
``w4gemm`` rather than the dense fp16 GEMM: it won at batch 16 (+8-10% engine tok/s) and
lost at batch 32, where the step's host-side building slowed for reasons not understood;
from 48 rows the kernel is slower than cuBLAS alone (``mma.sync`` tops out near 240
TFLOPS on the H200)."""
USE_W4G = True
USE_W4WG = True
W4WG_ROWS = (17, 64)
"""Rows for which the packed layers run in one pass over K (gate/up, the head) multiply on
``wgmma`` (``w4wgmma``): +3-7% engine tok/s at batch 64, mixed at batch 32. ``USE_W4G`` /
``USE_W4WG`` are for tests (False: no packed copy / no ``wgmma``)."""

QUANTIZED_MAX_ROWS = 4096
"""Most rows handed to one quantized matmul (4,096 = 8 x 512 ran in the H200 measurements;
32,768 crashed inside MLX)."""

FORMATS = ("quantized", "dense", "dual")

_seen_paths: set[str] = set()


def _note_path(path: str) -> None:
    # One log line per distinct path, the first time it runs: says which kernel served.
    if path not in _seen_paths:
        _seen_paths.add(path)
        log.info("linear path in use: %s", path)


def paths_used() -> list[str]:
    """The matmul paths that have run so far (for logs, tests and the bench)."""
    return sorted(_seen_paths)


class FlatLinear(nn.Module):
    """A linear layer over flattened rows holding dense and/or quantized weights.

    ``weight``: (N, K) dense or None; ``qweight/scales/biases``: MLX affine quantized or
    None; ``bias``: (N,) or None. ``small_rows``: at most this many rows go to the
    quantized multirow kernel when both formats are held.
    """

    def __init__(self, weight=None, qweight=None, scales=None, biases=None, bias=None,
                 group_size: int = 64, bits: int = 4, mode: str = "affine",
                 small_rows: int = qmm.PREFERRED_MAX_ROWS):
        super().__init__()
        if weight is None and qweight is None:
            raise ValueError("FlatLinear needs dense or quantized weights")
        if weight is not None:
            self.weight = weight
        if qweight is not None:
            self.qweight, self.scales = qweight, scales
            if biases is not None:
                self.biases = biases
        if bias is not None:
            self.bias = bias
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.small_rows = small_rows
        self.graph_rows = 0  # see ``capture_rows``
        self.freeze()

    @property
    def has_dense(self) -> bool:
        return "weight" in self

    @property
    def has_quantized(self) -> bool:
        return "qweight" in self

    @property
    def output_dims(self) -> int:
        return (self["weight"] if self.has_dense else self["qweight"]).shape[0]

    def pack_w4gemm(self) -> bool:
        """Add the fragment-order copy of the 4-bit weights ``w4gemm`` reads (another
        quarter of the fp16 bytes); False where the kernel does not cover this layer."""
        if not (USE_W4G and self.has_quantized and "biases" in self and "bias" not in self
                and self.bits == 4 and self.mode == "affine" and self["scales"].dtype == mx.float16):
            return False
        n, words = self["qweight"].shape
        if n * words * 8 < w4gemm.MIN_WEIGHTS or not w4gemm.supports(w4gemm.MAX_ROWS, n, words * 8,
                                                                      self.group_size, mx.float16):
            return False
        self.w4g_tiles = w4gemm.WARPS * w4gemm.row_tiles(n)
        self.w4g_wp, self.w4g_sbp = w4gemm.pack(self["qweight"], self["scales"], self["biases"], self.group_size,
                                                self.w4g_tiles)
        self.freeze()
        return True

    def _w4wg_applies(self, x2: mx.array) -> bool:
        # Launched by MLX, only products it runs in one pass over K (gate/up, the head):
        # down's K splits add into fp32 behind a zero fill of their own, ~13 us a layer
        # more than cuBLAS in the engine. Up to ``graph_rows`` every packed product.
        rows = x2.shape[0]
        every = W4WG_ROWS[0] <= rows <= self.graph_rows
        return (USE_W4WG and self.w4g_tiles == 16 and (every or W4WG_ROWS[0] <= rows <= W4WG_ROWS[1])
                and w4wgmma.supports(rows, self.output_dims, x2.shape[1], self.group_size)
                and (every or w4wgmma.k_splits(self.output_dims, x2.shape[1]) == 1) and w4wgmma.available())

    def _w4g_applies(self, x2: mx.array) -> bool:
        if "w4g_wp" not in self or x2.dtype != mx.float16:
            return False
        rows = x2.shape[0]
        return (W4G_ROWS[0] <= rows <= W4G_ROWS[1] or self._w4wg_applies(x2)
                or W4WG_ROWS[0] <= rows <= min(self.graph_rows, w4gemm.MAX_ROWS))

    def _w4g(self, x2: mx.array, residual: mx.array | None = None) -> mx.array:
        if self._w4wg_applies(x2):
            _note_path("cuda-w4wgmma-4bit")
            return w4wgmma.w4_wgmma(x2, self["w4g_wp"], self["w4g_sbp"], self.group_size, residual=residual)
        _note_path("cuda-w4gemm-4bit")
        return w4gemm.w4_gemm(x2, self["w4g_wp"], self["w4g_sbp"], self.group_size, residual=residual,
                              block_tiles=self.w4g_tiles)

    def _w4mma_applies(self, x2: mx.array) -> bool:
        # Against a dense copy the kernel wins only for large products up to W4MMA_MAX_ROWS;
        # without one its alternative is MLX's 4-bit GEMM, which it beats up to its limit.
        rows = x2.shape[0]
        limit = W4MMA_MAX_ROWS if self.has_dense else w4mma.MAX_ROWS
        return (W4MMA_MAX_ROWS > 0 and self.small_rows < rows <= limit and self.has_quantized
                and "bias" not in self and qmm.cuda_available()
                and w4mma.supports(rows, self["qweight"], self["scales"], self.get("biases"), x2.dtype,
                                   self.group_size, self.bits, self.mode, against_dense=self.has_dense))

    def _w4mma(self, x2: mx.array, residual: mx.array | None = None) -> mx.array:
        _note_path("cuda-w4mma-4bit")
        return w4mma.w4_matmul(x2, self["qweight"], self["scales"], self["biases"], self.group_size,
                               residual=residual)

    def _quantized(self, x2: mx.array) -> mx.array:
        rows = x2.shape[0]
        w, s, b = self["qweight"], self["scales"], self.get("biases")
        if (rows <= self.small_rows and b is not None and qmm.cuda_available()
                and qmm.kernel_supports(rows, w, s, x2.dtype, self.group_size, self.bits, self.mode)):
            _note_path(f"cuda-multirow-{self.bits}bit")
            return qmm.quantized_matmul_cuda(x2, w, s, b, self.group_size, self.bits)
        _note_path(f"mlx-quantized-{self.bits}bit")
        outs = []
        for i in range(0, rows, QUANTIZED_MAX_ROWS):
            outs.append(mx.quantized_matmul(x2[i:i + QUANTIZED_MAX_ROWS], w, s, b, transpose=True,
                                            group_size=self.group_size, bits=self.bits,
                                            mode=self.mode))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def fused(self, x2: mx.array, *, norm_weight: mx.array | None = None, eps: float = 1e-5,
              residual: mx.array | None = None, swiglu: bool = False) -> mx.array:
        """Rows (M, K) -> [swiglu] -> [rms_norm] -> this layer -> [+ residual].

        One kernel launch when the multirow path applies (decode): per-op overhead, not
        bandwidth, bounds single-stream decode under MLX on CUDA (~10-20 us per op). The
        separate ops otherwise. With ``swiglu`` x2 is (M, 2K) = [gate, up].
        """
        rows = x2.shape[0]
        if self._qgemv_applies(x2, pair=False) and not swiglu:
            _note_path("cuda-qgemv-4bit")
            return self._qgemv(x2, norm_weight, eps, residual=residual)
        multirow = (self.has_quantized and rows <= self.small_rows and "bias" not in self
                    and "biases" in self and qmm.cuda_available()
                    and qmm.kernel_supports(rows, self["qweight"], self["scales"], x2.dtype,
                                            self.group_size, self.bits, self.mode))
        if multirow and rows > FUSE_MAX_ROWS:
            # The residual costs the kernel nothing; the norm and swiglu do (see
            # FUSE_MAX_ROWS): run those as their own ops first.
            if swiglu:
                x2, swiglu = swiglu_cuda.swiglu(x2), False
            if norm_weight is not None:
                x2, norm_weight = rms_norm_cuda.rms_norm(x2, norm_weight, eps), None
        if multirow:
            fused = swiglu or norm_weight is not None or residual is not None
            _note_path(f"cuda-multirow-{self.bits}bit" + ("-fused" if fused else ""))
            return qmm.quantized_matmul_cuda(x2, self["qweight"], self["scales"], self["biases"],
                                             self.group_size, self.bits, norm_weight=norm_weight,
                                             eps=eps, residual=residual, swiglu=swiglu)
        if swiglu:
            x2 = swiglu_cuda.swiglu(x2)
        if norm_weight is not None:
            x2 = rms_norm_cuda.rms_norm(x2, norm_weight, eps)
        if self._w4g_applies(x2):
            return self._w4g(x2, residual)
        if self._w4mma_applies(x2):
            return self._w4mma(x2, residual)
        if (residual is not None and "bias" not in self and self.has_dense
                and not (self.has_quantized and rows <= self.small_rows)):
            # One GEMM with the residual as its C operand: one op less per call (MLX's
            # per-op cost, ~30 us on the H200, bounds the decode step at every batch).
            w = self["weight"]
            _note_path(f"dense-{str(w.dtype).split('.')[-1]}")
            return mx.addmm(residual, x2, w.T)
        y = self(x2)
        return y if residual is None else residual + y

    def _qgemv(self, x2: mx.array, norm_weight, eps: float, *, residual=None, pair: bool = False) -> mx.array:
        if norm_weight is not None and not qg.stream_fuses_norm(
                x2.shape[-1], pair, self["qweight"].shape[0]):
            x2, norm_weight = rms_norm_cuda.rms_norm(x2, norm_weight, eps), None
        return qg.qgemv(x2, self["qweight"], self["scales"], self["biases"], self.group_size,
                        norm_weight=norm_weight, eps=eps, residual=residual, pair=pair)

    def _qgemv_applies(self, x2: mx.array, pair: bool) -> bool:
        return (x2.shape[0] == 1 and self.has_quantized and "bias" not in self
                and "biases" in self and qmm.cuda_available()
                and qg.supports(x2, self["qweight"], self["scales"], self.bits, self.group_size,
                                self.mode, pair=pair))

    def fused_swiglu(self, x2: mx.array, *, norm_weight: mx.array | None = None,
                     eps: float = 1e-5) -> mx.array:
        """For a fused [gate; up] layer: rows (M, K) -> [rms_norm] -> this layer ->
        ``swiglu(gate, up)`` (M, N/2). One launch at one row (``qgemv``'s pair mode), so the
        down product that follows reads a plain input."""
        if self._qgemv_applies(x2, pair=True):
            _note_path("cuda-qgemv-4bit-swiglu")
            return self._qgemv(x2, norm_weight, eps, pair=True)
        return swiglu_cuda.swiglu(self.fused(x2, norm_weight=norm_weight, eps=eps))

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        rows = math.prod(lead)
        x2 = x.reshape(rows, x.shape[-1])
        if self._w4g_applies(x2):
            y = self._w4g(x2)
        elif self._w4mma_applies(x2):
            y = self._w4mma(x2)
        elif self.has_quantized and (not self.has_dense or rows <= self.small_rows):
            y = self._quantized(x2)
        else:
            w = self["weight"]
            _note_path(f"dense-{str(w.dtype).split('.')[-1]}")
            y = x2 @ w.T
        if "bias" in self:
            y = y + self["bias"]
        return y.reshape(*lead, y.shape[-1])


def capture_rows(model: nn.Module, rows: int) -> int:
    """Make every packed layer of ``model`` multiply products of 17 to ``rows`` rows with
    tandem's kernels: on ``wgmma`` (K splits included) where ``w4wgmma`` covers the layer,
    else ``w4gemm`` (0: back to the measured choice, ``W4WG_ROWS``). A decode step of those
    rows is then tandem's kernels only, which the graph step can capture; cuBLAS's dense
    product, which otherwise takes QKV, o and down from 17 rows, is launched by MLX where
    no recorder sees it. Returns the layers set."""
    layers = [m for m in model.modules() if isinstance(m, FlatLinear) and "w4g_wp" in m]
    for m in layers:
        m.graph_rows = rows
    return len(layers)


def _from_module(m: nn.Module, fmt: str, dense_dtype, small_rows: int) -> FlatLinear:
    bias = m.get("bias")
    if isinstance(m, nn.QuantizedLinear):
        q = dict(qweight=m["weight"], scales=m["scales"], biases=m.get("biases"),
                 group_size=m.group_size, bits=m.bits, mode=getattr(m, "mode", "affine"))
        if fmt == "quantized":
            return FlatLinear(bias=bias, small_rows=small_rows, **q)
        dense = mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size,
                              bits=m.bits, mode=getattr(m, "mode", "affine")).astype(dense_dtype)
        if fmt == "dense":
            return FlatLinear(weight=dense, bias=bias, group_size=m.group_size, bits=m.bits)
        return FlatLinear(weight=dense, bias=bias, small_rows=small_rows, **q)
    return FlatLinear(weight=m["weight"], bias=bias)


def flatten_linears(model: nn.Module, fmt: str = "keep", dense_dtype=mx.float16,
                    small_rows: int = qmm.PREFERRED_MAX_ROWS) -> int:
    """Replace every Linear / QuantizedLinear of ``model`` by a :class:`FlatLinear`, in place.

    fmt: ``keep`` (each layer keeps its own weights), or one of :data:`FORMATS` for
    quantized layers (dense layers stay dense). Returns the number of layers replaced.
    """
    if fmt != "keep" and fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r}: choose keep or one of {', '.join(FORMATS)}")
    fmt_q = "quantized" if fmt == "keep" else fmt
    replaced = []
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            replaced.append((path, _from_module(m, fmt_q, dense_dtype, small_rows)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        # Materialize dequantized copies here: lazy arrays built on this thread's stream
        # cannot be evaluated by the engine thread.
        mx.eval(model.parameters())
    return len(replaced)


def fuse_linears(layers: list[FlatLinear]) -> FlatLinear:
    """One FlatLinear computing ``concat([l(x) for l in layers], -1)`` with one product.

    Used for q/k/v and gate/up: fewer launches and one pass over x. All layers must hold
    the same formats and quantization parameters.
    """
    first = layers[0]
    kw = dict(group_size=first.group_size, bits=first.bits, mode=first.mode,
              small_rows=first.small_rows)
    for l in layers:
        if (l.has_dense, l.has_quantized, l.group_size, l.bits) != (
                first.has_dense, first.has_quantized, first.group_size, first.bits):
            raise ValueError("fuse_linears: layers differ in weight format")
    cat = lambda key: mx.concatenate([l[key] for l in layers], axis=0)  # noqa: E731
    biases_present = [("bias" in l) for l in layers]
    if any(biases_present) and not all(biases_present):
        raise ValueError("fuse_linears: some layers have a bias and some do not")
    return FlatLinear(
        weight=cat("weight") if first.has_dense else None,
        qweight=cat("qweight") if first.has_quantized else None,
        scales=cat("scales") if first.has_quantized else None,
        biases=cat("biases") if first.has_quantized and "biases" in first else None,
        bias=cat("bias") if all(biases_present) else None,
        **kw,
    )


def choose_weight_format(quantized: bool, dense_bytes: int, quantized_bytes: int,
                         memory_bytes: int | None, backend: str | None = None,
                         headroom: float = 0.6, packed_bytes: int = 0) -> tuple[str, str]:
    """Pick the weight format for this backend; returns (format, reason for the log line).

    Measured on an H200 (mlx 0.32.4): fp16 GEMM beats MLX's 4-bit GEMM 15-25x at prefill
    sizes, while for 1-16 rows the multirow 4-bit kernel reads 4x fewer bytes than fp16.
    So on CUDA: ``dual`` when both copies fit in ``headroom`` of device memory, else
    ``quantized`` (memory demands it). CPU: ``dense`` (the CPU quantized kernel is slow).
    Metal: ``quantized`` (its quantized kernels are fast). ``packed_bytes``: what ``dual``
    adds on CUDA for ``w4gemm`` (the fragment-order copy of the large layers).
    """
    backend = backend or _backend()
    if not quantized:
        return "dense", "checkpoint is not quantized"
    budget = None if memory_bytes is None else headroom * memory_bytes
    if backend == "cuda":
        if budget is None or dense_bytes + quantized_bytes + packed_bytes <= budget:
            packed = f" + packed {packed_bytes / 2**30:.1f} GiB" if packed_bytes else ""
            return "dual", (f"cuda: dense {dense_bytes / 2**30:.1f} GiB + quantized "
                            f"{quantized_bytes / 2**30:.1f} GiB{packed} fit; multirow kernel for "
                            f"<= {qmm.PREFERRED_MAX_ROWS} rows, dense GEMM above")
        return "quantized", (f"cuda: dense copy ({dense_bytes / 2**30:.1f} GiB) does not fit "
                             f"in {budget / 2**30:.1f} GiB; quantized only")
    if backend == "cpu":
        return "dense", "cpu: dense BLAS matmul is far faster than the CPU quantized kernel"
    return "quantized", f"{backend}: quantized kernels are fast here"


def _backend() -> str:
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "cuda" if qmm.cuda_available() else "metal"


def prepare_model(model: nn.Module, fmt: str = "auto", memory_bytes: int | None = None) -> str:
    """Flatten every linear and apply the weight format; logs and returns what runs."""
    qbytes = dbytes = pbytes = 0
    quantized = False
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(m, nn.QuantizedLinear):
            quantized = True
            nbytes = sum(v.nbytes for _, v in tree_flatten(m.parameters()))
            qbytes += nbytes
            n, k = m["weight"].shape[0], m["weight"].shape[1] * 32 // m.bits
            if USE_W4G and m.bits == 4 and n * k >= w4gemm.MIN_WEIGHTS:
                pbytes += nbytes  # fused q/k/v stay below MIN_WEIGHTS; gate/up, down, head pack
            dbytes += m["scales"].shape[0] * m["weight"].shape[1] * 32 // m.bits * 2
        elif isinstance(m, nn.Linear):
            dbytes += m["weight"].nbytes
    if fmt == "auto":
        fmt, why = choose_weight_format(quantized, dbytes, qbytes, memory_bytes,
                                        packed_bytes=pbytes if _backend() == "cuda" else 0)
    else:
        why = "requested"
    n = flatten_linears(model, fmt if quantized else "keep",
                        dense_dtype=mx.float16 if _backend() != "cpu" else mx.float32)
    log.info("linear weights: %s (%s); %d layers flattened", fmt, why, n)
    return fmt
