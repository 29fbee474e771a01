"""Picks the paged runner for the backend MLX runs on, and holds the CUDA one.

The portable :class:`~tandem.pipeline.runners.portable.paged.PagedRunner` gathers each row's blocks
and lets mlx-lm's attention run SDPA over them. On a CUDA device :class:`KernelRunner`
reads the blocks in place instead (docs/gpu.md):

* every linear layer is flattened (``kernels.linear.prepare_model``: rows ``(B*L, K)``,
  weight format chosen per backend and logged);
* each decoder layer is replaced by a :class:`FusedBlock` holding one fused QKV and one
  fused gate/up product. A decode step (all rows ``L == 1``) bypasses mlx-lm's model
  code: per layer ``rms_norm x QKV`` -> ``write_kv_rope`` (RoPE + in-place KV write into
  the store's pools) -> split-K ``paged_decode_attention`` over the batch's block table
  -> ``o + residual`` -> ``rms_norm x gate/up`` -> ``swiglu x down + residual``, with
  the norm / swiglu / residual folded into the multirow kernel at one row (seven
  launches per layer; below 16 rows write, attention and merge are one launch,
  ``decode_attention``). Prompts that start at position 0 prefill through the same write
  kernel and causal SDPA over the chunk's own keys, replaying compiled layers (the length
  padded to a multiple of 64); other prefill chunks and mixed batches run the portable
  path through the same fused weights;
* a 4/8-bit embedding table is read by one kernel (``kernels.embed_cuda``) instead of
  mlx's three gathers and a dequantize.

Measured on an H200 (docs/benchmarks/gpu_decode.md): 1.4-1.9x the portable runner's
decode at batch 1-128, 8-9x stock mlx-lm's BatchGenerator at batch 64-128.

On the CPU (or with ``TANDEM_PAGED_KERNELS=off``) :func:`kernel_runner` returns None and
``runners.make_runner`` picks another runner: nothing of the CPU path changes. ``TANDEM_PAGED_KERNELS=reference``
runs ``KernelRunner`` with the kernels' pure-mx references, which is how the wiring is
tested on machines without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from tandem import knobs
from tandem.kernels.cuda import decode_attention_cuda as dac
from tandem.kernels.cuda import embed_cuda
from tandem.kernels.cuda import linear
from tandem.kernels import paged_attention as pa
from tandem.kernels.cuda import paged_attention_cuda as pac
from tandem.kernels.cuda import kv_write_cuda as kvw
from tandem.kernels.cuda.quantized_matmul import cuda_available
from tandem.pipeline import budget
from tandem.pipeline.runners.cuda import graph_step
from tandem.pipeline.runners.cuda import input_box
from tandem.pipeline.runners.cuda import token_mailbox
from tandem.pipeline.runners.cuda.tables import decode_rows, row_classes, table_width
from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.runners.portable.paged import PagedRunner
from tandem.pipeline.sequence import Row

log = logging.getLogger("tandem.engine")

MODES = ("auto", "off", "cuda", "reference")
# Model modules whose decoder layers have the plain pre-norm llama shape the fused block
# reproduces (no q/k norms, no logit scaling, SwiGLU MLP).
# (mlx-lm loads mistral checkpoints with its llama module.)
_SUPPORTED = {"mlx_lm.models.llama", "mlx_lm.models.qwen2"}

PREFILL_EVAL_EVERY = 1
"""A fresh prefill hands the GPU its graph every this many layers (0: once, at the end).
Every layer, so the GPU starts one layer in: with MLX's graph byte limit lifted
(``tandem._mlx_cuda``) each hand-over is one graph launch. Building the whole graph
first left the GPU idle for about a quarter of a 512-token prompt."""
# A fresh prefill's ids, positions, slots and row ends reach the GPU through a ring of
# pinned boxes allocated once, which the step's first kernel copies to the device
# (``input_box.py``): no page fault and no driver call. Host-made arrays are managed
# memory that the GPU faults in at its first read (0.16-0.31 ms of a 12 ms prefill for the
# ids); packing them into one array, or mapping it from host memory, took the fault away
# but reached the first hand-over later and lost to the box. Where there is no CUDA box
# (the CPU, the reference ops) they are arrays of their own.
PREFILL_FIRST_SPLIT = True
"""A fresh prefill hands the GPU layer 0 in two graphs (attention, then the MLP), so the
device starts on fewer encoded ops (~2% prefill tok/s). A constant, so tests can compare."""
PREFILL_LAST_ROWS = True
"""A fresh prefill's last layer runs its o product and MLP on each row's last position
only: the logits need nothing else, and the layer's K/V (all positions) are written
before (~0.27 ms of the device's ~11.5 at 512 tokens). A constant, so tests can compare."""
CHECKPOINT_LAYERS = 3
"""A fresh prefill's ``checkpoint`` is this many layers before its end (~0.6 ms of device
work at 512 tokens, with the last layer at its last rows): what the engine waits for MLX's
way before spinning on the token mailbox, so MLX's wake-up overlaps the last layers (the
host read the token 0.10-0.15 ms after the device wrote it)."""
PREFILL_COMPILE_MULTIPLE = 64
VERIFY_MAX_ROWS = 256
"""A step that verifies drafts runs the decode kernels with each drafted position as a row
of its own (``KernelRunner._verify``) up to this many rows; past it, the portable path."""
GRAPH_PREPARE_TOKENS = 4096
DECODE_COMPILE = True
"""``mx.compile`` the decode step (traced per batch x table width): with pipelining it
saves the engine thread's graph building and no measured cell was slower. The prefill's
layers are compiled with it (fresh prompts, padded to a multiple of 64)."""
"""Contexts up to this many tokens have their one-row graph captured when the runner starts
(and the graphs of every row class when the worker warms up)."""


def kernel_runner(model, store: KVStore, *, kernels: str | None = None, graphs: bool = True,
                  memory_bytes: int | None = None) -> "KernelRunner | None":
    """The CUDA runner for ``model``, or None where it does not run (then the portable
    runner does; on CUDA its linear layers are flattened first, which still matters there).
    ``kernels``: see :data:`MODES` (default: the ``TANDEM_PAGED_KERNELS`` environment
    variable, else ``auto`` = CUDA kernels on CUDA). ``graphs``: capture greedy decode
    steps as CUDA graphs (``pipeline/runners/cuda/graph_step.py``). ``memory_bytes``: this
    process's share of device memory, which the weight format must fit (default: the device's)."""
    mode = (kernels or knobs.PAGED_KERNELS).strip().lower()
    if mode not in MODES:
        raise ValueError(f"TANDEM_PAGED_KERNELS={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "cuda" if cuda_available() else "off"
    if mode == "off":
        return None
    why = unsupported(model, store)
    if why:
        log.warning("paged kernels off for this model (%s): portable paged runner", why)
        if mode == "cuda":
            _prepare_linears(model, memory_bytes)
        return None
    return KernelRunner(model, store, ops=mode, graphs=graphs, memory_bytes=memory_bytes)


def unsupported(model, store: KVStore) -> str:
    """Why the fused decode path cannot serve ``model`` ("" when it can)."""
    if type(model).__module__ not in _SUPPORTED:
        return f"model module {type(model).__module__} is not llama-shaped"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not hasattr(inner, "embed_tokens") or not isinstance(getattr(inner, "norm", None), nn.RMSNorm):
        return "no model.layers / embed_tokens / RMSNorm norm"
    # A model another engine already converted holds FusedBlocks, which keep the rope.
    attn = layers[0] if isinstance(layers[0], FusedBlock) else layers[0].self_attn
    if any(getattr(l, "use_sliding", False) for l in layers):
        return "sliding-window layers"
    if store.head_dim != store.v_head_dim or store.head_dim % 8 or store.head_dim > 256:
        return f"head dims {store.head_dim}/{store.v_head_dim}"
    try:
        kvw.rope_inv_freq(attn.rope, store.head_dim)
    except (ValueError, AttributeError) as exc:
        return str(exc)
    if store.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"KV dtype {store.dtype}"
    return ""


def _prepare_linears(model, memory_bytes: int | None = None) -> None:
    if any(isinstance(m, linear.FlatLinear) for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)):
        return  # already prepared by the caller (a bench, or a second engine on one model)
    if memory_bytes is None:
        memory_bytes = budget.device_memory()  # None where MLX does not say: no memory bound
    linear.prepare_model(model, "auto", memory_bytes=memory_bytes)


def _pack_w4gemm(module) -> None:
    """Fragment-order copies of a layer's (or the head's) 4-bit weights for ``w4gemm``,
    where it applies: on the CUDA backend, for layers holding both formats (a
    quantized-only model keeps its memory bound). The caller evaluates them, one layer at
    a time."""
    if not cuda_available():
        return
    mods = [module] if isinstance(module, linear.FlatLinear) else [
        m for _, m in tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module)]
    for m in mods:
        if isinstance(m, linear.FlatLinear) and m.has_dense:
            m.pack_w4gemm()






