"""MLX's CUDA graph sizes for serving, set before MLX builds its first command encoder.

MLX's CUDA backend collects the kernels it encodes into a CUDA graph and launches that
graph once the graph holds ``MLX_MAX_OPS_PER_BUFFER`` ops or its inputs pass
``MLX_MAX_MB_PER_BUFFER`` megabytes (on sm_90, 100 ops and 1,000 MB, read from the
0.32.4 library). A prefill's layer reads ~440 MB of fp16 weights, so the byte limit cut
a 512-token prefill's graphs every two layers, each cut a graph update and launch more
for the engine thread. Without the byte limit the ops limit and the engine's own
hand-overs (``runners/cuda/runner.PREFILL_EVAL_EVERY``) set the graphs: one-prompt
prefill gained ~4%, batch-64 decode ~1%, one-row decode did not move (the captured step
does not go through MLX's graphs).

MLX reads both once per process, so they are set at import, before any array exists;
a value already in the environment wins, and ``TANDEM_MLX_GRAPHS=default`` leaves MLX's.
"""

from __future__ import annotations

import os

from tandem import knobs

SETTINGS = {"MLX_MAX_MB_PER_BUFFER": "100000"}


def tune_mlx_cuda() -> dict[str, str]:
    """Set what the environment does not; return the settings in effect that came from here."""
    if knobs.MLX_GRAPHS == "default":
        return {}
    applied = {}
    for name, value in SETTINGS.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied
