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
import queue
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
    # The 8B's layer shapes, four layers: kernel and shape probes start in seconds
    # (bench/device/probe_first_use.py).
    "8b-4l": dict(hidden_size=4096, num_hidden_layers=4, intermediate_size=14336, num_attention_heads=32,
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


def _engine_proc(model: str, bodies: list[dict], levels: list[int], rounds: int, parallel: int, max_tokens: int,
                 timeout: float, q) -> None:
    """In its own process: the engine as ``tandem serve``'s hybrid worker builds and warms it
    (``commands.worker.build_engine`` / ``warm_up``, default config, ``--parallel``), driven by
    the same workload as the HTTP levels, token for token (the bodies under the chat template):
    C clients, each sending its requests one after another, the next as soon as one ends."""
    try:
        q.put(("ok", _engine_levels(model, bodies, levels, rounds, parallel, max_tokens, timeout)))
    except Exception as exc:  # reported, not raised: the parent goes on to serve
        import traceback
        q.put(("error", f"{exc!r}\n{traceback.format_exc()[-2000:]}"))


def _engine_levels(model: str, bodies: list[dict], levels: list[int], rounds: int, parallel: int, max_tokens: int,
                   timeout: float) -> list[dict]:
    from tandem import config as config_mod
    from tandem.commands.worker import build_engine, warm_up
    from tandem.http.tokenizer import load_tokenizer
    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.api import EngineRequest

    from tandem.workers import roles

    cfg = config_mod.load(None, overrides={"model.path": model, "engine.parallel": parallel})
    roles.engine_settings(cfg.engine, "hybrid", prefill_batch=cfg.worker.prefill_batch)
    # Every client's request is taken, as the served stack queues them (the broker holds
    # what the worker does not take); the engine's own queue would refuse past its depth.
    cfg.engine.max_queue_depth = max(cfg.engine.max_queue_depth, max(levels))
    eng, _ = build_engine(cfg, None, lambda m: print(m, file=sys.stderr))
    ticks: list[tuple] = []  # (time, plan kind, rows, tokens) per schedule, filled during a level
    recording = threading.Event()

    def after(plan) -> None:
        if recording.is_set():
            ticks.append((time.perf_counter(), plan.kind if plan is not None and plan.rows else "idle",
                          len(plan.rows) if plan is not None else 0, sum(r.n for r in plan.rows) if plan is not None else 0))

    eng.add_schedule_hooks(after=after)
    warm_up(eng)  # as the worker does: before the engine thread runs for good
    eng.start()
    try:
        tok = load_tokenizer(Path(model))
        prompts = [tok.apply_chat_template(b["messages"]) for b in bodies]
        # One unmeasured pass over the workload's prompts first: on a fresh machine the
        # engine, the first process there, met each prompt length's first use inside its
        # levels (a 3.6 s first token at 16 clients on 12-05), which is not the engine's speed.
        _engine_level(eng, prompts, min(len(prompts), max(levels)), 1, 16, timeout, [], SamplingParams, EngineRequest)
        out = []
        for c in levels:
            ticks.clear()
            recording.set()
            try:
                out.append(_engine_level(eng, prompts, c, rounds, max_tokens, timeout, ticks, SamplingParams,
                                         EngineRequest))
            except Exception as exc:  # noqa: BLE001 - the levels before it still count
                print(f"engine at {c} clients failed: {exc!r}", flush=True)
                break
            finally:
                recording.clear()
            print("engine", json.dumps(out[-1]), flush=True)
        return out
    finally:
        eng.stop()


def _engine_level(eng, prompts, clients: int, rounds: int, max_tokens: int, timeout: float, ticks: list,
                  SamplingParams, EngineRequest) -> dict:
    """One level against the engine; the figures :func:`drive` reports, plus where the engine
    thread's time went (each tick from one schedule to the next, by the kind of its plan)."""
    lock, done = threading.Lock(), threading.Event()
    samples: list[tuple] = []
    left = [clients]

    def send(i: int, r: int) -> None:
        t0 = time.perf_counter()
        st = {"t": t0, "first": None, "gaps": [], "n": 0}

        def on_event(ev) -> None:
            now = time.perf_counter()
            if ev.tokens:
                if st["first"] is None:
                    st["first"] = now - t0
                else:
                    st["gaps"].append(now - st["t"])
                st["t"], st["n"] = now, st["n"] + len(ev.tokens)
            if ev.finish_reason is not None:
                with lock:
                    samples.append((ev.finish_reason != "error", st["first"], st["gaps"], st["n"], ev.error))
                if r + 1 < rounds:
                    send(i, r + 1)
                else:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        eng.submit(EngineRequest(os.urandom(16), prompts[(i * rounds + r) % len(prompts)], sp, on_event))

    t0 = time.perf_counter()
    for i in range(clients):
        send(i, 0)
    finished = done.wait(timeout * rounds + 60)
    wall = time.perf_counter() - t0
    ticks = list(ticks)
    # Tick k runs from schedule k to schedule k+1: its plan's kind takes that time.
    spent: dict[str, float] = {}
    decode_ms: dict[int, list[float]] = {}
    slow = []
    for (ta, kind, rows, tokens), (tb, *_rest) in zip(ticks, ticks[1:]):
        spent[kind] = spent.get(kind, 0.0) + (tb - ta)
        slow.append((round(1e3 * (tb - ta), 1), kind, rows, tokens))
        if kind == "decode":
            decode_ms.setdefault(rows, []).append(1e3 * (tb - ta))
    return {**level_figures(samples, clients, wall, max_tokens, () if finished else ("level timed out",)),
            "engine_s_by_tick": {k: round(v, 3) for k, v in spent.items()},
            "ticks": {k: sum(1 for t in ticks if t[1] == k) for k in {t[1] for t in ticks}},
            "slowest_ticks_ms_kind_rows_tokens": sorted((t for t in slow if t[1] != "idle"), reverse=True)[:10],
            "decode_step_ms_p50_by_rows": {b: round(statistics.median(v), 2) for b, v in sorted(decode_ms.items())
                                           if len(v) >= 5}}


def engine_same_workload(model: Path, bodies: list[dict], levels: list[int], rounds: int, parallel: int,
                         max_tokens: int, timeout: float) -> dict[int, dict]:
    """The HTTP levels' workload against the engine alone (:func:`_engine_proc`, its own
    process, so its device memory is free before ``tandem serve`` starts): per level, the
    figures :func:`drive` reports."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_engine_proc, args=(str(model), bodies, levels, rounds, parallel, max_tokens, timeout, q))
    p.start()
    deadline = time.monotonic() + len(levels) * (timeout * rounds + 60) + 900
    try:
        while True:  # (a child that aborts, e.g. on a CUDA error, puts nothing: stop waiting then)
            try:
                status, value = q.get(timeout=5)
                break
            except queue.Empty:
                if not p.is_alive():
                    status, value = "error", f"the engine's process exited with code {p.exitcode}"
                    break
                if time.monotonic() > deadline:
                    status, value = "error", "no result before the deadline"
                    break
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        print(f"engine on the same workload failed: {value}", flush=True)
        return {}
    return {r["clients"]: r for r in value}


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


def _serve_procs(root: int) -> dict[int, str]:
    """The processes of a ``tandem serve`` (``root`` and its descendants: the supervisor starts
    each child in a session of its own): pid -> role (``hybrid-0``, ``prefill-0``,
    ``decode-0``: the worker's ``--name``; ``broker``, ``edge`` (gunicorn's workers too), ``serve``)."""
    parent, argv = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = serving.stat_fields(f"/proc/{entry}/stat")
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if fields is not None:
            parent[int(entry)] = int(fields[1])
            argv[int(entry)] = [a.decode(errors="replace") for a in args if a]
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        args = argv.get(pid, [])
        role = args[args.index("--name") + 1] if "--name" in args[:-1] else next(
            (a for a in args if a in ("broker", "edge", "serve", "worker")), "other")
        out[pid] = out.get(parent.get(pid), role) if role == "other" else role
        todo += [c for c, p in parent.items() if p == pid]
    return out


def _cpu_s(pid: int, tid: int | None = None) -> float:
    fields = serving.stat_fields(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    return 0.0 if fields is None else serving.stat_cpu_s(fields)


def _threads_cpu_s(pid: int) -> dict[str, float]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        out[f"{name}:{tid}"] = _cpu_s(pid, int(tid))
    return out


class ServeCpu:
    """CPU seconds of each ``tandem serve`` process role over a level, and of each thread of
    the workers (the engine thread and the IO thread share one interpreter) and of the edge's
    processes (gunicorn's master and workers, ``edge-<pid>``); with ``py_spy`` seconds and
    py-spy on the PATH, the stacks of each of those processes over that long from 2 s into
    the level (raw collapsed stacks per thread, for a flame graph). The edge's CPU per token
    on the GPU host was several times what the stub engine's run shows on a 2-core machine."""

    def __init__(self, pgid: int, py_spy: float = 0.0, spy_prefix: str = ""):
        self.procs = _serve_procs(pgid)
        self.cpu0 = {pid: _cpu_s(pid) for pid in self.procs}
        self.label = {pid: r if r != "edge" else f"edge-{pid}" for pid, r in self.procs.items()}
        self.thr0 = {pid: _threads_cpu_s(pid) for pid, r in self.procs.items()
                     if r.split("-")[0] in ("hybrid", "prefill", "decode", "edge")}
        self.ptx0 = self._ptx()
        self.spies = []
        exe = shutil.which("py-spy") if py_spy else None
        for pid in self.thr0 if exe else ():
            out = f"{spy_prefix}-{self.label[pid]}.txt"
            self.spies.append(subprocess.Popen(
                ["bash", "-c", f"sleep 2; exec {exe} record --pid {pid} --duration {max(1, int(py_spy))} --rate 250 "
                               f"--format raw --threads --nonblocking --output {out}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def finish(self) -> dict:
        for sp in self.spies:
            try:
                sp.wait(30)
            except subprocess.TimeoutExpired:
                sp.kill()
        by_role: dict[str, float] = {}
        for pid, role in self.procs.items():
            by_role[role] = round(by_role.get(role, 0.0) + _cpu_s(pid) - self.cpu0[pid], 2)
        threads = {}
        for pid, t0 in self.thr0.items():
            now = _threads_cpu_s(pid)
            busy = sorted(((round(v - t0.get(k, 0.0), 2), k) for k, v in now.items()), reverse=True)
            threads[self.label[pid]] = {k: v for v, k in busy[:6] if v > 0}
        return {"cpu_s": by_role, "worker_threads_cpu_s": threads,
                "ptx_compiled": None if self.ptx0 is None else sorted(self._ptx() - self.ptx0)[:20]}

    @staticmethod
    def _ptx() -> set[str] | None:
        """MLX's on-disk PTX cache (``MLX_PTX_CACHE_DIR``): a file new during a level is a
        kernel MLX compiled while serving."""
        d = os.environ.get("MLX_PTX_CACHE_DIR")
        try:
            return set(os.listdir(d)) if d else None
        except OSError:
            return set()


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
    return level_figures(samples, clients, wall, max_tokens)


def level_figures(samples: list[tuple], clients: int, wall: float, max_tokens: int, errors=()) -> dict:
    """A level's figures from its requests' (ok, TTFT s, token gaps s, tokens, error) and its
    wall time; ``errors``: the level's own, beside the requests'."""
    good = [s for s in samples if s[0] and s[3] >= max_tokens]
    errors = [s[4] or f"only {s[3]} of {max_tokens} tokens" for s in samples if s not in good] + list(errors)
    ttft = [s[1] for s in good]
    gaps = [g for s in good for g in s[2]]
    per_req = [(s[3] - 1) / sum(s[2]) for s in good if s[2] and sum(s[2]) > 0]
    tokens = sum(s[3] for s in good)
    return {"clients": clients, "requests": len(samples), "errors": len(errors), "error_examples": errors[:3],
            "tok_per_s": tokens / wall if wall else 0.0, "per_request_tok_per_s": statistics.median(per_req) if per_req else None,
            "ttft_p50_ms": 1e3 * serving.pct(ttft, 0.5), "ttft_p95_ms": 1e3 * serving.pct(ttft, 0.95),
            "ttft_first_ms": 1e3 * ttft[0] if ttft else None,
            "itl_p50_ms": 1e3 * serving.pct(gaps, 0.5), "itl_p95_ms": 1e3 * serving.pct(gaps, 0.95),
            "itl_p99_ms": 1e3 * serving.pct(gaps, 0.99), "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
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
             "| ITL p50 / p95 / max ms | errors | ready after s | CPU s: workers / edge / broker |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for topo, t in res["topologies"].items():
        for r in t["levels"]:
            eng = res["engine"].get(str(r["clients"])) or res["engine"].get(r["clients"])
            ratio = f"{r['tok_per_s'] / eng:.2f}" if eng else "-"
            per = f"{r['per_request_tok_per_s']:,.0f}" if r["per_request_tok_per_s"] else "-"
            cpu = r.get("cpu_s") or {}
            workers = sum(v for k, v in cpu.items() if k.split("-")[0] in ("hybrid", "prefill", "decode"))
            lines.append(f"| {topo} | {r['clients']} | {r['tok_per_s']:,.0f} | {ratio} | {per} | "
                         f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p95_ms']:,.0f} | {r['itl_p50_ms']:.1f} / "
                         f"{r['itl_p95_ms']:.1f} / {r.get('itl_max_ms', float('nan')):,.0f} | {r['errors']} | "
                         f"{t['ready_s']:.0f} | {workers:.1f} / {cpu.get('edge', 0):.1f} / {cpu.get('broker', 0):.1f} |")
    if res.get("engine_levels"):
        lines += ["", "The engine alone on the same workload (in one process, as the hybrid worker builds and warms it; "
                  "served / engine above divides by its aggregate):", "",
                  "| clients | aggregate tok/s | per request tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | errors "
                  "| engine thread s by tick kind | decode step ms p50 by rows |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c, r in res["engine_levels"].items():
            per = f"{r['per_request_tok_per_s']:,.0f}" if r["per_request_tok_per_s"] else "-"
            steps = ", ".join(f"{b}: {v}" for b, v in list(r["decode_step_ms_p50_by_rows"].items())[-4:])
            lines.append(f"| {c} | {r['tok_per_s']:,.0f} | {per} | {r['ttft_p50_ms']:,.0f} / {r['ttft_p95_ms']:,.0f} | "
                         f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | {r['errors']} | {r['engine_s_by_tick']} | {steps} |")
    if res.get("engine_decode"):
        lines += ["", "Engine decode alone (bench/gpu_decode.py, tok/s): " + ", ".join(
            f"batch {b}: {v:,.0f}" for b, v in res["engine_decode"].items())]
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
    ap.add_argument("--engine-bench", default="same",
                    help="comma list: same (the engine in-process on this very workload, which served / engine "
                         "compares against), gpu_decode (bench/gpu_decode.py's decode-only figures, for reference), "
                         "or none")
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                    help="record each worker's stacks this long in every level of 16+ clients (py-spy on the PATH)")
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
    benches = set(a.engine_bench.split(",")) - {"none"}
    if benches - {"same", "gpu_decode"}:
        ap.error(f"--engine-bench: unknown {sorted(benches - {'same', 'gpu_decode'})}")
    if "gpu_decode" in benches:
        res["engine_decode"] = engine_alone(levels, a.prompt_tokens, a.ready_timeout)
        print("engine alone, decode only:", res["engine_decode"], flush=True)
    bodies = build_bodies(model, a.prompt_tokens, a.max_tokens, max(levels) * a.rounds)
    if "same" in benches:
        res["engine_levels"] = engine_same_workload(model, bodies, levels, a.rounds, a.parallel, a.max_tokens, a.timeout)
        res["engine"] = {c: r["tok_per_s"] for c, r in res["engine_levels"].items()}
        print("engine alone, same workload:", res["engine"], flush=True)
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
                    cpu = ServeCpu(serve.p.pid, a.py_spy if c >= 16 else 0.0, f"{a.out}-{topo}-c{c}")
                    r = (drive_mixed(port, bodies, long_bodies, a.long_every, c, a.rounds, a.client_procs, a.max_tokens,
                                     a.timeout) if long_bodies else
                         drive(port, bodies, c, a.rounds, a.client_procs, a.max_tokens, a.timeout))
                    r.update(cpu.finish())
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
