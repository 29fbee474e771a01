"""int8 / int4 quantization of paged K/V blocks for transfer, with one scale per (block, head).

Arrays are ``(num_blocks, num_kv_heads, block_size, head_dim)`` in the cache dtype
(``float16``, ``float32``, or ``bfloat16`` carried as a ``uint16`` view). Symmetric
absmax: ``s = max|x| / qmax`` over each (block, head) tile, ``q = round(x / s)`` with
``qmax`` 127 (int8) or 7 (int4, two values per byte along ``head_dim``, stored as
``q + 8`` nibbles, low nibble first).

Error bound (documented in docs/protocol.md and checked by tests): every element of
the dequantized tile satisfies ``|x - x_hat| <= s / 2`` before the final rounding to the
cache dtype, which adds at most half an ulp of ``x_hat`` (2^-11 relative for float16,
2^-8 for bfloat16, 2^-24 for float32).

``quantize``/``dequantize`` are the vectorized numpy kernels the wire uses;
``quantize_reference``/``dequantize_reference`` are the tile-by-tile pure-ops
definition they are tested against.
"""

from __future__ import annotations

import sys

import numpy as np

QMAX = {8: 127, 4: 7}
DTYPES = ("float16", "bfloat16", "float32")


_F16_REBIAS = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)
_FINITE_MAX = {"float16": 65504.0, "bfloat16": 3.3895e38, "float32": 3.4028e38}


