"""What the engine may ask of the runner that computes its steps.

The engine schedules rows (:class:`~tandem.pipeline.sequence.Row`: a sequence and the
positions this step computes for it); a runner turns them into device work. Every backend
(portable mlx-lm forward, the CPU's fused forward and C kernels, the CUDA kernels and
captured graphs) implements :class:`ModelRunner` in its own room under
``pipeline/runners/``, and :func:`tandem.pipeline.runners.make_runner` picks one. The engine
is handed its runner and never asks which backend it has.

A step's life, as the engine drives it (see ``Engine._launch`` and ``Engine._read_back``):

1. ``can_capture(rows)`` and ``launch_captured(rows, inputs)``: a step the runner can
   queue as a captured graph, with no MLX launches; its sampled tokens come back as
   :class:`Tokens`. Otherwise ``sync()`` (captured steps in flight finish before MLX work
   touches the pools they wrote) and ``forward(rows, inputs)``, whose logits the engine
   samples; a step whose rows verify drafts is such a forward with ``L = k + 1``.
2. ``post_tokens(tokens)``: a step's sampled tokens may be posted for a faster read-back
   than MLX's own (a ticket, and an array to evaluate with the step); ``read_tokens`` reads
   them back, or None where the engine must read them MLX's way.
3. ``last_step_in_place``: the forward wrote its KV into the pools in place, so the engine
   may queue it before reading the step before it back.
4. ``flush()`` before the engine reads or writes pool blocks itself (copies, imports,
   exports, growth); ``quiesce()`` when the engine thread ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tandem.pipeline.sequence import Row


@runtime_checkable
class Tokens(Protocol):
    """A captured step's sampled tokens, still on the device until read."""

    def tolist(self) -> list[int]: ...

    def as_mlx(self) -> mx.array: ...


class ModelRunner(Protocol):
    last_step_in_place: bool
    """Whether the last launched step wrote its KV into the pools in place."""
    takes_host_ids: bool
    """Whether ``forward`` takes the step's ids as a numpy ``(B, L)`` array when the host
    knows them all (the runner then uploads them its own way)."""

    def forward(self, rows: list[Row], inputs) -> mx.array:
        """Build the step's graph: ``inputs`` ``(B, L)`` token ids, each row's real tokens
        first -> logits at each row's last ``row.logits`` real positions, row by row
        (not yet evaluated): ``(B, V)`` when every row wants one, as all do but a row that
        verifies a draft (``row.draft``: its last token and the drafted ones, every
        position's logits; see :mod:`tandem.pipeline.speculation`)."""
        ...

    def can_capture(self, rows: list[Row]) -> bool:
        """Whether ``launch_captured`` may run this step (every row decodes one token and samples)."""
        ...

    def launch_captured(self, rows: list[Row], inputs) -> Tokens | None:
        """Queue the step as a captured graph; its tokens, or None when it cannot be captured
        (the engine then runs ``forward``). ``inputs``: the in-flight step's tokens (its
        :class:`Tokens` or an array; None when it sampled nothing): a row whose last input is
        not yet in its sequence's tokens takes it from there, at its ``pending_index``."""
        ...

    def sync(self) -> None:
        """Wait for captured steps in flight: MLX work on the pools follows."""
        ...

    def post_tokens(self, tokens: mx.array) -> tuple[object, mx.array] | None:
        """A ticket to read ``tokens`` back by, and the array that fills it (evaluate it
        with the step); None where the runner has no faster way than MLX's."""
        ...

    def read_tokens(self, ticket: object) -> list[int] | None:
        """The posted tokens, or None: read them MLX's way."""
        ...

    def flush(self) -> None:
        """Bring the pools up to date before the engine reads or writes blocks itself."""
        ...

    def quiesce(self) -> None:
        """Evaluate everything that outlives a step: the engine thread is ending."""
        ...

    def release_pools(self) -> None:
        """Let go of the store's pool arrays held beyond a step (captured graphs), before
        the store grows: its old arrays then go one layer at a time as they are copied,
        instead of living beside the new store whole."""
        ...

    def mirror_bytes(self) -> int:
        """Bytes of KV the runner keeps beside the store between steps (a decode batch's
        contiguous copy): it grows to the largest batch x context decoded, then stays, so a
        worker's memory net of it and of the store shows a leak. Read every step: O(1)."""
        ...


class RunnerBase:
    """The answers of a runner that captures nothing and posts nothing."""

    last_step_in_place = False
    takes_host_ids = False

    def can_capture(self, rows: list[Row]) -> bool:
        return False

    def launch_captured(self, rows: list[Row], inputs) -> Tokens | None:
        return None

    def sync(self) -> None:
        pass

    def post_tokens(self, tokens: mx.array) -> tuple[object, mx.array] | None:
        return None

    def read_tokens(self, ticket: object) -> list[int] | None:
        return None

    def flush(self) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def release_pools(self) -> None:
        pass

    def mirror_bytes(self) -> int:
        return 0


@dataclass
class ModelShape:
    """The KV shapes a model's cache holds, and whether the paged store can hold them."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: mx.Dtype
    pageable: bool
    why_not: str = ""


def probe(model) -> ModelShape:
    """Run one token through a fresh mlx-lm cache to learn the KV shapes and cache kinds."""
    cache = make_prompt_cache(model)
    kinds = {type(c).__name__ for c in cache}
    model(mx.array([[0]]), cache=cache)
    first = next((c for c in cache if isinstance(c, KVCache) and c.keys is not None), None)
    if first is None:
        return ModelShape(len(cache), 0, 0, 0, mx.float32, False, f"cache kinds {sorted(kinds)}")
    _, h, _, d = first.keys.shape
    vd = first.values.shape[-1]
    pageable = all(type(c) is KVCache for c in cache)
    why = "" if pageable else f"its layers use {sorted(kinds)}, not only KVCache"
    return ModelShape(len(cache), h, d, vd, first.keys.dtype, pageable, why)