def _known_ids(rows: list[Row], L: int) -> np.ndarray | None:
    """The chunk's input ids (B, L), zero-padded, from the sequences' tokens; None where a
    row's last input is a sample still in flight (the engine's array has it on the device)."""
    ids = np.zeros((len(rows), L), np.int32)
    for i, r in enumerate(rows):
        known = r.seq.tokens[r.start : r.start + r.n]
        if len(known) < r.n:
            return None
        ids[i, : r.n] = known
    return ids


class _Step:
    """Per decode step, read by every layer: positions, slots, block table, lengths.

    ``max_len`` and ``partition`` follow from the table's shape alone (``nb * block_size``
    bounds every row's length), so a compiled step traced for one table shape stays right
    for every step of that shape."""

    def __init__(self, pos, slots, table, lens, block_size: int, n_kv_heads: int, separate: bool = False):
        self.pos, self.slots, self.table, self.lens = pos, slots, table, lens
        # Rows of one sequence (a verified draft): every row's K/V written before any row
        # attends, in two launches (one launch writes and attends row by row, in any order).
        self.separate = separate
        if table is not None:  # decode (a prefill step only writes)
            self.max_len = table.shape[1] * block_size
            self.partition = pac.choose_partition(table.shape[0], n_kv_heads, self.max_len)


