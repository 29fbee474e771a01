"""A KVSnapshot as wire messages (one KVHeader + KVChunks) and back.

A chunk carries blocks ``[block_start, block_end)`` of layers ``[layer_start,
layer_end)``; its payload frames are, per layer: K, V, and with quantization K scales,
V scales (float32 ``(blocks, heads)``); with LZ4 each frame is an ``lz4.frame``. Raw
frames are zero-copy views of the snapshot's arrays (a block range of a
``(blocks, heads, block_size, head_dim)`` array is contiguous).

:class:`KVAssembler` validates every chunk against the header's geometry before
touching memory (sizes are exact, LZ4 output is capped at the expected size, no cell
arrives twice) and rebuilds the snapshot; it completes when every (layer, block) cell
has arrived, whatever the strategy or the number of connections. Raw and LZ4
transfers reassemble bit-exactly; int8/int4 within the bound in wire/kv_quant.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import lz4.frame
import numpy as np

from tandem.wire import kv_quant
from tandem.kvtypes import KVSnapshot
from tandem.wire import protocol as P
from tandem.wire.codec import as_buffer
from tandem.wire.errors import WireError
from tandem.wire.messages import KVChunk, KVHeader

MAX_KV_BYTES = 64 << 30  # a header may not describe more (dequantized) KV than this
_NP_DTYPE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_BITS = {"int8": 8, "int4": 4}
_DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.38e38, "float32": 3.4e38}


@dataclass
class KVOptions:
    compression: str = "none"  # none | lz4
    quantization: str = "none"  # none | int8 | int4
    strategy: str = "full"  # full | streamed | layer_parallel
    blocks_per_chunk: int = 64  # streamed: a prefill chunk's worth of blocks
    connections: int = 2  # layer_parallel


def make_header(snap: KVSnapshot, options: KVOptions, *, stream_seq: int = 0, priority: int = 0, attempt: int = 0,
                final: bool = True) -> KVHeader:
    return KVHeader(
        request_id=snap.request_id, model=snap.model_id, block_size=snap.block_size,
        num_layers=snap.num_layers, num_kv_heads=snap.num_kv_heads, head_dim=snap.head_dim,
        dtype=snap.dtype, tokens=list(snap.tokens), num_computed=snap.num_computed,
        prompt_len=snap.prompt_len, sampling=snap.sampling, num_generated=snap.num_generated,
        num_cached_prompt_tokens=snap.num_cached_prompt_tokens,
        num_blocks=math.ceil(snap.num_computed / snap.block_size),
        compression=options.compression, quantization=options.quantization, strategy=options.strategy,
        stream_seq=stream_seq, priority=priority, attempt=attempt, final=final,
    )


def plan(num_layers: int, num_blocks: int, options: KVOptions) -> list[list[tuple[range, range]]]:
    """Per connection, the (layers, blocks) ranges of its chunks in sending order."""
    all_layers, all_blocks = range(num_layers), range(num_blocks)
    if num_blocks == 0:
        return [[]]  # nothing computed yet: the header alone completes the transfer
    if options.strategy == "full":
        return [[(all_layers, all_blocks)]]
    if options.strategy == "streamed":
        step = max(1, options.blocks_per_chunk)
        return [[(all_layers, range(b, min(b + step, num_blocks))) for b in range(0, num_blocks, step)]]
    if options.strategy == "layer_parallel":
        n = max(1, min(options.connections, num_layers))
        bounds = [round(i * num_layers / n) for i in range(n + 1)]
        return [[(range(bounds[i], bounds[i + 1]), all_blocks)] for i in range(n)]
    raise ValueError(f"unknown strategy {options.strategy!r}")


def encode_chunk(snap: KVSnapshot, layers: range, blocks: range, options: KVOptions, index: int, last: bool) -> KVChunk:
    """Blocks ``blocks`` of layers ``layers`` of a snapshot."""
    keys = [snap.keys[layer][blocks.start : blocks.stop] for layer in layers]
    values = [snap.values[layer][blocks.start : blocks.stop] for layer in layers]
    return encode_blocks(snap.request_id, snap.dtype, keys, values, layers.start, blocks.start, options, index, last)


def encode_blocks(
    request_id: bytes, dtype: str, keys: list[np.ndarray], values: list[np.ndarray],
    layer_start: int, block_start: int, options: KVOptions, index: int, last: bool,
) -> KVChunk:
    """A chunk from per-layer arrays ``(n_blocks, heads, block_size, head_dim)`` that hold
    blocks ``[block_start, block_start + n_blocks)`` of layers ``layer_start, ...`` (what an
    engine exporting KV progressively hands over)."""
    frames = []
    bits = _BITS.get(options.quantization)
    for k, v in zip(keys, values):
        if bits:
            (qk, sk), (qv, sv) = kv_quant.quantize(k, bits, dtype), kv_quant.quantize(v, bits, dtype)
            frames += [memoryview(a).cast("B") for a in (qk, qv, sk, sv)]
        else:
            frames += [memoryview(np.ascontiguousarray(a)).cast("B") for a in (k, v)]
    if options.compression == "lz4":
        frames = [lz4.frame.compress(f, compression_level=0, store_size=True) for f in frames]
    n_blocks = keys[0].shape[0] if keys else 0
    return KVChunk(request_id, index, layer_start, layer_start + len(keys), block_start, block_start + n_blocks, last, frames)


def snapshot_messages(
    snap: KVSnapshot, options: KVOptions, *, stream_seq: int = 0, priority: int = 0, attempt: int = 0
) -> list[list]:
    """Per connection: [KVHeader, KVChunk, ...]. Every connection repeats the header so
    each one can be validated on its own, whichever arrives first."""
    return [list(m) for m in iter_snapshot_messages(snap, options, stream_seq=stream_seq, priority=priority, attempt=attempt)]


def iter_snapshot_messages(
    snap: KVSnapshot, options: KVOptions, *, stream_seq: int = 0, priority: int = 0, attempt: int = 0
) -> list[Iterator]:
    """Like :func:`snapshot_messages`, but each connection's messages are produced lazily,
    so a chunk is quantized/compressed while the previous one is on the wire and only
    one chunk per connection exists in encoded form at a time."""
    header = make_header(snap, options, stream_seq=stream_seq, priority=priority, attempt=attempt)
    plans = plan(snap.num_layers, header.num_blocks, options)
    starts = [sum(len(p) for p in plans[:i]) for i in range(len(plans))]

    def messages(ranges, first_index):
        yield header
        for i, (layers, blocks) in enumerate(ranges):
            yield encode_chunk(snap, layers, blocks, options, first_index + i, i == len(ranges) - 1)

    return [messages(ranges, start) for ranges, start in zip(plans, starts)]


def part_messages(snap: KVSnapshot, options: KVOptions, *, first_index: int, header: KVHeader | None) -> tuple[Iterator, int]:
    """One part of a KV export streamed while its prompt is prefilled (blocks
    ``[snap.first_block, ...)``): ``header`` first when given (the one that opens the
    transfer, not final, or the final one with the sampled token), then the part's blocks
    in chunks of ``options.blocks_per_chunk``, numbered from ``first_index``; produced
    lazily. Returns the messages and how many chunks they hold."""
    n = snap.keys[0].shape[0] if snap.keys else 0
    step = max(1, options.blocks_per_chunk)
    starts = range(0, n, step)
    final = header is not None and header.final

    def messages():
        if header is not None:
            yield header
        for i, b in enumerate(starts):
            e = min(b + step, n)
            yield encode_blocks(snap.request_id, snap.dtype, [k[b:e] for k in snap.keys], [v[b:e] for v in snap.values],
                                0, snap.first_block + b, options, first_index + i, final and e == n)

    return messages(), len(starts)


class KVAssembler:
    """Rebuilds one request's snapshot from its header and chunks (any order, any connection)."""

    def __init__(self, header: KVHeader):
        h = header
        _check_header(h)
        self.header = h
        self._itemsize = np.dtype(_NP_DTYPE[h.dtype]).itemsize
        self._block_elems = h.num_kv_heads * h.block_size * h.head_dim
        if 2 * h.num_layers * h.num_blocks * self._block_elems * self._itemsize > MAX_KV_BYTES:
            raise WireError(f"KV header describes more than {MAX_KV_BYTES} bytes of KV", "size")
        self._bits = _BITS.get(h.quantization)
        self._shape = (h.num_blocks, h.num_kv_heads, h.block_size, h.head_dim)
        self._keys: list[np.ndarray | None] = [None] * h.num_layers
        self._values: list[np.ndarray | None] = [None] * h.num_layers
        self._seen = np.zeros((h.num_layers, h.num_blocks), dtype=bool)
        self._taken = 0  # leading blocks handed out by take_ready
        self.bytes_received = 0

    def same_geometry(self, other: KVHeader) -> bool:
        fields = ("model", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "num_blocks", "compression", "quantization")
        return all(getattr(self.header, f) == getattr(other, f) for f in fields)

    def update(self, header: KVHeader) -> None:
        """A repeated header (another connection's copy, or a progressive transfer's
        later one): same request and geometry; the newest token state wins."""
        if header.request_id != self.header.request_id or not self.same_geometry(header):
            raise WireError("KV header repeated with a different request or geometry")
        _check_header(header)
        if self.header.final and not header.final:
            return  # a late copy of an earlier header never undoes the final one
        self.header = header

    @property
    def complete(self) -> bool:
        return self.header.final and bool(self._seen.all())

    def add(self, chunk: KVChunk) -> None:
        h = self.header
        if chunk.request_id != h.request_id:
            raise WireError("KV chunk for another request")
        if not (0 <= chunk.layer_start < chunk.layer_end <= h.num_layers and 0 <= chunk.block_start < chunk.block_end <= h.num_blocks):
            raise WireError(f"KV chunk ranges layers [{chunk.layer_start},{chunk.layer_end}) blocks [{chunk.block_start},{chunk.block_end}) outside the header")
        cells = self._seen[chunk.layer_start : chunk.layer_end, chunk.block_start : chunk.block_end]
        if cells.any():
            raise WireError("KV chunk repeats blocks already received")
        per_layer = 4 if self._bits else 2
        n_layers = chunk.layer_end - chunk.layer_start
        if len(chunk.frames) != per_layer * n_layers:
            raise WireError(f"KV chunk has {len(chunk.frames)} frames, expected {per_layer * n_layers}")
        nb = chunk.block_end - chunk.block_start
        data_bytes = nb * self._block_elems * (self._itemsize if not self._bits else 1)
        if self._bits == 4:
            data_bytes //= 2
        scale_bytes = nb * h.num_kv_heads * 4
        for i, layer in enumerate(range(chunk.layer_start, chunk.layer_end)):
            f = chunk.frames[per_layer * i : per_layer * (i + 1)]
            k, v = self._payload(f[0], data_bytes), self._payload(f[1], data_bytes)
            if self._bits:
                ks, vs = self._payload(f[2], scale_bytes), self._payload(f[3], scale_bytes)
                k, v = self._dequantize(k, ks, nb), self._dequantize(v, vs, nb)
            else:
                k, v = self._view(k, nb), self._view(v, nb)
            self._store(self._keys, layer, chunk.block_start, k)
            self._store(self._values, layer, chunk.block_start, v)
        cells[:] = True

    def _payload(self, frame, expected: int):
        if self.header.compression == "lz4":
            out = _lz4_decompress(frame, expected)
        else:
            out = as_buffer(frame)
            if len(out) != expected:
                raise WireError(f"KV frame of {len(out)} bytes, expected {expected}", "size")
        self.bytes_received += expected
        return out

    def _view(self, buf, nb: int) -> np.ndarray:
        return np.frombuffer(buf, dtype=_NP_DTYPE[self.header.dtype]).reshape((nb,) + self._shape[1:])

    def _dequantize(self, qbuf, sbuf, nb: int) -> np.ndarray:
        h = self.header
        last = h.head_dim // 2 if self._bits == 4 else h.head_dim
        qdtype = np.uint8 if self._bits == 4 else np.int8
        q = np.frombuffer(qbuf, dtype=qdtype).reshape(nb, h.num_kv_heads, h.block_size, last)
        s = np.frombuffer(sbuf, dtype=np.float32).reshape(nb, h.num_kv_heads)
        limit = _DTYPE_MAX[h.dtype] / kv_quant.QMAX[self._bits]
        if not np.all((s >= 0) & (s <= limit)):  # also false for NaN
            raise WireError("KV scales are negative, not finite, or overflow the cache dtype")
        return kv_quant.dequantize(q, s, self._bits, h.dtype)

    def _store(self, arrays: list, layer: int, block_start: int, part: np.ndarray) -> None:
        if part.shape[0] == self._shape[0]:
            arrays[layer] = part  # the whole layer in one chunk: keep the buffer, no copy
            return
        if arrays[layer] is None:
            arrays[layer] = np.empty(self._shape, dtype=_NP_DTYPE[self.header.dtype])
        arrays[layer][block_start : block_start + part.shape[0]] = part

    def take_ready(self) -> KVSnapshot | None:
        """The blocks past those taken before whose every layer is in, up to the first one
        still missing, as a part (``first_block`` = where they start; views of this
        assembler's arrays, which never write a cell twice), or None. What a streamed
        transfer's receiver copies into its KV store while the rest is on its way."""
        done = self._seen[:, self._taken :].all(axis=0)
        n = int(done.argmin()) if not done.all() else len(done)
        if n == 0:
            return None
        first, self._taken = self._taken, self._taken + n
        return self._part(first, self._taken)

    def snapshot(self) -> KVSnapshot:
        """The whole transfer (the blocks :meth:`take_ready` handed out included)."""
        if not self.complete:
            raise WireError("KV transfer incomplete")
        return self._part(0, self.header.num_blocks)

    def _part(self, first: int, end: int) -> KVSnapshot:
        h = self.header
        empty = np.empty((0,) + self._shape[1:], dtype=_NP_DTYPE[h.dtype])

        def blocks(a):
            return empty if a is None else a if (first, end) == (0, len(a)) else a[first:end]
        return KVSnapshot(
            request_id=h.request_id, model_id=h.model, block_size=h.block_size, num_layers=h.num_layers,
            num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, dtype=h.dtype, tokens=list(h.tokens),
            num_computed=h.num_computed, prompt_len=h.prompt_len,
            keys=[blocks(k) for k in self._keys], values=[blocks(v) for v in self._values],
            sampling=h.sampling, num_generated=h.num_generated, num_cached_prompt_tokens=h.num_cached_prompt_tokens,
            first_block=first,
        )


def _check_header(h: KVHeader) -> None:
    if h.num_computed > len(h.tokens) or h.prompt_len > len(h.tokens):
        raise WireError("KV header: num_computed/prompt_len exceed the token count")
    if h.num_blocks != math.ceil(h.num_computed / h.block_size):
        raise WireError(f"KV header: {h.num_blocks} blocks do not hold {h.num_computed} tokens of block size {h.block_size}")
    if h.quantization == "int4" and h.head_dim % 2:
        raise WireError("KV header: int4 needs an even head_dim")


def _lz4_decompress(frame, expected: int) -> bytes:
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        out = d.decompress(as_buffer(frame), max_length=expected)
    except Exception as exc:  # python-lz4 raises RuntimeError and others on corrupt input
        raise WireError(f"bad LZ4 frame: {exc}") from None
    if len(out) != expected or not d.eof:
        raise WireError(f"LZ4 frame decompresses to more or less than the expected {expected} bytes", "size")
    return out
