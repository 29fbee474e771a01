"""`tandem worker --role prefill|decode|hybrid`: an engine behind the broker."""

from __future__ import annotations

import json
import logging
import sys

HELP = "run a prefill, decode or hybrid worker that serves requests from the broker"
DESCRIPTION = (
    "Run one worker process. It loads the model, connects to the broker's backend and "
    "stream sockets, registers (READY) and heartbeats its load. A decode worker also "
    "binds --kv-bind for authenticated KV handoffs from prefill workers. SIGTERM drains: "
    "no new work, in-flight requests finish (or move to another worker) within "
    "--drain-grace seconds. Prints one JSON line {\"event\": \"ready\", ...} when it has "
    "registered its sockets."
)

log = logging.getLogger("tandem.worker")


def add_arguments(p) -> None:
    p.add_argument("--role", choices=("prefill", "decode", "hybrid"), help="what this worker does (default hybrid)")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--model", metavar="PATH", help="mlx-lm model directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--weights", choices=("auto", "dense", "quantized"))
    p.add_argument("--broker-backend", metavar="ADDR", help="the broker's worker address (default tcp://127.0.0.1:5556)")
    p.add_argument("--broker-stream", metavar="ADDR", help="the broker's XSUB address (default tcp://127.0.0.1:5557)")
    p.add_argument("--kv-bind", metavar="ADDR", help="decode: where to accept KV handoffs (default tcp://127.0.0.1:0 = any port); "
                   "a wildcard (tcp://0.0.0.0:5600) advertises worker.kv_advertise, else the address that reaches the broker")
    p.add_argument("--kv-advertise", metavar="ADDR", help="decode: the KV address other hosts connect to (worker.kv_advertise)")
    p.add_argument("--name", help="node id (default role-host-pid)")
    p.add_argument("--parallel", type=int, help="engine: maximum active sequences")
    p.add_argument("--workers-per-device", type=int, metavar="N",
                   help="worker processes sharing this device's memory: each takes 1/N (engine.workers_per_device)")
    p.add_argument("--speculative", metavar="MODE", help="speculative decoding: auto (the default: ngram on the CPU, off on a GPU), off, ngram (prompt lookup) or draft:PATH (a smaller model with the same tokenizer)")
    p.add_argument("--heartbeat-ms", type=int, help="heartbeat interval (match the broker's)")
    p.add_argument("--drain-grace", type=float, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--kv-strategy", choices=("adaptive", "full", "streamed", "layer_parallel"), help="prefill: how KV travels to the decode worker")
    p.add_argument("--kv-compression", choices=("none", "lz4"), help="prefill: compress KV frames")
    p.add_argument("--kv-quantization", choices=("none", "int8", "int4"), help="prefill: quantize K/V for transfer (lossy)")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="cluster secret (>= 16 bytes)")
    p.add_argument("--cpu-gate", metavar="FILE", help="a lock file shared with the other prefill/decode "
                   "workers on these cores: no decode step starts while a prefill runs (worker.cpu_gate)")


def build_engine(cfg, args, log):
    """The engine this worker serves and its model id (tests/stub_engine.py puts a
    model-free engine in its place to run this command in integration tests)."""
    from tandem.commands import UserError

    from tandem.pipeline.engine import Engine
    from tandem.pipeline.loader import load_model
    from tandem.pipeline.model_store import ModelError, resolve_model
    from tandem.pipeline.speculation import make_speculator

    try:
        loaded = load_model(resolve_model(cfg.model.path, log=log), cfg.model.weights)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    try:
        # A prefill worker hands every request on after its first token: nothing to draft
        # (and no draft model to hold).
        speculator = None if cfg.worker.role == "prefill" else make_speculator(cfg.speculative, loaded.model, log=log)
    except (ModelError, ValueError) as exc:
        raise UserError(str(exc)) from None
    eng = Engine(loaded.model, cfg.engine, model_id=loaded.model_id, eos_token_ids=loaded.eos_token_ids,
                 tokenizer=loaded.tokenizer, speculator=speculator)
    return eng, loaded.model_id


WARM_PROMPT = 64  # a multiple of the CUDA runner's compiled prefill length (PREFILL_COMPILE_MULTIPLE)
WARM_HIT_TOKENS = 80  # new tokens after a prefix hit: past the few-token kernels, as a real follow-up prompt


def warm_up(engine, role: str = "hybrid") -> float:
    """Run the paths serving meets through the engine before READY (systemd's READY=1 and the
    broker's registration come after this), so no request pays a first-use cost: on CUDA each
    path's first run compiles kernels and builds cuDNN attention graphs, a stall of up to
    seconds for every request in flight. The compiled fresh prefill (padded to a multiple of 64)
    and a prefix hit followed by many new tokens each run kernels nothing else runs (a hit of
    a few tokens runs others). So: a fresh prefill of
    ``WARM_PROMPT`` tokens and its greedy decode; then, together, a prompt that extends it by
    a few tokens (a prefix-cache hit: the other prefill path) and a sampled request; then one
    that extends it by ``WARM_HIT_TOKENS``; on a prefill or decode worker, a KV handoff
    through the engine (export, then import and decode); on a runner that traces its decode
    step per row class and table width (CUDA), a step of each. Returns milliseconds."""
    import time

    from tandem.kvtypes import SamplingParams

    if not hasattr(engine, "generate_many"):  # a model-free test engine has nothing to warm
        return 0.0
    t = time.perf_counter()
    prompt = [(7 * i + 3) % 97 + 1 for i in range(WARM_PROMPT)]
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate_many([(prompt, greedy)])
    engine.generate_many([(prompt + [5, 6, 7], greedy),
                          ([0, 1, 2, 3], SamplingParams(temperature=0.7, seed=0, max_tokens=2, ignore_eos=True))])
    engine.generate_many([(prompt + [(5 * i + 1) % 89 + 1 for i in range(WARM_HIT_TOKENS)], greedy)])
    if role in ("prefill", "decode"):
        _warm_handoff(engine, [(11 * i + 5) % 83 + 1 for i in range(WARM_PROMPT + 5)], greedy)
    # Every decode row class and table width the runner traces its step for (CUDA); not on a
    # prefill worker, which hands each request on after its first token.
    warm_decode = getattr(engine.runner, "warm_decode", None)
    if warm_decode is not None and role != "prefill":
        rows, spec = engine.scheduler.max_batch_size, engine.speculator
        warm_decode(rows, verify_rows=rows * (1 + spec.max_draft) if spec is not None else 0)
    if engine.speculator is not None:  # these steps paid first-use costs: not what drafting will
        engine.speculator.times.forget()
    from tandem.pipeline import budget

    if budget.device_memory() is not None:  # a GPU that other workers may share
        import mlx.core as mx

        mx.clear_cache()  # the warm-up's buffers go back to the device
        log.info("GPU memory after the warm-up: %s", budget.memory_report())
    return (time.perf_counter() - t) * 1000


