"""On the device (after env.sh): which fresh prefills make the CUDA runner's process abort.

The worker's warm-up died on its first two-prompt prefill (2 x 64 tokens, the compiled
layers) with ``cudaStreamEndCapture ... failed due to a previous error during capture``
(docs/gpu.md); one 64-token prompt had passed, and MLX's causal attention alone passed at
every shape (a probe since deleted: ``git log -- bench/device/probe_sdpa.py``). Here the
runner itself, built as the worker builds it on a four-layer checkpoint with the 8B's
layer shapes (written to /tmp/m8b4 once), prefills one
(prompts, length, path) case per process, since the failure aborts the process; each prints
its exit code and, from ``PYTHONFAULTHANDLER``, the last Python frame:

    python3 bench/device/probe_prefill.py            # every case
    python3 bench/device/probe_prefill.py 2 64 compiled

Paths: ``compiled`` (the length a multiple of 64: ``mx.compile``d layers), ``plain`` (the
same length, the layers uncompiled), ``sync`` (compiled, but evaluated to the end after
every layer instead of ``async_eval``); ``warm+`` before one of them runs the worker's
warm-up first (``commands.worker.warm_up``), as the crash had: a prefill, a prefix hit, a
sampled request and the decode row classes before the two prompts; ``nographs+`` runs the
case with ``MLX_USE_CUDA_GRAPHS=0``. MLX 0.32's CUDA encoder captures each op's launches
with ``cudaStreamCaptureModeGlobal``, so a launch that fails, or a driver call another
thread makes meanwhile, spoils the capture and aborts at ``cudaStreamEndCapture``; launched
without graphs, a failing launch names itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("PROBE_MODEL", "/tmp/m8b4"))
CASES = [(2, 64, "compiled"), (2, 64, "nographs+compiled"), (2, 64, "plain"), (2, 64, "sync"),
         (2, 64, "warm+compiled"), (2, 64, "nographs+warm+compiled"), (1, 64, "compiled"),
         (2, 128, "compiled"), (2, 512, "compiled"), (3, 64, "compiled"), (4, 128, "compiled")]


def case(B: int, L: int, path: str) -> None:
    import mlx.core as mx

    from tandem import config as config_mod
    from tandem.commands.worker import build_engine
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.runners.cuda import runner as cuda_runner
    from tandem.workers import roles

    cfg = config_mod.load(None, overrides={"model.path": str(MODEL), "engine.parallel": 16})
    roles.engine_settings(cfg.engine, "hybrid", prefill_batch=cfg.worker.prefill_batch)
    eng, _ = build_engine(cfg, None, lambda m: None)
    runner = eng.runner
    path = path.removeprefix("nographs+")  # (the parent set MLX_USE_CUDA_GRAPHS=0)
    if path.startswith("warm+"):
        from tandem.commands.worker import warm_up

        print(f"warm-up {warm_up(eng):.0f} ms", flush=True)
        path = path[len("warm+"):]
    if path == "plain":
        runner._prefill_fns = None
    elif path == "sync":
        cuda_runner.mx.async_eval = mx.eval  # (mx is the module: every caller waits now)
    prompts = [[1 + (7 * i + 3 * b) % 997 for i in range(L)] for b in range(B)]
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t = time.perf_counter()
    out = eng.generate_many([(p, one) for p in prompts])
    print(f"ok {type(runner).__name__} {time.perf_counter() - t:.2f} s tokens {out}", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 3:
        case(int(argv[0]), int(argv[1]), argv[2])
        return 0
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    import gpu_serving

    if not (MODEL / "config.json").exists():
        gpu_serving.make_model(MODEL, "8b-4l", gpu_serving.default_tokenizer_dir())
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(
        filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    for B, L, path in CASES:
        try:
            r = subprocess.run([sys.executable, __file__, str(B), str(L), path], capture_output=True, text=True,
                               timeout=240, cwd=ROOT,
                               env=dict(env, MLX_USE_CUDA_GRAPHS="0") if path.startswith("nographs+") else env)
            lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith(("ok", "warm-up", "  File", "terminate", "  what", "RuntimeError", "ValueError"))]
            print(f"prompts {B} length {L} {path}: exit {r.returncode}", *lines[:4], sep="\n  ", flush=True)
        except subprocess.TimeoutExpired:
            print(f"prompts {B} length {L} {path}: no answer in 240 s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
