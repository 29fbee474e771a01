"""How long MKL's OpenMP threads spin after a parallel region, for co-located workers.

Intel's OpenMP runtime keeps each worker thread spinning for ``KMP_BLOCKTIME`` (200 ms by
default) after a parallel region before it sleeps, so the next matrix product starts
without a wake-up. In one process that is free: the spinning thread takes the next
region. Between a prefill worker and a decode worker sharing two cores under the CPU
gate it is not: when the prefill worker's last batch of a burst ends, its idle OpenMP
thread keeps one core busy for another 200 ms, while the decode worker, which has just
been given the cores, imports the burst's KV and runs its first decode steps.
Measured (bench/disagg.py timeline): the decode worker's import step took 217-259 ms
under load against 66-133 ms for hybrid's first decode step after a prefill (the same
mirror rebuild), and its first decode steps after an unloaded handoff 101/64/42 ms
against 13-18 ms; a process that has run one matrix product burns 200 ms of CPU in the
next 300 ms of idleness, and none with a blocktime of 0 (the import step came down to
112-140 ms).

The blocktime is not 0 but :data:`AUTO_BLOCKTIME_MS`: within a prefill step the products
are a few milliseconds apart, and at 0 each one woke a sleeping thread: a one-prompt
prefill took 670 ms against 583 at the default, and 573 at 2 or 5 ms (median of 8,
alternating in one process); at 0 the unloaded time to first token of the gated layout
was 33 ms above hybrid's (bench/disagg.py). A few milliseconds of spinning after a step
cost the other worker nothing measurable.

A hybrid worker keeps the runtime's default (docs/cpu-performance.md: blocktime 0 made
its serving slower, decode steps paying for the wake-ups).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("tandem.workers.openmp")

AUTO_BLOCKTIME_MS = 5


def _runtime():
    """The Intel OpenMP runtime this process has loaded (with MKL), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libiomp5" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.kmp_set_defaults  # noqa: B018 - only the Intel runtime has it
            return lib
        except (OSError, AttributeError):
            continue
    return None


def blocktime_for(role: str, gated: bool, setting_ms: int) -> int | None:
    """The blocktime to set for this worker (None: leave the runtime's own). ``setting_ms``
    is ``worker.omp_blocktime_ms``: -1 = auto (:data:`AUTO_BLOCKTIME_MS` for a prefill or
    decode worker that shares the cores through the CPU gate, unless ``KMP_BLOCKTIME`` is
    set)."""
    if setting_ms >= 0:
        return setting_ms
    if role in ("prefill", "decode") and gated and "KMP_BLOCKTIME" not in os.environ:
        return AUTO_BLOCKTIME_MS
    return None


def set_blocktime(ms: int) -> bool:
    """Set the OpenMP blocktime for every thread that forks a parallel region from now on.

    ``kmp_set_blocktime`` would only change the calling thread's teams, and MKL is called
    from mlx's stream threads; ``kmp_set_defaults`` changes the runtime's default, which
    the engine thread's streams (created when the engine starts) take up, and, measured,
    the threads that had already used it too. False when the runtime is not Intel's."""
    lib = _runtime()
    if lib is None:
        return False
    lib.kmp_set_defaults(f"KMP_BLOCKTIME={int(ms)}".encode())
    log.info("OpenMP blocktime %d ms", ms)
    return True
