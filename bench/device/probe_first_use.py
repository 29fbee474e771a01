"""On the device (after env.sh): what a prefill shape costs the first time it is met.

Served on an H100 (2026-12-05), a streaming client saw single stalls of 0.45-2.8 s (ITL max)
and a second request whose first token took 1.85 s against 93 ms for the first, with no
kernel compiled by NVRTC during those levels. Two first-use costs remain candidates: MLX
builds a cuDNN attention graph per (q, k, v, mask) shape and stride (its ``sdpa_cache``),
and ``mx.compile`` retraces the compiled prefill layers per (prompts, length). Here one
engine (the worker's build and warm-up, on a checkpoint with the 8B's layer shapes and
``PROBE_LAYERS`` layers) prefills a sequence of shapes, each twice with different prompts,
and prints both times; the run is repeated with ``MLX_CUDA_USE_CUDNN_SDPA=0`` (MLX's own
attention ops instead of cuDNN's):

    python3 bench/device/probe_first_use.py          # both runs
    python3 bench/device/probe_first_use.py cudnn    # one run in this process
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = int(os.environ.get("PROBE_LAYERS", "4"))
MODEL = Path(os.environ.get("PROBE_MODEL", f"/tmp/m8b{LAYERS}l"))
# (prompt lengths of one batch, whether it extends an earlier prompt: a prefix-cache hit)
CASES = [((512,), False), ((512,), True), ((512, 512), False), ((512, 512, 512, 512), False),
         ((448,), False), ((500, 300), False), ((1024,), False), ((2048,), False),
         # Prefix hits of other lengths and batches: after the warm-up's hit, a 256-token hit
         # took 0.95 s and a burst of 4-prompt hits ~4 s more (H100, 2026-12-05 18:03): a
         # cost per shape on this path (MLX's cuDNN attention builds a graph per shape)?
         ((384,), True), ((512, 512), True), ((512, 512, 512, 512), True), ((400, 500, 300), True)]


def run(label: str) -> None:
    from tandem import config as config_mod
    from tandem.commands.worker import build_engine, warm_up
    from tandem.kvtypes import SamplingParams
    from tandem.workers import roles

    cfg = config_mod.load(None, overrides={"model.path": str(MODEL), "engine.parallel": 64})
    roles.engine_settings(cfg.engine, "hybrid", prefill_batch=cfg.worker.prefill_batch)
    eng, _ = build_engine(cfg, None, lambda m: None)
    print(f"{label}: warm-up {warm_up(eng):.0f} ms", flush=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seed = [0]

    def prompt(n: int) -> list[int]:
        seed[0] += 1
        return [1 + (7 * i + 13 * seed[0]) % 30011 for i in range(n)]

    for lengths, hit in CASES:
        times = []
        for _ in range(2):
            if hit:  # the first 256 tokens of a prompt served just before, then new ones
                base = prompt(256)
                eng.generate_many([(base, one)])
                batch = [base + prompt(n - 256) for n in lengths]
            else:
                batch = [prompt(n) for n in lengths]
            t = time.perf_counter()
            eng.generate_many([(p, one) for p in batch])
            times.append((time.perf_counter() - t) * 1000)
        print(f"{label}: prompts {list(lengths)}{' after a 256-token hit' if hit else ''}: "
              f"first {times[0]:.0f} ms, again {times[1]:.0f} ms", flush=True)


def main(argv: list[str]) -> int:
    if argv:
        run(argv[0])
        return 0
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    import gpu_serving

    if not (MODEL / "config.json").exists():
        shape = f"8b-{LAYERS}l"
        if shape not in gpu_serving.SHAPES:
            gpu_serving.SHAPES[shape] = dict(gpu_serving.SHAPES["8b-4l"], num_hidden_layers=LAYERS)
        gpu_serving.make_model(MODEL, shape, gpu_serving.default_tokenizer_dir())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    # "again": a second process on the same PTX cache. On the H100 (2026-12-05) the engine
    # bench's 1-client prefills took ~1 s each where the served worker started after it took
    # 0.13 s: if "again" is fast, the first-use cost is NVRTC compiles that MLX keeps on disk
    # (one per shape met), not cuDNN's graphs (kept per process).
    for label, extra in (("cudnn", {}), ("again", {}), ("no-cudnn", {"MLX_CUDA_USE_CUDNN_SDPA": "0"})):
        try:
            r = subprocess.run([sys.executable, __file__, label], capture_output=True, text=True, timeout=300,
                               cwd=ROOT, env=dict(env, **extra))
            out = [x for x in r.stdout.splitlines() if x.startswith(label)]
            print(*out, f"{label}: exit {r.returncode}", *r.stderr.splitlines()[-3:], sep="\n", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{label}: no answer in 300 s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