class _CudaOps:
    """The kernels: RoPE + in-place KV write, split-K paged decode attention.

    ``write`` returns the rotated q and k and the pools it was given (modified in place);
    ``attend`` returns (B, H * D): the o-projection's input, with no reshape op between;
    ``write_attend`` is both for a decode step: one launch below ``dac.MAX_ROWS`` rows."""

    def __init__(self, n_kv_heads: int):
        self.counters = dac.counters(max(dac.MAX_ROWS, 1), n_kv_heads)

    def write_attend(self, y, step: _Step, kp, vp, inv_freq, H: int, KVH: int, trad: bool,
                     scale: float, block_size: int):
        # Rows of one sequence (``step.separate``) take the two launches at the end: write, then attend.
        if not step.separate and y.shape[0] < dac.MAX_ROWS and dac.supported(y, H, KVH, kp.shape[-1]):
            a = dac.decode_attention(y, step.pos, step.slots, inv_freq, kp, vp, step.table, H, KVH, scale,
                                     block_size, step.max_len, self.counters, step.partition,
                                     traditional=trad)
            return a, kp, vp
        if not step.separate and y.shape[0] >= pac.TILE_MIN_BATCH and dac.tile_supported(y, kp.shape[-1]):
            a = dac.decode_attention_tile(y, step.pos, step.slots, inv_freq, kp, vp, step.table, step.lens, H,
                                          KVH, scale, block_size, step.max_len, step.partition,
                                          traditional=trad)
            return a, kp, vp
        q, _, kp, vp = self.write(y, step, kp, vp, inv_freq, H, KVH, trad)
        return self.attend(q, step, kp, vp, scale, block_size), kp, vp

    def write(self, y, step: _Step, kp, vp, inv_freq, H: int, KVH: int, trad: bool):
        q, k = kvw.write_kv_rope(y, step.pos, step.slots, inv_freq, kp, vp, H, KVH, traditional=trad)
        return q, k, kp, vp

    def attend(self, q, step: _Step, kp, vp, scale: float, block_size: int):
        return pac.paged_decode_attention(q, kp, vp, step.table, step.lens, scale, block_size,
                                          step.max_len, step.partition, flat=True)


class _ReferenceOps:
    """The same contract through the pure-mx references (tests on machines without CUDA);
    ``write`` returns new pools instead of modifying its inputs."""

    def write(self, y, step: _Step, kp, vp, inv_freq, H: int, KVH: int, trad: bool):
        return kvw.write_kv_rope_reference(y, step.pos, step.slots, inv_freq, kp, vp, H, KVH,
                                           traditional=trad)

    def attend(self, q, step: _Step, kp, vp, scale: float, block_size: int):
        out = pa.paged_attention(q[:, :, None], kp, vp, step.table, step.lens - 1, block_size, scale)
        return out[:, :, 0].reshape(q.shape[0], -1)

    def write_attend(self, y, step: _Step, kp, vp, inv_freq, H: int, KVH: int, trad: bool,
                     scale: float, block_size: int):
        q, _, kp, vp = self.write(y, step, kp, vp, inv_freq, H, KVH, trad)
        return self.attend(q, step, kp, vp, scale, block_size), kp, vp


class FusedBlock(nn.Module):
    """A llama-shaped decoder layer with fused QKV and gate/up weights (FlatLinear)."""

    use_sliding = False  # read by mlx-lm's llama model loop

    def __init__(self, block, head_dim: int):
        super().__init__()
        attn, mlp = block.self_attn, block.mlp
        self.qkv = linear.fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = linear.fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.ln1 = block.input_layernorm.weight
        self.ln2 = block.post_attention_layernorm.weight
        self.eps1 = block.input_layernorm.eps
        self.eps2 = block.post_attention_layernorm.eps
        self.rope = attn.rope
        self.H, self.KVH, self.D = attn.n_heads, attn.n_kv_heads, head_dim
        self.scale = float(attn.scale)
        self.ffn = mlp.gate_proj.output_dims
        self.traditional = bool(getattr(attn.rope, "traditional", False))
        self.inv_freq = kvw.rope_inv_freq(attn.rope, head_dim)
        self.freeze()

    def __call__(self, x, mask=None, cache=None):
        """The portable path (prefill chunks, mixed batches): what mlx-lm's block computes."""
        from mlx_lm.models.base import scaled_dot_product_attention

        B, L, W = x.shape
        H, KVH, D = self.H, self.KVH, self.D
        y = self.qkv.fused(x.reshape(B * L, W), norm_weight=self.ln1, eps=self.eps1).reshape(B, L, -1)
        q = y[..., : H * D].reshape(B, L, H, D).transpose(0, 2, 1, 3)
        k = y[..., H * D : (H + KVH) * D].reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
        v = y[..., (H + KVH) * D :].reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
        # Without a cache (a one-off call, e.g. another engine probing the model's vocabulary):
        # positions from 0, the chunk's own keys, as mlx-lm's block does.
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        h = self.o_proj.fused(o.transpose(0, 2, 1, 3).reshape(B * L, H * D), residual=x.reshape(B * L, W))
        g = self.gate_up.fused(h, norm_weight=self.ln2, eps=self.eps2)
        return self.down_proj.fused(g, swiglu=True, residual=h).reshape(B, L, W)

    def decode(self, h, ops, step: _Step, kp, vp, block_size: int):
        """h: (B, W) one token per row -> (h, kp, vp); this token's K/V go into the pools."""
        y = self.qkv.fused(h, norm_weight=self.ln1, eps=self.eps1)
        a, kp, vp = self.attend(y, ops, step, kp, vp, block_size)
        return self.tail(a, h), kp, vp

    def attend(self, y, ops, step: _Step, kp, vp, block_size: int):
        """The QKV rows y -> (attention output (B, H * D), kp, vp)."""
        return ops.write_attend(y, step, kp, vp, self.inv_freq, self.H, self.KVH, self.traditional,
                                self.scale, block_size)

    def tail(self, a, h):
        """The layer after its attention: the residual stream h after o and the MLP."""
        h = self.o_proj.fused(a, residual=h)
        g = self.gate_up.fused_swiglu(h, norm_weight=self.ln2, eps=self.eps2)
        return self.down_proj.fused(g, residual=h)


