"""The engine thread's own cost per decode tick: scheduling, launch bookkeeping, sampling's
graph, read-back and token events, with the model's forward stubbed out.

    .venv/bin/python bench/engine_tick.py --batches 16,64,128
    .venv/bin/python bench/engine_tick.py --compare /tmp/base --out docs/benchmarks/engine_tick

On the H200 a batch-64 decode step waits for its host thread (6.5 ms of work and
0.45 of waiting a tick), and ~0.6 ms of that work is neither building the model's graph
nor MLX encoding it: it is this. A tiny random model (``tests/tiny_model``) fills the
engine; its ``runner.forward`` returns fixed logits, so what is timed is tandem's Python
per tick, on any machine. ``--compare DIR`` times another source tree (a git worktree of
an earlier commit) in alternating processes and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(batches: list[int], ticks: int, repeats: int) -> dict[int, float]:
    """Median over ``repeats`` of the mean engine tick (ms) at each batch size."""
    import mlx.core as mx
    from mlx_lm import load

    from tandem.pipeline.engine import Engine, EngineRequest
    from tandem.pipeline.sampler import SamplingParams
    from tandem.pipeline.settings import EngineSettings
    from tests.tiny_model import build_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="tandem-tick-")) / "tiny"
    build_tiny_model(model_dir)
    out = {}
    for B in batches:
        model, _ = load(str(model_dir))
        eng = Engine(model, EngineSettings(parallel=B, max_queue_depth=B, kv_cache_budget="256MiB"), model_id="tiny")
        logits = mx.random.normal((B, eng.vocab_size))
        mx.eval(logits)
        for i in range(B):
            sp = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
            eng.submit(EngineRequest(os.urandom(16), [1 + (i * 7 + j) % 300 for j in range(40)], sp, lambda ev: None))
        eng._drain(0)
        while eng.scheduler.waiting or any(s.num_uncomputed > 1 for s in eng.scheduler.running):
            eng._tick()  # the prompts' prefill, with the real model
        eng.runner.forward = lambda rows, inputs: logits[: len(rows)]
        for _ in range(20):
            eng._tick()
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(ticks):
                eng._tick()
            runs.append((time.perf_counter() - t) / ticks * 1e3)
        out[B] = statistics.median(runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternating processes per tree (--compare)")
    ap.add_argument("--root", default=str(ROOT), help="the source tree to import tandem from")
    ap.add_argument("--compare", default=None, metavar="DIR", help="also time this source tree, alternating")
    ap.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.inner:
        sys.path[:0] = [args.root, str(ROOT)]  # tandem from --root; tests.tiny_model from here
        import tandem  # noqa: F401  (BLAS choice before mlx)
        print(json.dumps(measure(batches, args.ticks, args.repeats)))
        return 0
    trees = [("this tree", args.root)] + ([("compare", args.compare)] if args.compare else [])
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for r in range(args.rounds if args.compare else 1):
        for label, tree in trees:
            cmd = [sys.executable, __file__, "--inner", "--root", tree, "--batches", args.batches,
                   "--ticks", str(args.ticks), "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
            if proc.returncode:
                sys.exit(f"engine_tick: the process for {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
            got = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
            results[label].append(got)
            print(f"round {r + 1} [{label}] " + ", ".join(f"B={b} {got[b]:.3f} ms" for b in batches), flush=True)
    lines = ["| batch | " + " | ".join(f"{label} (ms a tick)" for label, _ in trees)
             + (" | ratio |" if args.compare else " |"),
             "| --- |" + " --- |" * (len(trees) + (1 if args.compare else 0))]
    for b in batches:
        med = [statistics.median(run[b] for run in results[label]) for label, _ in trees]
        cells = [f"{m:.3f}" for m in med] + ([f"{med[0] / med[1]:.2f}"] if args.compare else [])
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)

    def commit(tree: str) -> str:
        got = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return (got.stdout.strip() + (" + uncommitted changes" if dirty else "")) if got.returncode == 0 else "?"
    if args.out:
        Path(args.out + ".md").write_text(
            "# Engine tick, model stubbed out (`bench/engine_tick.py`)\n\n"
            f"Trees: {', '.join(f'{label} = `{tree}` ({commit(tree)})' for label, tree in trees)}; medians over "
            f"{args.rounds if args.compare else 1} alternating processes of the median of {args.repeats} x "
            f"{args.ticks} ticks.\n\n{table}\n")
        Path(args.out + ".json").write_text(json.dumps({"trees": dict((lb, t) for lb, t in trees),
                                                        "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
