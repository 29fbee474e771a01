"""Pick each row's next token from its logits, per-request parameters, reproducibly.

Before any pick, the logits get each row's logit bias, its penalties (from the tokens
before it, handed in by the caller as host lists) and its grammar's token mask (a
bitmask computed off the step's path, see pipeline/grammar.py): rows without them are
not touched and a batch without them runs exactly the ops it ran before.

Greedy rows take the argmax, vectorized over the batch. Sampled rows apply temperature,
top-k, top-p and min-p to the sorted distribution and draw with the Gumbel-max trick; the
noise for the ``i``-th generated token of a request comes from a key derived only from
``(seed, i)``, so a request draws the same tokens whatever else shares its batch and
wherever it continues after a KV handoff.

Everything stays lazy: the caller evaluates the result together with the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tandem.kernels.cuda import argmax_cuda
from tandem.kvtypes import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_key(seed: int, index: int) -> mx.array:
    """The PRNG key of a request's ``index``-th generated token."""
    return mx.random.key(_splitmix64(_splitmix64(seed & _MASK64) ^ index) & ((1 << 63) - 1))


@dataclass
class Sampled:
    tokens: mx.array  # (B,) int32
    logprobs: mx.array | None = None  # (B,) chosen token's logprob, when any row asked
    top_ids: mx.array | None = None  # (B, N) when any row asked for top-N
    top_logprobs: mx.array | None = None
    # A step waited for alone may have its tokens read from pinned memory (token_mailbox):
    # the ticket that reads them, and what it read.
    ticket: object | None = None
    host_tokens: list[int] | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


def penalty_terms(tokens: list[int], n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's history as (ids seen in prompt or output, their output counts): the
    unique token ids of ``tokens`` and how often each occurs in its last ``n_out``."""
    arr = np.asarray(tokens, np.int64)
    seen = np.unique(arr)
    out_ids, counts = np.unique(arr[len(arr) - n_out:], return_counts=True) if n_out > 0 else (arr[:0], arr[:0])
    out_counts = np.zeros(len(seen), np.float32)
    out_counts[np.searchsorted(seen, out_ids)] = counts
    return seen, out_counts


def apply_penalties(logits: mx.array, params: list[SamplingParams],
                    history: list[tuple[list[int], int] | None]) -> mx.array:
    """Repetition penalty (every token seen), then frequency and presence (output tokens),
    as vLLM orders them. ``history[b]``: (prompt + output tokens, how many are output)."""
    rows, cols, rep, freq, pres, counts = [], [], [], [], [], []
    V = logits.shape[1]
    for b, (p, h) in enumerate(zip(params, history)):
        if h is None or not p.penalized:
            continue
        seen, out_counts = penalty_terms(*h)
        keep = (seen >= 0) & (seen < V)
        seen, out_counts = seen[keep], out_counts[keep]
        rows.append(np.full(len(seen), b, np.int32))
        cols.append(seen.astype(np.int32))
        counts.append(out_counts)
        n = len(seen)
        rep.append(np.full(n, p.repetition_penalty, np.float32))
        freq.append(np.full(n, p.frequency_penalty, np.float32))
        pres.append(np.full(n, p.presence_penalty, np.float32))
    if not rows or not sum(len(r) for r in rows):
        return logits
    r, c = mx.array(np.concatenate(rows)), mx.array(np.concatenate(cols))
    cnt = mx.array(np.concatenate(counts))
    old = logits[r, c]
    rp = mx.array(np.concatenate(rep))
    new = mx.where(old > 0, old / rp, old * rp)
    new = new - mx.array(np.concatenate(freq)) * cnt - mx.array(np.concatenate(pres)) * (cnt > 0)
    return logits.at[r, c].add(new - old)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Tokens whose bit is clear in ``bitmask`` (B, ceil(V / 32)) int32 become -inf.

    The bits are unpacked on the host (numpy, ~40 us for 16 x 49k) and uploaded as
    bools: MLX's CPU gather of each token's word took 32 ms for the same batch."""
    V = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=V, bitorder="little").view(np.bool_)
    return mx.where(mx.array(allowed), logits, -mx.inf)


