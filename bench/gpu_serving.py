"""What a user of ``tandem serve`` gets over HTTP, against what the engine does alone, in one call.

Made for the lent GPU (an 8B-shape random checkpoint, saved 4-bit g64 as users download
them), and runnable on a CPU with ``--shape tiny`` (a smoke run of the whole path):

1. ``--make-model``: writes the checkpoint (random weights, the default model's tokenizer).
2. The engine alone: ``bench/gpu_decode.py --sections engine`` at the same batch sizes, in
   its own process (``--engine-bench none`` skips it; on a CPU it has nothing to compare).
3. For each ``--topology`` (``hybrid``: one worker; ``disaggregated``: a prefill and a
   decode worker on the same device): ``tandem serve`` started as a user would, then for
   each client count C, C streaming clients (spread over ``--client-procs`` processes, so
   the client is not the limit) each send ``--rounds`` chat requests of about
   ``--prompt-tokens`` tokens and ``--max-tokens`` new tokens (``ignore_eos``).
4. Prints and writes (``--out``: ``<out>.md``/``<out>.json``) per topology and C: aggregate
   tok/s, per-request tok/s, TTFT p50/p95, ITL p50/p95, errors, and served / engine.

Two GPUs (``--gpus 0,1``): every ``tandem serve`` places its workers on them (hybrid: one
worker per GPU; disaggregated: the prefill worker on one, the decode worker on the other),
and ``--long-prompts N`` mixes N long prompts (``--long-tokens``, a few new tokens each) into
every level, one every ``--long-every`` seconds while the C streams decode: what
disaggregation is for. The long prompts' TTFT is reported beside the streams' ITL.

    python3 bench/gpu_serving.py --make-model /tmp/m8b --topologies hybrid,disaggregated
    python3 bench/gpu_serving.py --make-model /tmp/m8b --gpus 0,1 --clients 64 --long-prompts 8 \\
        --long-tokens 4096 --engine-bench none --out $OUT/gs2
    python3 bench/gpu_serving.py --shape tiny --make-model /tmp/mt --clients 1,4 \\
        --prompt-tokens 64 --max-tokens 16 --engine-bench none --out /tmp/gs

Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import serving  # noqa: E402  (the streaming client and workload of the CPU serving bench)

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}


def make_model(out: Path, shape: str, tokenizer_dir: Path) -> Path:
    """A random-weight llama checkpoint of ``shape``, quantized 4-bit g64, with the tokenizer
    files of ``tokenizer_dir`` (its vocabulary sets the model's)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    # Added tokens usually sit inside the vocabulary (SmolLM2's 17 are ids 0-16): the largest
    # id sets the size, 49,152 here, as in the real checkpoint (a count would give 49,169).
    ids = [*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens") or [])]
    vocab = max(ids) + 1
    args = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False, **SHAPES[shape])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(args))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    cfg = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").exists() else {}
    save_config(dict(args, quantization={"group_size": 64, "bits": 4}, torch_dtype="float16",
                     eos_token_id=cfg.get("eos_token_id", 2), bos_token_id=cfg.get("bos_token_id", 1)),
                out / "config.json")
    for f in tokenizer_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja", "vocab.json", "merges.txt")):
            shutil.copy(f, out / f.name)
    return out


