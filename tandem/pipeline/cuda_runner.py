"""Picks the paged runner for the backend MLX runs on.

The portable :class:`~tandem.pipeline.model_runner.PagedRunner` gathers each row's blocks
and lets mlx-lm's attention run SDPA over them. On a CUDA device the kernels in
``tandem/kernels/`` can read the blocks in place instead (docs/gpu.md); this module is
where that runner is chosen, so the engine never branches on the backend itself.
"""

from __future__ import annotations

from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.model_runner import PagedRunner


def paged_runner(model, store: KVStore, *, mirror: bool) -> PagedRunner:
    return PagedRunner(model, store, mirror=mirror)