def to_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """The cache array as float32 (bfloat16 arrives as a uint16 view). Exact for finite
    values; float16 inf/NaN come out as values above 65504 (quantize refuses them)."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        # numpy converts half floats in software (~0.5 GB/s here); shifting the bits into
        # place and rescaling the exponent with one multiply is exact and ~3x faster,
        # subnormals included (they become normal in the multiply).
        h = x.view(np.uint16).astype(np.uint32)
        sign = (h & np.uint32(0x8000)) << 16
        h &= np.uint32(0x7FFF)
        h <<= 13
        f = h.view(np.float32)
        f *= np.float32(2.0**112)
        h |= sign
        return f
    return x.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the cache dtype with round-to-nearest-even (bfloat16 as uint16).
    For float16 the values must be finite and within +-65504."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        bits = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
        return (bits >> 16).astype(np.uint16)
    if dtype == "float16":
        # Integer round-to-nearest-even on the 13 dropped mantissa bits; results below the
        # smallest normal half are rounded by a float add that aligns them.
        f = x.view(np.uint32)
        sign = (f >> 16) & np.uint32(0x8000)
        a = f & np.uint32(0x7FFFFFFF)
        n = a + _F16_REBIAS
        n += (a >> 13) & np.uint32(1)
        n >>= 13
        small = a < np.uint32(0x38800000)
        if small.any():  # a select, not fancy indexing: quantized KV has many exact zeros
            sub = (a.view(np.float32) + np.float32(0.5)).view(np.uint32) - np.uint32(0x3F000000)
            n = np.where(small, sub, n)
        n |= sign
        return n.astype(np.uint16).view(np.float16)
    return x.astype(dtype)


def _check(x: np.ndarray, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if x.ndim != 4:
        raise ValueError(f"expected (blocks, heads, block_size, head_dim), got shape {x.shape}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"int4 packs pairs along head_dim; head_dim {x.shape[-1]} is odd")


# Work on groups of blocks whose float32 temporaries stay around 1 MiB: they are reused
# from the heap and stay in cache, where whole-layer temporaries (tens of MB) cost a
# page fault per 4 KiB on every call.
_GROUP_BYTES = 1 << 20
_NIBBLE_PAIRS = (
    np.stack(((np.arange(256) & 0x0F) - 8, (np.arange(256) >> 4) - 8), axis=-1).astype(np.int8).view(np.int16).reshape(256)
)


def _groups(x: np.ndarray):
    per_block = max(1, int(np.prod(x.shape[1:])) * 4)
    step = max(1, _GROUP_BYTES // per_block)
    return [(b, min(b + step, x.shape[0])) for b in range(0, x.shape[0], step)]


def quantize(x: np.ndarray, bits: int, dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """-> (q, scales). q: int8 of x's shape (8 bits) or uint8 with head_dim/2 (4 bits);
    scales: float32 ``(num_blocks, num_kv_heads)``."""
    _check(x, bits)
    dtype = dtype or str(x.dtype)
    nb, nh, bs, hd = x.shape
    q = np.empty((nb, nh, bs, hd if bits == 8 else hd // 2), np.int8 if bits == 8 else np.uint8)
    scales = np.empty((nb, nh), np.float32)
    for b0, b1 in _groups(x):
        q[b0:b1], scales[b0:b1] = _quantize_group(x[b0:b1], bits, dtype)
    return q, scales


def _quantize_group(x: np.ndarray, bits: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    xf = to_float32(x, dtype)
    qmax = QMAX[bits]
    flat = xf.reshape(xf.shape[0], xf.shape[1], -1)
    amax = np.maximum(flat.max(axis=2), -flat.min(axis=2)) if flat.shape[2] else np.zeros(xf.shape[:2], np.float32)
    if not np.all(amax <= _FINITE_MAX[dtype]):  # also false for NaN
        raise ValueError("KV contains inf or NaN; it cannot be quantized")
    scales = amax / np.float32(qmax)
    inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > 0)
    xf *= inv[:, :, None, None]
    np.rint(xf, out=xf)  # |x * inv| <= qmax, so no clip is needed
    if bits == 8:
        return xf.astype(np.int8), scales
    # int4: q + 8 is 1..15; read each pair of bytes as one little-endian uint16 (first
    # value in the low byte) and fold the second value's nibble next to the first.
    assert sys.byteorder == "little"
    xf += np.float32(8)
    pairs = xf.astype(np.uint8).view(np.uint16)
    pairs |= pairs >> 4
    return pairs.astype(np.uint8), scales


def dequantize(q: np.ndarray, scales: np.ndarray, bits: int, dtype: str) -> np.ndarray:
    """Inverse of :func:`quantize`, returned in the cache ``dtype`` (bfloat16 as uint16)."""
    nb, nh, bs, last = q.shape
    hd = last if bits == 8 else last * 2
    with np.errstate(over="ignore"):  # a byte no quantizer emits (int8 -128, int4 -8) times the largest scale: +-inf, as in the reference
        return _dequantize(q, scales, bits, dtype, hd)


def _dequantize(q: np.ndarray, scales: np.ndarray, bits: int, dtype: str, hd: int) -> np.ndarray:
    nb, nh, bs, _ = q.shape
    if dtype == "float32":  # the float32 product is the result: write it in place
        out = np.empty((nb, nh, bs, hd), np.float32)
        for b0, b1 in _groups(out):
            qg = q[b0:b1]
            if bits == 4:  # one lookup turns each byte into its two signed values, interleaved
                qg = np.take(_NIBBLE_PAIRS, qg).view(np.int8).reshape(qg.shape[:-1] + (hd,))
            np.multiply(qg, scales[b0:b1, :, None, None], out=out[b0:b1], dtype=np.float32)
        return out
    return _dequantize_by_table(q, scales, bits, dtype).reshape(nb, nh, bs, hd)


# A tile shares one scale, so every byte value of its q decodes to one fixed output (two
# outputs for an int4 byte): build that 256-entry table per tile with the same float32
# product and rounding as the reference, then decode by a gather. Rounding to a 16-bit
# float in numpy takes several passes per element; here it runs on 256 entries per tile
# instead of every element (2-3x faster for float16 int8, ~3.5x for int4).
_BYTE_VALUE = np.arange(256).astype(np.uint8).view(np.int8).astype(np.float32)  # an int8 q per byte
_LOW_NIBBLE = ((np.arange(256) & 0x0F) - 8).astype(np.float32)  # int4: first value of a byte
_HIGH_NIBBLE = ((np.arange(256) >> 4) - 8).astype(np.float32)  # int4: second value
_GATHER_BYTES = 1 << 18  # q bytes per gather step (the intp index is 8x that)
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _decode_table(scales: np.ndarray, values: np.ndarray, dtype: str) -> np.ndarray:
    """(tiles, 256) raw bits of ``from_float32(scale * value)`` as unsigned ints."""
    out = from_float32(scales[:, None] * values[None, :], dtype)
    return out.view(_UINT[out.dtype.itemsize])


def _dequantize_by_table(q: np.ndarray, scales: np.ndarray, bits: int, dtype: str) -> np.ndarray:
    tiles = q.shape[0] * q.shape[1]
    per = q.shape[2] * q.shape[3]  # q bytes per tile
    s = np.ascontiguousarray(scales, dtype=np.float32).reshape(tiles)
    if bits == 8:
        table = _decode_table(s, _BYTE_VALUE, dtype)
    else:
        assert sys.byteorder == "little"  # a pair's first value sits in the low half
        lo, hi = _decode_table(s, _LOW_NIBBLE, dtype), _decode_table(s, _HIGH_NIBBLE, dtype)
        wide = _UINT[2 * lo.dtype.itemsize]
        table = lo.astype(wide) | (hi.astype(wide) << (8 * lo.dtype.itemsize))
    flat = table.reshape(-1)
    out = np.empty((tiles, per), table.dtype)
    qt = np.ascontiguousarray(q).reshape(tiles, per).view(np.uint8)
    offsets = (np.arange(tiles, dtype=np.intp) * 256)[:, None]
    step = max(1, _GATHER_BYTES // max(1, per))
    for t0 in range(0, tiles, step):
        t1 = min(t0 + step, tiles)
        idx = qt[t0:t1].astype(np.intp)
        idx += offsets[t0:t1]
        np.take(flat, idx, out=out[t0:t1])
    element = np.uint16 if dtype in ("float16", "bfloat16") else np.float32
    result = out.view(element)
    return result.view(np.float16) if dtype == "float16" else result


def quantize_reference(x: np.ndarray, bits: int, dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tile-by-tile definition of :func:`quantize` (slow; for tests)."""
    _check(x, bits)
    xf = to_float32(x, dtype or str(x.dtype))
    qmax = QMAX[bits]
    nb, nh, bs, hd = xf.shape
    q = np.zeros((nb, nh, bs, hd), np.int8)
    scales = np.zeros((nb, nh), np.float32)
    for b in range(nb):
        for h in range(nh):
            tile = xf[b, h]
            s = np.float32(np.abs(tile).max()) / np.float32(qmax)
            scales[b, h] = s
            if s > 0:
                q[b, h] = np.clip(np.rint(tile * (np.float32(1) / s)), -qmax, qmax)
    if bits == 4:
        packed = np.zeros((nb, nh, bs, hd // 2), np.uint8)
        for i in range(hd // 2):
            packed[..., i] = (q[..., 2 * i] + 8).astype(np.uint8) | ((q[..., 2 * i + 1] + 8).astype(np.uint8) << 4)
        q = packed
    return q, scales


def dequantize_reference(q: np.ndarray, scales: np.ndarray, bits: int, dtype: str) -> np.ndarray:
    if bits == 4:
        nb, nh, bs, half = q.shape
        vals = np.zeros((nb, nh, bs, half * 2), np.float32)
        for i in range(half):
            vals[..., 2 * i] = (q[..., i] & 0x0F).astype(np.float32) - 8
            vals[..., 2 * i + 1] = (q[..., i] >> 4).astype(np.float32) - 8
    else:
        vals = q.astype(np.float32)
    out = np.zeros(vals.shape, np.float32)
    for b in range(vals.shape[0]):
        for h in range(vals.shape[1]):
            out[b, h] = vals[b, h] * scales[b, h]
    return from_float32(out, dtype)


def error_bound(x: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    """Per-element bound on |x - dequantize(quantize(x))|: s/2 plus the dtype's rounding."""
    rel = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}[dtype]
    xf = np.abs(to_float32(x, dtype))
    return scales[:, :, None, None] / 2 * (1 + 1e-6) + (xf + scales[:, :, None, None]) * rel