class KernelRunner(PagedRunner):
    """PagedRunner whose decode steps run the CUDA kernels over the store's pools.

    ``ops``: ``cuda`` (the kernels) or ``reference`` (their pure-mx references). The decode
    mirror is off: the attention kernel reads the pools in place, which is what the
    mirror stood in for on the CPU.
    """

    def __init__(self, model, store: KVStore, ops: str = "cuda", compile_decode: bool | None = None,
                 graphs: bool = True, memory_bytes: int | None = None):
        if ops == "cuda":
            _prepare_linears(model, memory_bytes)
        else:
            # The reference ops need FlatLinear (fuse_linears) but keep each layer's weights.
            if not any(isinstance(m, linear.FlatLinear) for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)):
                linear.flatten_linears(model, "keep")
        super().__init__(model, store, mirror=False)
        self.ops = _CudaOps(store.n_kv_heads) if ops == "cuda" else _ReferenceOps()
        # Let the engine queue decode step N+1 before reading N back (1.23x at batch 64).
        self.pipelined = ops == "cuda"
        inner = model.model
        # In place, one layer at a time: the fused copies of QKV and gate/up exist next to
        # the originals only for the layer being converted.
        for i, b in enumerate(inner.layers):
            if isinstance(b, FusedBlock):
                continue  # a second engine on one model: converted (and packed) by the first
            inner.layers[i] = FusedBlock(b, store.head_dim)
            if ops == "cuda":
                _pack_w4gemm(inner.layers[i])
            mx.eval(inner.layers[i].parameters())
        self.blocks = inner.layers
        self.embed = inner.embed_tokens
        # A 4/8-bit table embeds through one kernel instead of mlx's three gathers and a
        # dequantize (kernels/cuda/embed_cuda.py); anything else through the module.
        self._embed = (functools.partial(embed_cuda.embed, self.embed) if ops == "cuda"
                       else self.embed)
        self.final_norm = inner.norm
        head = getattr(model, "lm_head", None)
        self.head = head if isinstance(head, linear.FlatLinear) else None
        if self.head is not None and ops == "cuda" and getattr(self.head, "w4g_wp", None) is None:
            _pack_w4gemm(self.head)
            mx.eval(self.head.parameters())
        if compile_decode is None:
            compile_decode = DECODE_COMPILE
        # Compiled: the step's graph is traced once per (batch, table width) and replayed
        # without Python (~2 ms of graph building per step otherwise). Only with the CUDA
        # ops: the reference ops return new pools, which a compiled step cannot hand back.
        self.compiled = bool(compile_decode) and ops == "cuda"
        self._step_fn = mx.compile(self._decode_graph) if self.compiled else self._decode_graph
        verify = functools.partial(self._decode_graph, separate=True)
        self._verify_fn = mx.compile(verify) if self.compiled else verify
        # The last decode step's state (host copy, device array) and the increments that
        # advance it (see _step_state).
        self._state_prev: tuple[np.ndarray, mx.array] | None = None
        self._state_inc: dict[tuple[int, int], tuple[np.ndarray, mx.array]] = {}
        self.state_uploads = 0
        self.verify_steps = 0  # steps that verified drafts through the decode kernels
        # Prompts that start at position 0 skip the block gather.
        self.fresh_prefill = True
        self._slot_offsets: dict[tuple[int, int], np.ndarray] = {}  # (L, block size) -> position % block size
        # Their layers compiled, one function per layer traced once per (B, L): replaying
        # skips the Python that builds a layer's graph (the engine thread's share of a
        # 512-token prefill fell by about a fifth).
        # Traced per (prompts, length) with the length padded to a multiple of
        # PREFILL_COMPILE_MULTIPLE, so a few shapes cover every prompt. Unpadded, the served
        # prompts (at most 512 tokens, rarely a multiple of 64) took the uncompiled layers,
        # whose graph the engine thread builds per prefill.
        # The CUDA write kernel fills the pools in place, so a compiled layer returns h alone.
        self._prefill_fns = ([mx.compile(functools.partial(self._compiled_prefill_layer, b)) for b in self.blocks]
                             if self.compiled else None)
        # A fresh prefill's ids, positions, slots and row ends through pinned memory.
        self._input_box = input_box.make() if ops == "cuda" else None
        self._prefill_first = ((mx.compile(functools.partial(self._compiled_prefill_attention, self.blocks[0])),
                                mx.compile(functools.partial(self._prefill_mlp, self.blocks[0])))
                               if self._prefill_fns is not None else None)
        self._prefill_last = (mx.compile(functools.partial(self._compiled_prefill_last_layer, self.blocks[-1]))
                              if self._prefill_fns is not None else None)
        # Everything built here must be evaluated on this thread: the engine thread
        # cannot evaluate arrays left lazy on another thread's stream (docs/gpu.md).
        mx.eval(model.parameters(), [b.inv_freq for b in self.blocks])
        mx.eval([b.rope._freqs for b in self.blocks if isinstance(getattr(b.rope, "_freqs", None), mx.array)])
        fmt = sorted({("dense" if b.qkv.has_dense else "") + ("+q%d" % b.qkv.bits if b.qkv.has_quantized else "")
                      for b in self.blocks})
        log.info("paged runner: %s kernels for decode (fused QKV, RoPE + in-place KV write, split-K "
                 "paged attention%s), weights %s, %d layers", ops, ", compiled step" if self.compiled else "",
                 ",".join(fmt), len(self.blocks))
        # Captured steps of 17+ rows need every product to be a tandem kernel (linear.capture_rows).
        linear.capture_rows(model, graph_step.MAX_ROWS if ops == "cuda" and graphs else 0)
        if ops == "cuda":
            t = time.perf_counter()
            self.warm_kernels()
            log.info("paged runner: decode kernel variants compiled in %.1f s", time.perf_counter() - t)
        # A prefill's tokens are read back through pinned memory (token_mailbox.py).
        self.mailbox = token_mailbox.make()
        # One greedy row decodes through a captured CUDA graph of these kernels.
        self.graph_step = graph_step.make(self) if ops == "cuda" and graphs else None
        if self.graph_step is not None:
            log.info("paged runner: greedy decode through captured CUDA graphs (engine.decode_graphs)")
            if store.keys:
                self.graph_step.prepare(min(GRAPH_PREPARE_TOKENS, store.num_blocks * store.block_size))

    # -- captured steps and token read-back (the engine's side, pipeline/runner.py) -----
    graph_step: "graph_step.GraphStep | None" = None  # set at the end of __init__, after the warm-up
    mailbox: "token_mailbox.TokenMailbox | None" = None
    checkpoint: mx.array | None = None  # a fresh prefill's, for the mailbox (see _fresh_prefill)

    def can_capture(self, rows: list[Row]) -> bool:
        g = self.graph_step
        return g is not None and g.applies(rows, [r.seq.sampling for r in rows])

    def launch_captured(self, rows: list[Row], inputs):
        return self.graph_step.launch(rows, inputs)

    def sync(self) -> None:
        if self.graph_step is not None:
            self.graph_step.sync()

    def release_pools(self) -> None:
        if self.graph_step is not None:
            self.graph_step.release()

    def post_tokens(self, tokens: mx.array):
        # Only a step waited for alone (a fresh prefill, not queued behind another): the
        # host spins on the box from the checkpoint on instead of waiting MLX's way.
        box = self.mailbox
        if box is None or self.checkpoint is None or self.last_step_in_place or not box.applies(tokens):
            return None
        return box.post(tokens, self.checkpoint)

    def read_tokens(self, ticket) -> list[int] | None:
        return self.mailbox.read(ticket)

    def flush(self) -> None:
        # Captured steps in flight write the pools that the engine's work after a flush
        # reads or replaces (copies, imports, exports, growth).
        self.sync()
        super().flush()

    def warm_kernels(self, row_counts=(1, 2, 3, 4, 8, pac.TILE_MIN_BATCH, 2 * pac.TILE_MIN_BATCH)) -> None:
        """Run a decode step per row-count class against the scratch block, split and
        unsplit, so every kernel variant a decode step can pick is compiled now: each is
        an NVRTC compile of ~2 s, which mid-serving is a ~2 s stall of every running
        request (one such stall cut a batch-64 measurement from ~5,400 to ~950 tok/s). The
        row counts cover each product kernel's range (``linear``: one row, the multirow
        kernel, ``w4mma``, ``w4gemm`` and, from 17 rows, ``w4wgmma``) and both attention
        kernels.
        Writes land in the scratch block, which nothing reads as context."""
        bs = self.store.block_size
        # The widths forward() uses, so these traces are the ones decode steps replay.
        split_nb = table_width(-(-(2 * max(64, pac.MIN_PARTITION) + 1) // bs))  # two partitions at one row
        long_nb = table_width(pac.MAX_PARTITION // bs + 1)  # split even at TILE_MIN_BATCH rows
        for B in row_counts:
            for nb in (table_width(1), split_nb) + ((long_nb,) if B >= pac.TILE_MIN_BATCH else ()):
                self._scratch_step(B, nb)

    def _scratch_step(self, P: int, nb: int, fn=None) -> None:
        """A decode step of ``P`` rows over an ``nb``-block table of the scratch block (every
        row's full table as context), evaluated: it compiles what the step's shape needs and
        traces the compiled step (``fn``: the verifying one) for it. Writes land in the
        scratch block."""
        zeros = mx.zeros((P,), mx.int32)
        mx.eval((fn or self._step_fn)(mx.zeros((P, 1), mx.int32), zeros, zeros, mx.zeros((P, nb), mx.int32),
                                      mx.full((P,), nb * self.store.block_size, mx.int32),
                                      *self.store.keys, *self.store.values))

    def warm_decode(self, max_rows: int, max_tokens: int = GRAPH_PREPARE_TOKENS, verify_rows: int = 0) -> int:
        """Run (and so trace) the decode step of every row class up to ``max_rows``
        (``tables.decode_rows``) at every table width up to ``max_tokens`` of context, against
        the scratch block: serving then replays traces only (each new one was a ~10 ms stall
        of every running request). Longer contexts trace their widths when first met. With
        ``verify_rows`` (a worker that drafts: its batch times one plus the longest draft),
        the verifying step (:meth:`_verify`) of every row class up to that, at most
        ``VERIFY_MAX_ROWS``, as well. Then the captured steps (``graph_step``) of those row
        classes (up to ``graph_step.MAX_ROWS``) and widths. Returns the number of
        (rows, width) classes."""
        bs = self.store.block_size
        widths, nb = [], table_width(1)
        while True:
            widths.append(nb)
            if nb * bs >= max_tokens:
                break
            nb = table_width(nb + 1)
        classes = row_classes(1, max_rows)
        verify = row_classes(2, min(verify_rows, VERIFY_MAX_ROWS))
        for fn, rows in ((self._step_fn, classes), (self._verify_fn, verify)):
            for P in rows:
                for nb in widths:
                    self._scratch_step(P, nb, fn)
        if self.graph_step is not None and self.graph_step.failed is None:
            self.graph_step.prepare(min(max_tokens, self.store.num_blocks * bs), max_rows,
                                    min(verify_rows, VERIFY_MAX_ROWS))
        return (len(classes) + len(verify)) * len(widths)

    @property
    def takes_host_ids(self) -> bool:
        """A fresh prefill sends host-known ids through the input box: no managed array is made."""
        return self._input_box is not None

    def forward(self, rows: list[Row], inputs) -> mx.array:
        B, L = inputs.shape
        fresh = L != 1 and self.fresh_prefill and all(r.start == 0 for r in rows)
        if isinstance(inputs, np.ndarray) and not fresh:
            inputs = mx.array(inputs)
        self.checkpoint = None  # a fresh prefill's, for token_mailbox
        # Decode through the CUDA write kernel touches the pools in place only (the
        # reference ops return new pools, as the portable path does).
        self.last_step_in_place = L == 1 and self.pipelined
        if fresh:
            return self._fresh_prefill(rows, inputs)
        if L != 1 and all(r.n == r.logits for r in rows) and sum(r.n for r in rows) <= VERIFY_MAX_ROWS:
            self.last_step_in_place = self.pipelined
            return self._verify(rows, inputs)
        if L != 1:
            return super().forward(rows, inputs)
        P = decode_rows(B)  # padded rows: few traced shapes (tables.decode_rows)
        host, nb = self.decode_state(rows, P)
        if P != B:
            inputs = mx.concatenate([inputs.reshape(B, 1), mx.zeros((P - B, 1), inputs.dtype)])
        return self._run_step(self._step_fn, inputs, self._step_state(host, P, B), P, nb, B)

    def _run_step(self, fn, ids, packed, P: int, nb: int, B: int) -> mx.array:
        """``fn`` (the decode step or the verifying one) over ``P`` rows of ``ids`` with their
        state ``packed`` (:meth:`decode_state`'s layout) -> the logits of the first ``B`` rows."""
        out = fn(ids, packed[:P], packed[P : 2 * P], packed[3 * P :].reshape(P, nb), packed[2 * P : 3 * P],
                 *self.store.keys, *self.store.values)
        if not self.compiled:
            L = len(self.blocks)
            if isinstance(self.ops, _ReferenceOps):  # new pools, not written in place
                self.store.keys[:], self.store.values[:] = out[1 : 1 + L], out[1 + L :]
            out = out[0]
        return out if P == B else out[:B]

    def _verify(self, rows: list[Row], inputs) -> mx.array:
        """A step whose rows verify drafts (and plain decode rows beside them): each row's
        ``n`` positions go through the decode step as ``n`` one-token rows of its sequence,
        position ``start + j`` attending to the keys up to itself, so the step runs the
        decode kernels instead of the portable prefill path. Every row's K/V is written
        before any row attends (``separate``). Returns every position's logits, row by row,
        as the engine asks of a verifying step."""
        counts = [r.n for r in rows]
        B = sum(counts)
        P = decode_rows(B)
        host, nb = self.verify_state(rows, P)
        width = inputs.shape[1]
        take = np.fromiter((b * width + j for b, n in enumerate(counts) for j in range(n)), np.int32, B)
        if P != B:
            take = np.concatenate([take, np.zeros(P - B, np.int32)])  # (padding: any id)
        ids = inputs.reshape(-1)[mx.array(take)].reshape(P, 1)
        self._state_prev = None  # the next plain step uploads its own state
        self.verify_steps += 1
        return self._run_step(self._verify_fn, ids, mx.array(host), P, nb, B)

    def verify_state(self, rows: list[Row], padded: int) -> tuple[np.ndarray, int]:
        """:meth:`decode_state` of a verifying step: each row's ``n`` positions as one-token
        rows of its sequence, row by row, padded to ``padded`` rows."""
        counts = [r.n for r in rows]
        seqs = [r.seq for r, n in zip(rows, counts) for _ in range(n)]
        starts = np.fromiter((r.start + j for r, n in zip(rows, counts) for j in range(n)), np.int32, len(seqs))
        return self._state(seqs, starts, padded)

    def decode_state(self, rows: list[Row], padded: int | None = None) -> tuple[np.ndarray, int]:
        """A decode step's positions, slots, lengths and block table, concatenated as one
        int32 host array, and the table's width. ``padded``: that many rows, the ones past
        ``rows`` at position 0 with slot -1 (written nowhere) and a table of scratch blocks."""
        return self._state([r.seq for r in rows], np.fromiter((r.start for r in rows), np.int32, len(rows)), padded)

    def _state(self, seqs: list, starts: np.ndarray, padded: int | None = None) -> tuple[np.ndarray, int]:
        """:meth:`decode_state` of one-token rows at ``starts`` of ``seqs`` (a sequence may
        come more than once, at several positions)."""
        B = len(seqs)
        P = padded or B
        bs = self.store.block_size
        pos = np.zeros(P, np.int32)
        pos[:B] = starts
        lens = pos + 1
        nb = table_width(int((lens.max() + bs - 1) // bs))
        table = np.zeros((P, nb), np.int32)  # 0 = the store's scratch block (never read)
        # Filled in one assignment, not two numpy slice writes per row: this runs on the
        # engine thread every decode step, which at batch 64 the step waits for.
        chunks = [s.block_ids[:w] for s, w in zip(seqs, ((lens[:B] + bs - 1) // bs).tolist())]
        counts = np.fromiter(map(len, chunks), np.int64, B)
        table[:B][np.arange(nb)[None, :] < counts[:, None]] = np.fromiter(
            itertools.chain.from_iterable(chunks), np.int32, int(counts.sum())) + 1
        slots = np.full(P, -1, np.int32)
        slots[:B] = table[np.arange(B), pos[:B] // bs] * bs + pos[:B] % bs
        return np.concatenate([pos, slots, lens, table.reshape(-1)]), nb

    def _step_state(self, host: np.ndarray, B: int, real: int | None = None) -> mx.array:
        """A decode step's positions, slots, lengths and block table (``host``: those of
        ``forward``, concatenated) as one device array.

        A host-made array is managed memory that the GPU faults in at its first read, a
        cost per array (~65 us; hence one array). At one row that read, the first layer's
        attention, took 173 us of a 2.7 ms step (its median 11.8 us). When a step only
        moves every row one token on within its block (positions, slots and lengths + 1,
        the same table), the previous step's array plus a device-resident increment holds
        the same values, and nothing is uploaded: 15 of every 16 steps at one row (the
        attention 376 against 503 us a step). The host still computes the state, and
        the increment is taken only when it gives exactly those values."""
        prev = self._state_prev
        dev = None
        real = B if real is None else real  # rows past ``real`` are padding: they stay put
        if prev is not None and prev[0].shape == host.shape:
            key = (host.shape[0], B, real)
            if key not in self._state_inc:
                if len(self._state_inc) >= 64:  # one per (batch, table width) seen; bounded
                    self._state_inc.clear()
                bump = np.zeros(host.shape[0], np.int32)
                for k in range(3):
                    bump[k * B : k * B + real] = 1
                self._state_inc[key] = (bump, mx.array(bump))
            bump, bump_dev = self._state_inc[key]
            if np.array_equal(host, prev[0] + bump):
                dev = prev[1] + bump_dev
        if dev is None:
            dev = mx.array(host)
            self.state_uploads += 1
        self._state_prev = (host, dev)
        return dev

    def _fresh_prefill(self, rows: list[Row], inputs) -> mx.array:
        """Prompts from position 0 (no earlier context): every layer writes its K/V into
        the pools with the RoPE + write kernel and attends causally over the chunk's own
        keys, with no gather of blocks. Padded positions (past a row's ``n``) write nowhere
        and only padded queries see them. The length is padded up to a multiple of
        ``PREFILL_COMPILE_MULTIPLE`` so every fresh prefill runs the compiled layers."""
        B, L = inputs.shape
        pad = -L % PREFILL_COMPILE_MULTIPLE  # (with the reference ops too: the tests run it on the CPU)
        if pad:
            inputs = (np.pad(inputs, ((0, 0), (0, pad))) if isinstance(inputs, np.ndarray)
                      else mx.pad(inputs, [(0, 0), (0, pad)]))
            L += pad
        slots, last = self._fresh_slots(rows, L)
        inputs, pos, slots, last = self._prefill_inputs(rows, inputs, slots, last)
        compiled = self._prefill_fns is not None and L % PREFILL_COMPILE_MULTIPLE == 0
        h = self._embed(inputs)  # (B, L, W)
        keys, values = self.store.keys, self.store.values
        # The last layer at the last rows (not where it is also layer 0).
        last_rows_at = len(self.blocks) - 1 if PREFILL_LAST_ROWS and len(self.blocks) > 1 else None
        for i, blk in enumerate(self.blocks):
            if i == last_rows_at:
                if compiled:
                    h = self._prefill_last(h, pos, slots, keys[i], values[i], last)
                else:
                    h, keys[i], values[i] = self._prefill_last_layer(blk, h, pos, slots, keys[i], values[i], last)
            elif i == 0 and PREFILL_FIRST_SPLIT and PREFILL_EVAL_EVERY:
                # The GPU's first graph: the embedding and layer 0's attention half only.
                if compiled:
                    x = self._prefill_first[0](h, pos, slots, keys[0], values[0])
                else:
                    x, keys[0], values[0] = self._prefill_attention(blk, h, pos, slots, keys[0], values[0])
                mx.async_eval(x)
                h = (self._prefill_first[1](x) if compiled else self._prefill_mlp(blk, x)).reshape(h.shape)
            elif compiled:
                h = self._prefill_fns[i](h, pos, slots, keys[i], values[i])
            else:
                h, keys[i], values[i] = self._prefill_layer(blk, h, pos, slots, keys[i], values[i])
            if PREFILL_EVAL_EVERY and i % PREFILL_EVAL_EVERY == PREFILL_EVAL_EVERY - 1:
                # Start the GPU on the layers built so far (see PREFILL_EVAL_EVERY).
                mx.async_eval(h)
            if i == max(0, len(self.blocks) - CHECKPOINT_LAYERS):
                self.checkpoint = h
        if last_rows_at is None:
            h = h.reshape(B * L, -1)[last]
        norm = self.final_norm
        if self.head is not None:
            return self.head.fused(h, norm_weight=norm.weight, eps=norm.eps)
        return self.embed.as_linear(norm(h))

    def _fresh_slots(self, rows: list[Row], L: int) -> tuple[np.ndarray, np.ndarray]:
        """A fresh prefill's KV slot for each of its (B, L) positions, flattened (-1 past a
        row's ``n``: padding writes nowhere), and each row's last position in that order.

        Few numpy calls on purpose: this runs right after the engine thread wakes, on cold
        caches, where each call costs several times its warm figure (120 us cold for the
        nine-call version against 20 warm, a 512-token row on the CPU)."""
        bs = self.store.block_size
        offsets = self._slot_offsets.get((L, bs))
        if offsets is None:
            offsets = self._slot_offsets[(L, bs)] = np.arange(L, dtype=np.int32) % bs
        slots = np.full((len(rows), L), -1, np.int32)
        last = np.empty(len(rows), np.int32)
        for i, r in enumerate(rows):
            n = r.n
            # The store's block b holds slots (b + 1) * bs ...: its block 0 is scratch.
            base = np.array(r.seq.block_ids[: -(-n // bs)], np.int32)
            base += 1
            base *= bs
            row = slots[i]
            row[:n] = base.repeat(bs)[:n]
            row[:n] += offsets[:n]
            last[i] = i * L + n - 1
        return slots.reshape(-1), last

    def _prefill_inputs(self, rows: list[Row], inputs, slots: np.ndarray, last: np.ndarray):
        """A fresh prefill's ids (B, L), positions, slots and row ends as device arrays,
        through the input box where there is one. ``inputs``: the ids, an MLX array or
        (``takes_host_ids``) numpy."""
        B, L = inputs.shape
        if self._input_box is not None:
            host_ids = inputs if isinstance(inputs, np.ndarray) else _known_ids(rows, L)
            if host_ids is not None:
                got = self._input_box.post(host_ids, slots, last)
                if got is not None:
                    return got.ids, got.pos, got.slots, got.last
        pos = np.tile(np.arange(L, dtype=np.int32), B)
        if isinstance(inputs, np.ndarray):
            inputs = mx.array(inputs)
        return inputs, mx.array(pos), mx.array(slots), mx.array(last)

    def _prefill_layer(self, blk: FusedBlock, h, pos, slots, kp, vp):
        """One layer of a fresh prefill: h (B, L, W) -> (h, kp, vp); writes the chunk's K/V
        into the pools and attends causally over the chunk's own keys."""
        B, L, W = h.shape
        x, kp, vp = self._prefill_attention(blk, h, pos, slots, kp, vp)
        return self._prefill_mlp(blk, x).reshape(B, L, W), kp, vp

    def _prefill_attention(self, blk: FusedBlock, h, pos, slots, kp, vp):
        """A fresh prefill layer's first half: h (B, L, W) -> (x (B*L, W), kp, vp), x the
        residual stream after attention and the o product."""
        x, a, kp, vp = self._prefill_attend(blk, h, pos, slots, kp, vp)
        return blk.o_proj.fused(a, residual=x), kp, vp

    def _prefill_attend(self, blk: FusedBlock, h, pos, slots, kp, vp):
        """h (B, L, W) -> (h as rows (B*L, W), the o product's input (B*L, H*D), kp, vp):
        writes the chunk's K/V into the pools and attends causally over the chunk's own keys."""
        B, L, W = h.shape
        H, KVH, D = blk.H, blk.KVH, blk.D
        step = _Step(pos, slots, None, None, self.store.block_size, 0)
        x = h.reshape(B * L, W)
        y = blk.qkv.fused(x, norm_weight=blk.ln1, eps=blk.eps1)
        q, k, kp, vp = self.ops.write(y, step, kp, vp, blk.inv_freq, H, KVH, blk.traditional)
        q = q.reshape(B, L, H, D).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
        v = y[:, (H + KVH) * D :].reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=blk.scale, mask="causal")
        return x, o.transpose(0, 2, 1, 3).reshape(B * L, H * D), kp, vp

    def _prefill_last_layer(self, blk: FusedBlock, h, pos, slots, kp, vp, last):
        """The last layer of a fresh prefill: its QKV, K/V write and attention at every
        position, the rest at each row's last one: h (B, L, W) -> (h (B, W), kp, vp)."""
        x, a, kp, vp = self._prefill_attend(blk, h, pos, slots, kp, vp)
        return blk.tail(a[last], x[last]), kp, vp

    def _compiled_prefill_last_layer(self, blk: FusedBlock, h, pos, slots, kp, vp, last):
        return self._prefill_last_layer(blk, h, pos, slots, kp, vp, last)[0]

    def _prefill_mlp(self, blk: FusedBlock, x):
        """Its second half: x (B*L, W) -> x after the MLP."""
        g = blk.gate_up.fused(x, norm_weight=blk.ln2, eps=blk.eps2)
        return blk.down_proj.fused(g, swiglu=True, residual=x)

    def _compiled_prefill_layer(self, blk: FusedBlock, h, pos, slots, kp, vp):
        return self._prefill_layer(blk, h, pos, slots, kp, vp)[0]

    def _compiled_prefill_attention(self, blk: FusedBlock, h, pos, slots, kp, vp):
        return self._prefill_attention(blk, h, pos, slots, kp, vp)[0]

    def _decode_graph(self, inputs, pos, slots, table, lens, *pools, separate: bool = False):
        """One decode step over all layers: (logits, *keys, *values); pure in its inputs
        (weights are constants), so it can be compiled. ``separate``: rows may be positions
        of one sequence (see :meth:`_verify`)."""
        L = len(self.blocks)
        keys, values = list(pools[:L]), list(pools[L:])
        step = _Step(pos, slots, table, lens, self.store.block_size, self.store.n_kv_heads, separate)
        B = inputs.shape[0]
        bs = self.store.block_size
        h = self._embed(inputs).reshape(B, -1)
        for i, blk in enumerate(self.blocks):
            h, keys[i], values[i] = blk.decode(h, self.ops, step, keys[i], values[i], bs)
        norm = self.final_norm
        if self.head is not None:
            logits = self.head.fused(h, norm_weight=norm.weight, eps=norm.eps)
        else:
            logits = self.embed.as_linear(norm(h))
        if self.compiled:
            return logits  # the pools were written in place
        return (logits, *keys, *values)
