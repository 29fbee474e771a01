"""The KV byte budget: how many blocks the pool may hold (``engine.kv_cache_budget``).

Several worker processes may share one device (``tandem serve``'s prefill and decode
workers on one GPU). Each takes an equal share of the device's memory
(``engine.workers_per_device``): an ``auto`` KV budget is what is left of that share once
the model, the runner's own buffers, MLX's buffer cache and a step's own allocations are
in (:func:`headroom_bytes`). On a GPU MLX's memory
limit is the share and its cache is bounded (:func:`cache_bytes`), so a process short of
memory refuses requests (the pool is full) instead of failing an allocation, and freed
buffers go back to the device for the other processes on it. Host memory never sizes a
GPU's budget: the two machines differ by far.

MLX reports a CUDA device's size as ``total_memory`` (Metal: ``memory_size``); reading only
the Metal key sized every CUDA worker from host memory. MLX's buffer cache is otherwise
bounded only by 0.95 of the device, so one worker's freed buffers could keep another from
loading.
"""

from __future__ import annotations

import os
import re

import mlx.core as mx

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
AUTO_FRACTION = 0.5  # CPU: of the host memory available once the model is loaded
DEVICE_FRACTION = 0.9  # GPU: of the device's memory, for every process on it together (the rest: the driver, CUDA graphs, fragmentation)
CACHE_FRACTION = 0.08  # GPU: of a process's share, MLX may keep as freed buffers for reuse (a step's transients: a prefill chunk's are ~1 GB on an 8B model)
STEP_FRACTION = 0.12  # GPU: of a process's share, kept out of the KV pool for what a step allocates beyond MLX's cache (MLX's limit is not a hard one)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"engine.kv_cache_budget={text!r}: use auto, none, or a size such as 2GiB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_info(*keys: str) -> int | None:
    if mx.default_device() != mx.gpu:
        return None
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return None
    for key in keys:
        try:
            return int(info[key])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def device_memory() -> int | None:
    """The GPU's memory in bytes; None on the CPU (or where MLX does not say)."""
    return _device_info("total_memory", "memory_size")


def device_free_memory() -> int | None:
    """What the whole GPU has free now, every process on it counted (MLX reads NVML; CUDA
    only); None where MLX does not say."""
    return _device_info("free_memory")


def share_bytes(workers: int) -> int | None:
    """One of ``workers`` processes' share of the GPU's memory; None on the CPU."""
    dev = device_memory()
    return None if dev is None else int(dev * DEVICE_FRACTION / max(1, workers))


def cache_bytes(share: int) -> int:
    """How much of a GPU process's ``share`` MLX may keep as freed buffers."""
    return int(share * CACHE_FRACTION)


def headroom_bytes(share: int) -> int:
    """What an auto KV pool leaves of a GPU process's ``share`` beside what it holds: MLX's
    buffer cache and the step's own allocations. A pool that took all but the cache left an
    8B worker 5.6 GiB of an 80 GiB device free, and serving 64 clients ran the device out
    of memory (docs/benchmarks/LOG.md)."""
    return int(share * (CACHE_FRACTION + STEP_FRACTION))


def num_blocks(setting: str, bytes_per_block: int, *, workers: int = 1, in_use: int = 0) -> int:
    """auto: on a GPU, this process's share of the device (``workers`` share it) less
    ``in_use`` (what the process holds already: weights, runner buffers) and less
    :func:`headroom_bytes`; on the CPU, half
    the available host memory over ``workers``. none: as many as physical memory could hold
    (no guard); otherwise the given size. At least one block."""
    s = (setting or "auto").strip().lower()
    if s == "auto":
        share = share_bytes(workers)
        nbytes = share - in_use - headroom_bytes(share) if share is not None else int(available_memory() * AUTO_FRACTION / max(1, workers))
    elif s == "none":
        nbytes = total_memory()
    else:
        nbytes = parse_size(s)
    return max(1, nbytes // max(1, bytes_per_block))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is MLX failing an allocation (CUDA's allocator or MLX's own)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "Unable to allocate" in text)


def memory_report() -> str:
    """One line on this process's device memory: what MLX holds (active, its buffer cache,
    the peak since start) and what the whole device has free. For logs where memory ran
    short; on the CPU only MLX's own figures."""
    gib = 2**30
    line = (f"MLX active {mx.get_active_memory() / gib:.2f} GiB, cached {mx.get_cache_memory() / gib:.2f}, "
            f"peak {mx.get_peak_memory() / gib:.2f}")
    free, total = device_free_memory(), device_memory()
    if free is not None and total is not None:
        line += f"; device {free / gib:.1f} of {total / gib:.1f} GiB free"
    return line
