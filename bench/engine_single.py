"""Single-request speed of the default model for each weight format and CPU BLAS.

Each configuration runs in its own process (the BLAS is chosen before mlx loads)
and all of them run in this one invocation, so the ratios are comparable even on a
noisy machine. Writes docs/benchmarks/engine_single.{md,json}.

    .venv/bin/python bench/engine_single.py [--prompt-tokens 512] [--decode-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [("mkl", "dense"), ("mkl", "quantized"), ("reference", "dense"), ("reference", "quantized")]


def measure(args) -> dict:
    """Runs inside the child process."""
    import tandem
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tandem.pipeline.loader import load_model
    from tandem.pipeline.model_store import resolve_model

    loaded = load_model(resolve_model(args.model, log=lambda m: None), args.weights)
    model = loaded.model
    prompt = mx.array([[(7 * i + 13) % 40000 + 100 for i in range(args.prompt_tokens)]])
    prefill, decode = [], []
    for _ in range(args.repeats):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        prefill.append(args.prompt_tokens / (time.perf_counter() - t))
        token = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
            mx.eval(token)
        decode.append(args.decode_tokens / (time.perf_counter() - t))
    return {"blas": tandem.BLAS, "weights": loaded.weights, "prefill_tok_s": max(prefill), "decode_tok_s": max(decode)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="where to write results")
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0

    rows = []
    for blas, weights in CONFIGS:
        cmd = [sys.executable, __file__, "--child", "--weights", weights, "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
        if args.model:
            cmd += ["--model", args.model]
        print(f"running {blas} / {weights} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TANDEM_BLAS": blas})
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        rows.append({"blas_requested": blas, **json.loads(out.stdout.strip().splitlines()[-1])})

    base = next(r for r in rows if r["blas_requested"] == "reference" and r["weights"] == "quantized")
    lines = [
        "| BLAS | weights | prefill tok/s | decode tok/s | prefill × | decode × |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['blas']} | {r['weights']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{r['prefill_tok_s'] / base['prefill_tok_s']:.1f} | {r['decode_tok_s'] / base['decode_tok_s']:.1f} |")
    table = "\n".join(lines)
    print(table)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "command": "python bench/engine_single.py " + " ".join(sys.argv[1:])}
    (out_dir / "engine_single.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out_dir / "engine_single.md").write_text(
        f"# Single-request speed, default model\n\n{meta['date']}, {meta['cores']} cores, "
        f"{args.prompt_tokens}-token prompt, {args.decode_tokens} decode tokens, best of {args.repeats}.\n"
        f"Command: `{meta['command']}`. Ratios are against the stock configuration (reference BLAS, quantized).\n\n{table}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