def sample(logits: mx.array, params: list[SamplingParams], indices: list[int],
           history: list[tuple[list[int], int] | None] | None = None, bitmask: np.ndarray | None = None) -> Sampled:
    """logits: (B, V); params[b] and indices[b] (the token's index within its request).
    ``history[b]``: row b's tokens so far and how many of them it generated, for rows
    with penalties; ``bitmask``: (B, ceil(V / 32)) allowed tokens, all bits set on rows
    without a grammar."""
    B, V = logits.shape
    if argmax_cuda.applies(logits) and bitmask is None and all(p.plain_greedy for p in params):
        return Sampled(argmax_cuda.argmax_kernel(logits))  # greedy rows only: one launch
    logits = logits.astype(mx.float32)
    bias_rows, bias_cols, bias_vals = [], [], []
    for b, p in enumerate(params):
        for tok, val in p.logit_bias.items():
            if 0 <= tok < V:
                bias_rows.append(b)
                bias_cols.append(tok)
                bias_vals.append(val)
    if bias_rows:
        logits = logits.at[mx.array(bias_rows), mx.array(bias_cols)].add(mx.array(bias_vals, dtype=mx.float32))
    if history is not None:
        logits = apply_penalties(logits, params, history)
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)

    hot = [b for b, p in enumerate(params) if p.temperature > 0]
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    if hot:
        drawn = _draw(logits[mx.array(hot)], [params[b] for b in hot], [indices[b] for b in hot])
        if len(hot) == B:
            tokens = drawn
        else:
            tokens = tokens.at[mx.array(hot)].add(drawn - tokens[mx.array(hot)])

    out = Sampled(tokens)
    want = [p.logprobs for p in params if p.logprobs is not None]
    if want:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if bitmask is not None:  # masked tokens: a finite floor (-inf does not cross the wire)
            lp = mx.maximum(lp, -1e30)
        out.logprobs = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        n = min(max(want), V)
        if n > 0:
            top = mx.argsort(-lp, axis=-1)[:, :n]
            out.top_ids = top
            out.top_logprobs = mx.take_along_axis(lp, top, axis=-1)
    return out


def _draw(logits: mx.array, params: list[SamplingParams], indices: list[int]) -> mx.array:
    """Temperature / top-k / top-p / min-p, then Gumbel-max with per-(seed, index) noise."""
    n, V = logits.shape
    temp = mx.array(np.array([p.temperature for p in params], np.float32))[:, None]
    scaled = logits / temp
    order = mx.argsort(-scaled, axis=-1)  # descending
    sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    rank = mx.arange(V)[None, :]
    keep = mx.ones((n, V), dtype=mx.bool_)
    top_k = np.array([p.top_k if p.top_k > 0 else V for p in params], np.int32)
    if (top_k < V).any():
        keep = keep & (rank < mx.array(top_k)[:, None])
    top_p = np.array([p.top_p for p in params], np.float32)
    if (top_p < 1.0).any():
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep = keep & (before < mx.array(top_p)[:, None])
    min_p = np.array([p.min_p for p in params], np.float32)
    if (min_p > 0).any():
        keep = keep & (probs >= mx.array(min_p)[:, None] * probs[:, :1])
    keep = keep | (rank == 0)  # the most likely token always stays eligible
    # The noise belongs to token ids, not to ranks: tokens with equal logits (common in a
    # quantized model's tail) come out of argsort in an order that varies with the batch's
    # shape, and rank-indexed noise then picked a different token for the same seed after
    # a resume or in another batch (found by bench/chaos.py).
    noise = mx.stack([mx.random.gumbel((V,), key=step_key(p.seed, p.seed_offset + i)) for p, i in zip(params, indices)])
    noise = mx.take_along_axis(noise, order, axis=-1)
    choice = mx.argmax(mx.where(keep, sorted_logits + noise, -mx.inf), axis=-1)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(mx.int32)