def build_bodies(model: Path, prompt_tokens: int, max_tokens: int, count: int) -> list[dict]:
    """``count`` distinct streaming chat bodies of about ``prompt_tokens`` tokens under the
    chat template (the word count found by bisection), ``ignore_eos``."""
    from tandem.http.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    words = (serving.CORPUS * (1 + 4 * prompt_tokens // len(serving.CORPUS.split()))).split()
    bodies = []
    for i in range(count):
        def text(n: int) -> str:
            return f"Request {i}: summarise this passage. " + " ".join(words[i * 7 % 50 : i * 7 % 50 + n])

        lo, hi = 0, len(words) - 50
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tok.apply_chat_template([{"role": "user", "content": text(mid)}])) <= prompt_tokens:
                lo = mid
            else:
                hi = mid - 1
        bodies.append({"messages": [{"role": "user", "content": text(lo)}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    return bodies


def default_tokenizer_dir() -> Path:
    from tandem.pipeline import model_store

    return Path(model_store.resolve_model(None))


# ---------------------------------------------------------------- the engine alone ------

def engine_alone(batches: list[int], prompt: int, timeout: float) -> dict[int, float]:
    """Decode tok/s per batch size from ``gpu_decode.py --sections engine`` (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(HERE / "gpu_decode.py"), "--sections", "engine", "--batches",
               ",".join(map(str, batches)), "--prompt", str(prompt), "--section-timeout", str(int(timeout)),
               "--out", tmp]
        subprocess.run(cmd, timeout=timeout + 60, check=False)
        try:
            runs = json.loads((Path(tmp) / "gpu_decode.json").read_text())["runs"]
        except (OSError, ValueError, KeyError):
            return {}
    return {r["batch"]: r["decode_tps"] for r in runs if r.get("section") == "engine" and r.get("decode_tps")}


# ---------------------------------------------------------------- tandem serve ----------

class Serve:
    """``tandem serve`` as a user starts it, in its own session (so its children go with it)."""

    def __init__(self, model: Path, topology: str, parallel: int, port: int, base_port: int, state: Path,
                 log: Path, extra: list[str]):
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--topology", topology,
               "--parallel", str(parallel), "--port", str(port), "--base-port", str(base_port),
               "--state-dir", str(state), *extra]
        self.port, self.log = port, log
        self._out = open(log, "ab")
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"tandem serve exited ({self.p.returncode}): {self.log.read_text()[-3000:]}")
            try:
                status, _ = asyncio.run(serving.http_get(self.port, "/ready"))
                if status == 200:
                    return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tandem serve not ready in {timeout:.0f}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.p.pid, sig)
                self.p.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self._out.close()


def _client_proc(port: int, bodies: list[dict], clients: list[int], rounds: int, timeout: float, q, ready, go) -> None:
    async def one(i: int) -> list:
        out = []
        for r in range(rounds):
            s = await serving.stream_chat(port, bodies[(i * rounds + r) % len(bodies)], timeout)
            out.append((s.ok, s.ttft, s.gaps, s.tokens, s.error))
        return out

    async def all_() -> list:
        return [x for xs in await asyncio.gather(*(one(i) for i in clients)) for x in xs]

    ready.put(os.getpid())  # imported and ready: the level's clock starts when every process is
    go.wait()
    q.put(asyncio.run(all_()))


def drive(port: int, bodies: list[dict], clients: int, rounds: int, procs: int, max_tokens: int,
          timeout: float) -> dict:
    """``clients`` streaming clients over ``procs`` processes; the level's figures."""
    procs = max(1, min(procs, clients))
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_client_proc, args=(port, bodies, list(range(k, clients, procs)), rounds, timeout, q,
                                                 ready, go)) for k in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        ready.get(timeout=120)
    t0 = time.perf_counter()
    go.set()
    samples = [s for _ in ps for s in q.get(timeout=timeout * rounds + 120)]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join(10)
    good = [s for s in samples if s[0] and s[3] >= max_tokens]
    errors = [s[4] or f"only {s[3]} of {max_tokens} tokens" for s in samples if s not in good]
    ttft = [s[1] for s in good]
    gaps = [g for s in good for g in s[2]]
    per_req = [(s[3] - 1) / sum(s[2]) for s in good if s[2] and sum(s[2]) > 0]
    tokens = sum(s[3] for s in good)
    return {"clients": clients, "requests": len(samples), "errors": len(errors), "error_examples": errors[:3],
            "tok_per_s": tokens / wall if wall else 0.0, "per_request_tok_per_s": statistics.median(per_req) if per_req else None,
            "ttft_p50_ms": 1e3 * serving.pct(ttft, 0.5), "ttft_p95_ms": 1e3 * serving.pct(ttft, 0.95),
            "ttft_first_ms": 1e3 * ttft[0] if ttft else None,
            "itl_p50_ms": 1e3 * serving.pct(gaps, 0.5), "itl_p95_ms": 1e3 * serving.pct(gaps, 0.95),
            "wall_s": wall}


def send_long(port: int, bodies: list[dict], every_s: float, timeout: float, stop: threading.Event) -> list:
    """One long prompt every ``every_s`` seconds (after the streams have started) until ``stop``
    or the bodies run out, one at a time: (ok, TTFT s, error) each."""
    out = []

    async def run() -> None:
        for body in bodies:
            if stop.wait(every_s):
                return
            s = await serving.stream_chat(port, body, timeout)
            out.append((s.ok, s.ttft, s.error))

    asyncio.run(run())
    return out


def drive_mixed(port: int, bodies: list[dict], long_bodies: list[dict], every_s: float, clients: int, rounds: int,
                procs: int, max_tokens: int, timeout: float) -> dict:
    """:func:`drive` with long prompts sent beside the streams; the level's figures with the
    long prompts' TTFT."""
    stop, longs = threading.Event(), []
    th = threading.Thread(target=lambda: longs.extend(send_long(port, long_bodies, every_s, timeout, stop)), daemon=True)
    th.start()
    try:
        r = drive(port, bodies, clients, rounds, procs, max_tokens, timeout)
    finally:
        stop.set()
        th.join(timeout + 30)
    ttft = [s[1] for s in longs if s[0]]
    r.update({"long_prompts": len(longs), "long_errors": sum(1 for s in longs if not s[0]),
              "long_error_examples": [s[2] for s in longs if not s[0]][:3],
              "long_ttft_p50_ms": 1e3 * serving.pct(ttft, 0.5), "long_ttft_p95_ms": 1e3 * serving.pct(ttft, 0.95)})
    return r


def report(res: dict) -> str:
    lines = [f"# tandem serve over HTTP against the engine alone ({res['shape']} shape, {res['device']})", "",
             f"`{res['command']}`", "",
             f"{res['prompt_tokens']}-token prompts, {res['max_tokens']} new tokens (ignore_eos), streaming, "
             f"{res['rounds']} requests per client, {res['client_procs']} client processes.", "",
             "| topology | clients | aggregate tok/s | served / engine | per request tok/s | TTFT p50 / p95 ms "
             "| ITL p50 / p95 ms | errors | ready after s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for topo, t in res["topologies"].items():
        for r in t["levels"]:
            eng = res["engine"].get(str(r["clients"])) or res["engine"].get(r["clients"])
            ratio = f"{r['tok_per_s'] / eng:.2f}" if eng else "-"
            per = f"{r['per_request_tok_per_s']:,.0f}" if r["per_request_tok_per_s"] else "-"
            lines.append(f"| {topo} | {r['clients']} | {r['tok_per_s']:,.0f} | {ratio} | {per} | "
                         f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p95_ms']:,.0f} | {r['itl_p50_ms']:.1f} / "
                         f"{r['itl_p95_ms']:.1f} | {r['errors']} | {t['ready_s']:.0f} |")
    if res["engine"]:
        lines += ["", "Engine alone (decode tok/s): " + ", ".join(f"batch {b}: {v:,.0f}" for b, v in res["engine"].items())]
    if res.get("long_prompts"):
        lines += ["", f"Workers on GPUs {res['gpus'] or '(as tandem serve places them)'}; {res['long_prompts']} prompts of "
                  f"~{res['long_tokens']} tokens mixed into each level while the streams decode (the streams' ITL "
                  "above includes their stalls):", "",
                  "| topology | clients | long prompts sent | long TTFT p50 / p95 ms | long errors |", "| --- | --- | --- | --- | --- |"]
        for topo, t in res["topologies"].items():
            for r in t["levels"]:
                lines.append(f"| {topo} | {r['clients']} | {r.get('long_prompts', 0)} | {r.get('long_ttft_p50_ms', float('nan')):,.0f} / "
                             f"{r.get('long_ttft_p95_ms', float('nan')):,.0f} | {r.get('long_errors', 0)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="an existing checkpoint directory")
    ap.add_argument("--make-model", type=Path, help="write the random checkpoint here (unless it exists) and serve it")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--topologies", default="hybrid,disaggregated")
    ap.add_argument("--clients", default="1,16,64,128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--parallel", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="one more argument for tandem serve (repeatable)")
    ap.add_argument("--gpus", help="place the workers on these GPUs (tandem serve --gpus), e.g. 0,1")
    ap.add_argument("--long-prompts", type=int, default=0, help="long prompts mixed into each level")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--long-every", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--engine-bench", choices=("gpu_decode", "none"), default="gpu_decode")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--base-port", type=int, default=6600)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gpu_serving")
    a = ap.parse_args(argv)
    if not a.model and not a.make_model:
        ap.error("give --model or --make-model")
    model = a.model
    if a.make_model:
        model = a.make_model
        if not (model / "config.json").exists():
            t = time.perf_counter()
            make_model(model, a.shape, default_tokenizer_dir())
            print(f"checkpoint written to {model} in {time.perf_counter() - t:.1f} s", flush=True)
    import mlx.core as mx

    levels = [int(c) for c in a.clients.split(",")]
    res = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "shape": a.shape,
           "device": str(mx.default_device()), "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
           "rounds": a.rounds, "client_procs": a.client_procs, "gpus": a.gpus, "long_prompts": a.long_prompts,
           "long_tokens": a.long_tokens, "engine": {}, "topologies": {}}
    if a.engine_bench == "gpu_decode":
        res["engine"] = engine_alone(levels, a.prompt_tokens, a.ready_timeout)
        print("engine alone:", res["engine"], flush=True)
    bodies = build_bodies(model, a.prompt_tokens, a.max_tokens, max(levels) * a.rounds)
    long_bodies = build_bodies(model, a.long_tokens, 4, a.long_prompts) if a.long_prompts else []
    serve_args = [*a.serve_arg, *(["--gpus", a.gpus] if a.gpus else [])]
    for i, topo in enumerate(a.topologies.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            port, base = a.port + i, a.base_port + 20 * i  # a fresh port each: a restart on one was refused for a minute
            serve = Serve(model, topo, a.parallel, port, base, Path(tmp), Path(tmp) / "serve.log", serve_args)
            try:
                ready = serve.wait_ready(a.ready_timeout)
                _, listing = asyncio.run(serving.http_get(port, "/v1/models"))
                model_id = json.loads(listing)["data"][0]["id"]
                for b in bodies + long_bodies:
                    b["model"] = model_id
                rows = []
                for c in levels:
                    r = (drive_mixed(port, bodies, long_bodies, a.long_every, c, a.rounds, a.client_procs, a.max_tokens,
                                     a.timeout) if long_bodies else
                         drive(port, bodies, c, a.rounds, a.client_procs, a.max_tokens, a.timeout))
                    print(topo, json.dumps(r), flush=True)
                    rows.append(r)
                res["topologies"][topo] = {"ready_s": ready, "levels": rows}
            finally:
                serve.stop()
                shutil.copy(Path(tmp) / "serve.log", Path(f"{a.out}-{topo}.log")) if os.environ.get("KEEP_LOGS") else None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    Path(f"{a.out}.md").write_text(text)
    print(text)
    return 0 if all(r["errors"] == 0 and not r.get("long_errors") for t in res["topologies"].values()
                    for r in t["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
