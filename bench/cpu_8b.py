"""A random 8B-shape 4-bit checkpoint served by `tandem serve --topology hybrid` on the CPU.

Writes a llama checkpoint of the 8B shape (bench/gpu_serving.SHAPES["8b"]: 32 layers,
hidden 4096, MLP 14336, 32 query / 8 KV heads) with the default model's tokenizer and
vocabulary, 4-bit group-64 with fp16 scales as ``mlx_lm.convert -q`` writes them: random
codes, one scale per matrix (the values do not change a forward's cost). It then starts
``tandem serve --topology hybrid`` on it (loopback, free ports, its own state dir),
waits for /ready, reads the stack's idle PSS (bench/memory.py), and streams
``--requests`` chat requests one at a time (bench/serving.py's client and prompts),
reporting the single-stream decode speed against the bandwidth floor: the bytes tandem's
kernels read per token (the packed layer and vocabulary matrices) over 9-20 GB/s, this
machine's measured range. The checkpoint (~4 GB) goes under ``--dir`` (default /tmp) and
is deleted afterwards unless ``--keep``.

    flock /tmp/tandem-bench.lock .venv/bin/python bench/cpu_8b.py

Writes docs/benchmarks/cpu-8b.md and .json (``--out`` changes the stem).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tandem  # noqa: F401  (BLAS before mlx)
import memory  # noqa: E402  (bench/ is first on sys.path when run as a script)
import serving  # noqa: E402
from gpu_serving import SHAPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BANDWIDTH_GBS = (9.0, 20.0)  # this machine's streaming range (docs/cpu-performance.md)


def make_checkpoint(out: Path, shape: str, tokenizer_dir: Path, seed: int = 0) -> dict:
    """Write the checkpoint; returns its config. Random codes straight from numpy: drawing
    8B normal weights and quantizing them takes most of an hour on two busy cores."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens") or [])
    args = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False, **SHAPES[shape])
    model = llama.Model(llama.ModelArgs.from_dict(args))  # lazy: nothing is drawn until evaluated
    nn.quantize(model, group_size=64, bits=4)
    rng = np.random.default_rng(seed)
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, words = m.weight.shape
            codes = np.frombuffer(rng.bytes(n * words * 4), np.uint32).reshape(n, words)
            groups = words * 8 // 64
            scale = 0.02 / 4.6  # codes uniform in 0..15: std 4.6 codes, so weights of std ~0.02
            m.weight = mx.array(codes)
            m.scales = mx.full((n, groups), scale, mx.float16)
            m.biases = mx.full((n, groups), -7.5 * scale, mx.float16)
            mx.eval(m.weight, m.scales, m.biases)
        elif isinstance(m, nn.RMSNorm):
            m.weight = mx.ones(m.weight.shape, mx.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    cfg = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").exists() else {}
    config = dict(args, quantization={"group_size": 64, "bits": 4}, torch_dtype="float16",
                  eos_token_id=cfg.get("eos_token_id", 2), bos_token_id=cfg.get("bos_token_id", 1))
    save_config(config, out / "config.json")
    for f in tokenizer_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja", "vocab.json", "merges.txt")):
            shutil.copy(f, out / f.name)
    return config


def packed_bytes(config: dict) -> tuple[int, int]:
    """(weights in the layer projections and vocabulary, bytes tandem's kernels read per
    decode step for them): 4-bit codes (0.5 B) plus an fp32 scale and offset per 32
    weights (0.25 B) without the fp16 value table (native_decode.TABLE_MAX_WEIGHTS)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    qkv = h * (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    per_layer = qkv + config["num_attention_heads"] * d * h + 3 * h * inter
    weights = layers * per_layer + config["vocab_size"] * h
    return weights, int(weights * 0.75)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="/tmp", help="where the checkpoint is written (~4 GB for 8b)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--requests", type=int, default=3, help="single-stream requests, one after another")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for startup and for each request")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "cpu-8b"))
    args = ap.parse_args()

    from tandem.pipeline.model_store import resolve_model

    work = Path(tempfile.mkdtemp(prefix=f"tandem-{args.shape}-q4-", dir=args.dir))
    model, state = work / "model", work / "state"
    state.mkdir()
    try:
        t0 = time.perf_counter()
        config = make_checkpoint(model, args.shape, Path(resolve_model(None)))
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        p, port = memory.start_serve(["--topology", "hybrid", "--model", str(model)], state, args.timeout)
        startup = time.perf_counter() - t0
        try:
            mem = memory.tree_memory(p.pid)
            print(f"ready in {startup:.0f} s, idle PSS {mem['pss'] / 2**30:.2f} GiB", flush=True)
            bodies, mean_len = serving.build_bodies(model, args.prompt_tokens, args.max_tokens, args.requests + 1)
            model_id = json.loads(asyncio.run(serving.http_get(port, "/v1/models"))[1])["data"][0]["id"]
            bodies = [dict(b, model=model_id) for b in bodies]
            asyncio.run(serving.stream_chat(port, bodies[-1], args.timeout))  # warm-up
            samples = []
            for b in bodies[:-1]:
                t = time.perf_counter()
                s = asyncio.run(serving.stream_chat(port, b, args.timeout))
                if not s.ok:
                    raise RuntimeError(f"request failed: {s.error}")
                samples.append({"ttft_s": s.ttft, "tokens": s.tokens, "wall_s": time.perf_counter() - t,
                                "decode_tok_s": len(s.gaps) / sum(s.gaps) if s.gaps else None})
                print(f"  TTFT {s.ttft:.2f} s, {s.tokens} tokens, decode {samples[-1]['decode_tok_s']:.2f} tok/s",
                      flush=True)
        finally:
            memory.stop_serve(p)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    weights, read = packed_bytes(config)
    decode = statistics.median(s["decode_tok_s"] for s in samples)
    floor = [bw * 1e9 / read for bw in BANDWIDTH_GBS]
    each = ", ".join(f"{s['decode_tok_s']:.2f}" for s in samples)
    result = {"meta": {"command": "python bench/cpu_8b.py " + " ".join(sys.argv[1:]),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
                                  f"{os.getloadavg()[0]:.1f} at the end",
                       "shape": args.shape, "config": config, "prompt_tokens": mean_len,
                       "max_tokens": args.max_tokens},
              "checkpoint_bytes": size, "startup_s": startup, "idle_pss": mem["pss"], "idle_rss": mem["rss"],
              "processes": mem["processes"], "samples": samples, "decode_tok_s_median": decode,
              "weights": weights, "bytes_read_per_token": read, "floor_tok_s": floor}
    md = "\n".join([
        f"# A random {args.shape}-shape 4-bit checkpoint on the CPU: `tandem serve --topology hybrid`", "",
        f"`{result['meta']['command']}` — {result['meta']['date']}, {result['meta']['machine']}.", "",
        f"- Checkpoint: {weights / 1e9:.2f} G weights in the projections and vocabulary, 4-bit group 64, fp16 "
        f"scales; {size / 1e9:.2f} GB on disk.",
        f"- Ready (load, the kernels' packed copy checked against mlx's dequantization, warm-up) in {startup:.0f} s.",
        f"- Idle PSS of the whole stack (broker, worker, edge): {mem['pss'] / 2**30:.2f} GiB "
        f"(largest: {mem['processes'][0]['cmd']} {mem['processes'][0]['pss'] / 2**30:.2f} GiB); the machine has "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB.",
        f"- Single stream, {mean_len}-token chat prompts, {args.max_tokens} new tokens, {len(samples)} requests one at "
        f"a time: decode {decode:.2f} tok/s (median; {each}), "
        f"TTFT {statistics.median(s['ttft_s'] for s in samples):.1f} s.",
        f"- Bandwidth floor: the kernels read {read / 1e9:.2f} GB of packed weights per token (0.75 B a weight: "
        f"4-bit codes and an fp32 scale and offset per 32), so at {BANDWIDTH_GBS[0]:.0f}-{BANDWIDTH_GBS[1]:.0f} GB/s "
        f"a token costs at least {1 / floor[1]:.2f}-{1 / floor[0]:.2f} s: {floor[0]:.2f}-{floor[1]:.2f} tok/s. "
        f"Measured: {decode / floor[0]:.2f}x the floor's lower end ({decode / floor[1]:.2f}x its upper end).", ""])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