def _warm_handoff(engine, prompt: list[int], sampling) -> None:
    """A disaggregated worker's own path, first met otherwise with the first request: the
    prompt prefilled and its KV exported (the prefill worker's side), then imported into
    new blocks and decoded (the decode worker's)."""
    import queue
    import uuid

    from tandem.pipeline.api import EngineRequest

    events: queue.Queue = queue.Queue()

    def wait():
        while True:
            ev = events.get(timeout=600)
            if ev.finish_reason == "error" or ev.error:
                raise RuntimeError(f"warm-up handoff failed: {ev.error}")
            if ev.snapshot is not None or ev.finish_reason is not None:
                return ev

    engine.submit(EngineRequest(uuid.uuid4().bytes, prompt, sampling, events.put, export_after_prefill=True))
    engine.start()
    try:
        ev = wait()
        if ev.snapshot is not None:
            engine.import_kv(ev.snapshot, events.put)
            wait()
    finally:
        engine.stop()


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.commands import UserError
    from tandem.sdnotify import Notifier, Watchdog
    from tandem.wire.secret import require_cluster_secret
    from tandem.wire.sockets import is_loopback
    from tandem.workers import roles
    from tandem.workers.advertise import AdvertiseError, advertised
    from tandem.workers.worker import Worker

    cfg = config_mod.load(args.config, overrides={
        "worker.role": args.role, "model.path": args.model, "model.weights": args.weights,
        "broker.backend": args.broker_backend, "broker.stream_in": args.broker_stream,
        "worker.kv_bind": args.kv_bind, "worker.kv_advertise": args.kv_advertise, "worker.name": args.name, "engine.parallel": args.parallel,
        "engine.workers_per_device": args.workers_per_device,
        "speculative.mode": args.speculative,
        "broker.heartbeat_interval_ms": args.heartbeat_ms,
        "worker.drain_grace_s": args.drain_grace,
        "security.cluster_secret_file": args.cluster_secret_file, "transfer.strategy": args.kv_strategy,
        "transfer.compression": args.kv_compression, "transfer.quantization": args.kv_quantization,
        "worker.cpu_gate": args.cpu_gate,
    })
    role = cfg.worker.role
    if role == "decode":
        # Before the model loads: a wildcard KV bind needs an address other hosts reach.
        try:
            advertised(cfg.worker.kv_bind, cfg.worker.kv_advertise, cfg.broker.backend)
        except AdvertiseError as exc:
            raise UserError(str(exc)) from None
    roles.engine_settings(cfg.engine, role, prefill_batch=cfg.worker.prefill_batch)
    if role in ("prefill", "decode"):
        from tandem._malloc import retain_freed_memory

        # KV handoffs arrive in (and quantized ones leave from) fresh buffers of up to
        # hundreds of MB: keep freed heap memory so each transfer does not page-fault
        # it all in again (what bench/kv_transfer.py measures as well).
        retain_freed_memory()
    loopback = all(is_loopback(a) for a in (cfg.broker.backend, cfg.broker.stream_in))
    secret = require_cluster_secret(role, cfg.security.cluster_secret_file, loopback_only=loopback)
    notifier = Notifier()
    notifier.status(f"loading {cfg.model.path or 'the default model'}")
    engine, model_id = build_engine(cfg, args, lambda m: print(m, file=sys.stderr))
    warm_ms = warm_up(engine, role)
    st = engine.stats()
    worker = Worker(engine, settings=cfg.worker, backend=cfg.broker.backend, stream_in=cfg.broker.stream_in,
                    secret=secret, model_id=model_id, heartbeat_s=cfg.broker.heartbeat_interval_ms / 1000,
                    decode_allowlist=cfg.security.decode_allowlist, block_size=st.block_size or 16,
                    total_blocks=st.total_blocks, capacity=cfg.engine.parallel + cfg.engine.max_queue_depth,
                    transfer=cfg.transfer)
    worker.install_signals()
    worker.on_drain = lambda: notifier.stopping("draining")
    watchdog = Watchdog(notifier, worker.alive)
    watchdog.start()
    print(json.dumps({"event": "ready", "role": role, "node": worker.node_id, "model": model_id,
                      "kv_address": worker.kv_address}), flush=True)
    notifier.ready(f"{role} worker {worker.node_id} serving {model_id} (warmed up in {warm_ms:.0f} ms)")
    try:
        worker.run()
    finally:
        watchdog.stop()
    return 0
