"""The runners, one room per backend, and :func:`make_runner`, the one place that picks one.

- ``portable/``: mlx-lm's model code over the paged store (any device MLX runs on), and
  dense per-sequence caches for models the store cannot hold;
- ``cpu/``: tandem's fused forward and C kernels on the CPU;
- ``cuda/``: tandem's CUDA kernels, compiled decode steps and captured one-row graphs.
"""

from __future__ import annotations

import mlx.core as mx

from tandem.pipeline import budget
from tandem.pipeline.kv_store import KVStore
from tandem.pipeline.runner import ModelRunner, ModelShape
from tandem.pipeline.settings import EngineSettings


def make_runner(model, store: KVStore | None, shape: ModelShape, settings: EngineSettings,
                kernels: str | None = None) -> ModelRunner:
    """The runner for ``model`` on this device. ``store``: the paged KV store, None for a
    model that cannot be paged. ``kernels``: the CUDA runner's mode (see
    :data:`tandem.pipeline.runners.cuda.runner.MODES`; default from the environment)."""
    if store is None:
        from tandem.pipeline.runners.portable.dense import DenseRunner

        return DenseRunner(model)
    from tandem.pipeline.runners.cuda import runner as cuda

    runner = cuda.kernel_runner(model, store, kernels=kernels, graphs=settings.decode_graphs,
                                memory_bytes=budget.share_bytes(settings.workers_per_device))
    if runner is not None:
        return runner
    if mx.default_device() == mx.cpu:
        from tandem.pipeline.runners.cpu.runner import CpuRunner

        return CpuRunner(model, store, mirror=settings.decode_mirror, fast=settings.fast_forward,
                         native=settings.native_kernels)
    from tandem.pipeline.runners.portable.paged import PagedRunner

    return PagedRunner(model, store, mirror=settings.decode_mirror)
