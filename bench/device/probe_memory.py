"""On the device (after env.sh): where a hybrid worker's GPU memory goes while it serves.

On an H100 (2026-12-06) the engine bench ran out of device memory at 64 clients once the
KV pool was allocated whole at start (share less weights less MLX's cache), after a
4.3 s decode tick at 16 clients. This builds and warms the engine as the worker does (the
8B-shape checkpoint of ``bench/device/serving.sh``, ``/tmp/m8b``, made if absent), then
runs bursts of prompts that share a 256-token prefix (a prefix-cache hit: the portable
prefill path, whose KV writes are MLX ops) and fresh ones, and prints after each: MLX's
active / cached / peak memory, the device's free memory, whether the KV pool arrays moved
(a write that could not reuse its buffer copies a whole layer's pool), and the time.

    python3 bench/device/probe_memory.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path("/tmp/m8b")


def main() -> int:
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import gpu_serving

    if not (MODEL / "config.json").exists():
        gpu_serving.make_model(MODEL, "8b", gpu_serving.default_tokenizer_dir())
    import mlx.core as mx

    from tandem import config as config_mod
    from tandem.commands.worker import build_engine, warm_up
    from tandem.kernels.cuda.captured import device_pointers
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline import budget
    from tandem.workers import roles

    cfg = config_mod.load(None, overrides={"model.path": str(MODEL), "engine.parallel": 128})
    roles.engine_settings(cfg.engine, "hybrid", prefill_batch=cfg.worker.prefill_batch)
    eng, _ = build_engine(cfg, None, lambda m: None)
    st = eng.store
    print(f"built: {budget.memory_report()}; pool {st.capacity} of {st.num_blocks} blocks, "
          f"{st.nbytes / 2**30:.1f} GiB, {st.keys[0].nbytes / 2**20:.0f} MiB an array", flush=True)
    print(f"warm-up {warm_up(eng):.0f} ms: {budget.memory_report()}", flush=True)

    def where() -> list[int]:
        return device_pointers([st.keys[0], st.values[-1]])

    ptrs = where()
    seed = [0]

    def prompt(n: int) -> list[int]:
        seed[0] += 1
        return [1 + (7 * i + 13 * seed[0]) % 30011 for i in range(n)]

    base = prompt(256)
    eng.generate_many([(base, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))])
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # (label, prompts extending the served 256-token prefix, fresh 512-token prompts)
    for label, hits, fresh in (("1 fresh", 0, 1), ("1 hit", 1, 0), ("16 hits + 16 fresh", 16, 16),
                               ("64 + 64", 64, 64), ("128 + 128", 128, 128)):
        batch = [base + prompt(256) for _ in range(hits)] + [prompt(512) for _ in range(fresh)]
        mx.reset_peak_memory()
        t = time.perf_counter()
        try:
            eng.generate_many([(p, sp) for p in batch])
            errors = 0
        except Exception as exc:  # noqa: BLE001 - the probe reports and goes on
            errors = f"raised {exc!r}"[:200]
        now = where()
        print(f"{label}: {len(batch)} prompts in {(time.perf_counter() - t) * 1e3:.0f} ms, errors {errors}; "
              f"{budget.memory_report()}; pools {'moved' if now != ptrs else 'in place'}", flush=True)
        ptrs = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
