"""The engine: one thread owns MLX and runs admit -> schedule -> execute -> emit.

Other threads only put commands on the inbox (submit, abort, import) and read
:meth:`Engine.stats`; results go back through each request's ``on_event``. On a GPU,
device work is pipelined one step deep: step N+1's graph is built (its decode inputs are
step N's sampled tokens, still on the device) while step N computes, then step N's tokens
are read back and emitted, then step N+1 is queued with ``mx.async_eval``. A sequence
that stopped at step N therefore computes one extra token in step N+1, which is dropped.
On the CPU, where building a step can mean running it, step N is read back and emitted
before step N+1 is scheduled. With a speculator, decode rows may carry drafts that the
step verifies (see :mod:`tandem.pipeline.speculation`); such a step, and one whose rows
may draft, is read back before the next is scheduled on every device.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import threading
import time
import uuid
from dataclasses import replace

import mlx.core as mx
import numpy as np

from tandem.kvtypes import REQUEST_ID_BYTES, KVSnapshot, SamplingParams, TokenLogprob, Usage
from tandem.pipeline import budget
from tandem.pipeline.api import EngineRefused, EngineRequest, EngineStats, TokenEvent
from tandem.pipeline.block_pool import BlockPool
from tandem.pipeline.kv_store import KVStore, dtype_name
from tandem.pipeline.runner import ModelRunner, probe
from tandem.pipeline.runners import make_runner
from tandem.pipeline.grammar import Grammars
from tandem.pipeline.sampler import Sampled, sample
from tandem.pipeline.scheduler import Plan, Scheduler
from tandem.pipeline.sequence import Sequence, Status
from tandem.pipeline.speculation import Speculator
from tandem.pipeline.settings import EngineSettings

log = logging.getLogger("tandem.engine")


def parse_cpus(text: str | None) -> frozenset[int] | None:
    """``"3"``, ``"2,3"``, ``"4-7"`` -> those CPU numbers, each one this process may use;
    None or "" -> None (no pinning). Raises ValueError naming the allowed CPUs."""
    if not text or not text.strip():
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        raise ValueError("engine.cpus: this platform cannot pin a thread to CPUs (Linux only); leave it unset")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"engine.cpus={text!r}: expected CPU numbers such as 3, 2,3 or 4-7") from None
        if first > last:
            raise ValueError(f"engine.cpus={text!r}: range {part.strip()} runs backwards")
        cpus.update(range(first, last + 1))
    if not cpus <= allowed:
        raise ValueError(f"engine.cpus={text!r}: CPU(s) {sorted(cpus - allowed)} are not available to this "
                         f"process; it may use {_ranges(allowed)}")
    return frozenset(cpus)


def _ranges(cpus) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(cpus)), lambda ic: ic[1] - ic[0]):
        run = [c for _, c in run]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


class Engine:
    """``runner_factory(model, store, shape, settings)``: the runner that computes the steps
    (:func:`~tandem.pipeline.runners.make_runner` picks one for this device). ``tokenizer``:
    the model's (an mlx-lm TokenizerWrapper or a fast HF tokenizer); without it the engine
    refuses requests that carry a grammar."""

    def __init__(self, model, settings: EngineSettings, *, model_id: str, eos_token_ids=(), runner_factory=None,
                 tokenizer=None, speculator: Speculator | None = None):
        self.model = model
        self.settings = settings.resolve(on_cpu=mx.default_device() == mx.cpu)
        self._cpus = parse_cpus(settings.cpus)  # before any work: a bad value fails the start
        self.model_id = model_id
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.shape = probe(model)
        self.vocab_size = int(model(mx.array([[0]]))[0, -1].shape[-1])
        sh = self.shape
        bs = settings.block_size
        if sh.pageable:
            per_block = KVStore.bytes_per_block(sh.num_layers, sh.n_kv_heads, sh.head_dim, sh.v_head_dim, sh.dtype, bs)
        else:
            log.warning("model %s cannot be paged (%s): running it on dense per-sequence caches without prefix caching", model_id, sh.why_not)
            per_block = max(1, sh.num_layers * bs * 2 * 4 * 256)  # a rough admission guess
        self.bytes_per_block = per_block
        workers = settings.workers_per_device
        share = budget.share_bytes(workers)  # None on the CPU
        if share is not None:
            mx.set_memory_limit(share)  # MLX frees its cache before it takes more than the share
            mx.set_cache_limit(budget.cache_bytes(share))  # freed buffers beyond it go back to the device
            free = budget.device_free_memory()
            log.info("GPU memory: this process's share %.1f GiB (%d worker%s on the device), %s free now",
                     share / 2**30, workers, "s" if workers != 1 else "",
                     "?" if free is None else f"{free / 2**30:.1f} GiB")
        auto = (settings.kv_cache_budget or "auto").strip().lower() == "auto"
        num_blocks = budget.num_blocks(settings.kv_cache_budget, per_block, workers=workers,
                                       in_use=mx.get_active_memory() if share is not None else 0)
        if sh.pageable:
            initial = settings.kv_initial_tokens
            if initial is None:
                initial = settings.parallel * settings.prefill_chunk_size // 2
            self.store = KVStore(sh.num_layers, sh.n_kv_heads, sh.head_dim, sh.dtype, bs, num_blocks, sh.v_head_dim,
                                 initial_blocks=max(64, -(-initial // bs)))
        else:
            self.store = None
        self.grammars = None
        if tokenizer is not None:
            self.grammars = Grammars(getattr(tokenizer, "_tokenizer", tokenizer), self.vocab_size, self.eos_token_ids)
        self.runner: ModelRunner = (runner_factory or make_runner)(model, self.store, sh, settings)
        if share is not None and auto:
            # The runner's own memory (a dense copy of the weights, compiled steps, graphs)
            # is in now: the pool gets what is left of the share, and never less than the
            # store already holds.
            held = mx.get_active_memory() - (self.store.nbytes if self.store is not None else 0)
            num_blocks = budget.num_blocks("auto", per_block, workers=workers, in_use=held)
            if self.store is not None:
                num_blocks = max(num_blocks, self.store.capacity)
                self.store.num_blocks = num_blocks
        if auto and self.store is not None and num_blocks * bs < settings.prefill_chunk_size:
            log.warning("the KV pool holds %d tokens (%s less what the model holds): prompts longer than that "
                        "fail; run fewer workers on this device (engine.workers_per_device) or set "
                        "engine.kv_cache_budget", num_blocks * bs,
                        f"a {share / 2**30:.1f} GiB share of the GPU" if share is not None else "half the free memory")
        self.pool = BlockPool(num_blocks, bs)
        if self.store is not None:
            log.info("KV store: %d of %d blocks allocated at start (%.0f MB)", self.store.capacity, num_blocks,
                     self.store.nbytes / 1e6)
            self.pool.addressable = self.store.capacity
        self.scheduler = Scheduler(settings, self.pool, prefix_caching=settings.enable_prefix_caching and sh.pageable)
        if speculator is not None and self.store is None:
            log.warning("model %s runs on dense caches: it decodes without speculation", model_id)
            speculator = None
        self.speculator = speculator
        self._inbox: queue.Queue = queue.Queue()
        self._by_id: dict[bytes, Sequence] = {}
        self._inflight = None
        self._scheduled: Plan | None = None  # the plan of the tick in progress
        self._parts: list[tuple[Sequence, KVSnapshot]] = []  # streamed imports' parts to copy in
        # On the CPU a step is read back before the next one is scheduled (see _tick).
        self._read_back_first = mx.default_device() == mx.cpu
        wait_ms = settings.admit_wait_ms
        if wait_ms is None:  # unset: 5 ms is noise next to a CPU prefill, a third of a GPU one
            wait_ms = 5.0 if self._read_back_first else 0.0
        self._admit_wait_s = wait_ms / 1000
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = EngineStats(total_blocks=num_blocks, free_blocks=num_blocks, block_size=bs)
        self._queued = 0  # requests in the inbox or waiting; read by submit() on other threads
        self._lock = threading.Lock()
        self._tok_rate = 0.0
        self._step_ms = 0.0
        self._before_schedule: list = []
        self._after_schedule: list = []

    # ---- public, any thread -------------------------------------------------------
    def add_schedule_hooks(self, before=None, after=None) -> None:
        """Callables the engine thread runs around each scheduling decision: ``before()``
        ahead of one with work to schedule (not on an idle tick, so nothing holds the thread
        from its inbox then), ``after(plan)`` with its plan (None when nothing is due). For a host
        process that orders other work against the engine's steps (a worker's CPU gate,
        its timeline). Add them before ``start()``."""
        if before is not None:
            self._before_schedule.append(before)
        if after is not None:
            self._after_schedule.append(after)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._thread = None

    def submit(self, req: EngineRequest) -> None:
        if not isinstance(req.request_id, bytes) or len(req.request_id) != REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be {REQUEST_ID_BYTES} bytes")
        prompt = [int(t) for t in req.prompt_tokens]
        if not prompt:
            raise ValueError("the prompt is empty: send at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        sp = req.sampling
        if sp.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.pool.blocks_for(len(prompt) + 1) > self.pool.num_blocks:
            raise EngineRefused(f"prompt of {len(prompt)} tokens does not fit the KV cache ({self.pool.num_blocks * self.pool.block_size} tokens)", retry_after_s=0.0)
        with self._lock:
            if self._queued >= self.settings.max_queue_depth:
                raise EngineRefused(f"engine queue is full ({self.settings.max_queue_depth} waiting)", retry_after_s=1.0)
            self._queued += 1
        self._check_grammar(sp)
        if sp.seed is None:
            sp = replace(sp, seed=random.getrandbits(63))
        seq = Sequence(req.request_id, prompt, len(prompt), sp, req.on_event, priority=req.priority,
                       export_after_prefill=req.export_after_prefill, stop_ids=self._stop_ids(sp),
                       stream_kv=req.export_after_prefill and req.stream_kv and self.store is not None)
        self._inbox.put(("submit", seq))

    def abort(self, request_id: bytes) -> None:
        self._inbox.put(("abort", request_id))

    def reserve_kv(self, request_id: bytes, num_tokens: int, on_event, priority: int = 0) -> None:
        """A streamed import opens (its first part is on the way): hold the blocks for
        ``num_tokens`` tokens of KV (the whole prompt) from now on, so each part is copied
        into them as it arrives (:meth:`import_part`) and the final :meth:`import_kv` has
        only the blocks no part brought left to copy before the request decodes. Answered on
        ``on_event`` with an event whose ``kv_reserved`` is True once the blocks are held,
        or False (and ``error`` saying why) when the pool cannot spare them or a part did
        not follow: nothing is held then, later parts are dropped, and the caller refuses
        the transfer, or, if its final :meth:`import_kv` went in already, that one imports
        the whole snapshot as any import does. :meth:`abort` frees a reservation."""
        if not isinstance(request_id, bytes) or len(request_id) != REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be {REQUEST_ID_BYTES} bytes")
        if self.store is None:
            raise ValueError(f"model {self.model_id} runs on dense caches and cannot import KV")
        self._inbox.put(("reserve", (request_id, int(num_tokens), on_event, priority)))

    def import_part(self, part: KVSnapshot) -> None:
        """Blocks ``[part.first_block, ...)`` of a reserved import, in order after the ones
        before (views are fine: the engine copies them). Dropped when the reservation is
        gone (refused or aborted: its owner heard)."""
        self._check_snapshot(part, part=True)
        self._inbox.put(("part", part))

    def import_kv(self, snapshot: KVSnapshot, on_event, priority: int = 0) -> None:
        """Continue a request from a whole ``snapshot``. With a reservation of its request
        (:meth:`reserve_kv`) only the blocks no part brought are copied."""
        self._check_snapshot(snapshot)
        self._check_grammar(snapshot.sampling)
        sp = snapshot.sampling if snapshot.sampling.seed is not None else replace(snapshot.sampling, seed=0)
        seq = Sequence(snapshot.request_id, list(snapshot.tokens), snapshot.prompt_len, sp, on_event,
                       priority=priority, stop_ids=self._stop_ids(sp), imported=snapshot,
                       num_generated=snapshot.num_generated, num_cached_prompt=snapshot.num_cached_prompt_tokens)
        with self._lock:
            self._queued += 1
        self._inbox.put(("submit", seq))

    def stats(self) -> EngineStats:
        return replace(self._stats)

    def can_accept(self, n_tokens: int) -> bool:
        st = self._stats
        return st.waiting < self.settings.max_queue_depth and self.pool.blocks_for(n_tokens + 1) <= st.free_blocks

    def generate_many(self, requests: list[tuple[list[int], SamplingParams]], priorities: list[int] | None = None, timeout: float = 600.0) -> list[list[int]]:
        """Submit every request, wait for all, return each one's generated tokens (tests, bench)."""
        started = self._thread is None
        done: queue.Queue = queue.Queue()
        ids = [uuid.uuid4().bytes for _ in requests]
        out = {rid: [] for rid in ids}
        try:
            # Queue everything before the loop starts (when it is not running yet), so
            # the schedule does not depend on how fast this thread submits.
            for i, (rid, (prompt, sp)) in enumerate(zip(ids, requests)):
                req = EngineRequest(rid, prompt, sp, done.put, priority=priorities[i] if priorities else 0)
                while True:
                    try:
                        self.submit(req)
                        break
                    except EngineRefused as exc:
                        if exc.retry_after_s == 0:
                            raise
                        self.start()
                        time.sleep(0.005)
            self.start()
            remaining = set(ids)
            deadline = time.monotonic() + timeout
            while remaining:
                ev = done.get(timeout=max(0.1, deadline - time.monotonic()))
                out[ev.request_id].extend(ev.tokens)
                if ev.finish_reason is not None:
                    if ev.finish_reason == "error":
                        raise RuntimeError(ev.error)
                    remaining.discard(ev.request_id)
        finally:
            if started:
                self.stop()
        return [out[rid] for rid in ids]

    # ---- the loop (engine thread only) --------------------------------------------
    def _loop(self) -> None:
        # Streams are per thread in mlx 0.32: a thread that exits with its streams alive
        # makes the process abort at exit ("terminate called without an active exception").
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)  # 0: the calling thread, on Linux
        try:
            self._run()
        finally:
            mx.synchronize()
            mx.clear_streams()

    def _run(self) -> None:
        try:
            while not self._stopping:
                idle = not (self.scheduler.waiting or self.scheduler.running or self._inflight)
                self._drain(0.5 if idle else None)
                if idle and self.scheduler.waiting:
                    self._gather_burst()
                if self._stopping:
                    break
                t0 = time.perf_counter()
                try:
                    produced = self._tick()
                except RuntimeError as exc:
                    if not budget.out_of_memory(exc):
                        raise
                    produced = self._fail_steps(exc)
                self._update_stats(time.perf_counter() - t0, produced, ran=self._inflight is not None)
        except Exception:  # pragma: no cover - a bug in the loop itself
            log.exception("engine loop crashed")
        finally:
            self._shutdown()

    def _gather_burst(self) -> None:
        """An idle engine just got work: wait up to ``admit_wait_ms`` for a full first
        prefill batch. Clients of a burst reach the engine a few ms apart (16 at once came
        over 4-12 ms through the edge and broker), and a prompt prefilled alone costs more
        per prompt than one in a batch of four (425 vs ~290 ms, bench/serving.py timeline),
        so starting on the first arrival delayed every prompt of the burst behind it."""
        deadline = time.monotonic() + self._admit_wait_s
        while not self._stopping and len(self.scheduler.waiting) < self.settings.max_batch_prefill:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._drain(left)

    def _drain(self, timeout: float | None) -> None:
        """Take every command in the inbox; wait up to ``timeout`` s for the first (None: don't wait)."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout is not None else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = item
            held = self._by_id.get(getattr(arg, "request_id", None))
            if kind == "submit" and held is not None and held.status is Status.RESERVED and arg.imported is not None:
                self._complete_import(held, arg)
            elif kind == "reserve":
                self._reserve(*arg)
            elif kind == "part":
                self._receive_part(held, arg)
            elif kind == "submit":
                if arg.request_id in self._by_id:
                    self._emit(arg, TokenEvent(arg.request_id, [], finish_reason="error", error="duplicate request id"))
                    with self._lock:
                        self._queued -= 1
                else:
                    self._by_id[arg.request_id] = arg
                    self.scheduler.add(arg)
            elif kind == "abort":
                seq = self._by_id.get(arg)
                if seq is not None:
                    self._finish(seq, "abort")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _tick(self) -> int:
        produced = 0
        spec = self.speculator
        if self._inflight is not None and (self._read_back_first or self._parts or _exports(self._inflight[0])
                                           or _needs_history(self._inflight[0]) or _verifies(self._inflight[0])
                                           or (spec is not None and spec.wants_tokens(self.scheduler.running))):
            # On the CPU, step N is read back and its tokens emitted before anything of
            # step N+1 runs. Launching a step may compute it on the spot (the C decode
            # step and a prefill's C RoPE/SiLU read their inputs back), and tokens emitted
            # after that reached clients a step late: a whole prefill late for the first
            # tokens of a prefill batch followed by another. On any device, a step with a
            # row whose next pick needs its tokens (penalties, a grammar) is read back
            # first, and so is a step that
            # exports KV is read back first too: its export copies from the store arrays,
            # which step N+1's forward replaces with its own pending writes, so exporting
            # after the launch computed most of step N+1 first (a prefill worker's first
            # tokens and handoffs 2.3 s late, bench/disagg.py timeline). A row that verified
            # drafts, or may draft now, needs its tokens too: how many it accepted decides
            # where its next step starts, and the drafter reads its last token.
            # Parts of streamed imports are written into the store here, between steps, for
            # the same reason: the in-flight step's graph must have let go of the arrays.
            produced = self._read_back()
        if self._parts:
            self._import_parts()
        if self.scheduler.waiting or self.scheduler.running:
            # (Idle, nothing can be scheduled: no hook may hold the thread from its inbox. A
            # decode worker's CPU gate waited here while a co-located prefill ran, and so
            # kept the parts of that very prompt's streamed KV out of the store until it ended.)
            for hook in self._before_schedule:
                hook()
        plan = self._scheduled = self.scheduler.schedule()
        timed = spec is not None and plan is not None and plan.kind == "decode" and bool(plan.rows)
        if timed:  # a decode step the speculator plans is timed: what its positions cost
            try:
                spec.plan(plan.rows, self.scheduler.grow)
            except Exception:  # a bug in drafting: the step decodes without it
                log.exception("speculative planning failed; this step decodes without drafts")
                for r in plan.rows:
                    if r.draft:
                        r.draft, r.n = [], 1
        for hook in self._after_schedule:
            hook(plan)
        launched = None
        if plan is not None:
            for seq, why in plan.failed:
                self._finish(seq, "error", error=why)
            if plan.rows:
                try:
                    t = time.perf_counter()
                    launched = self._launch(plan)
                    if timed and self._inflight is None:  # (not overlapping the step before)
                        launched += (t,)
                except Exception as exc:
                    log.exception("forward failed")
                    if budget.out_of_memory(exc):
                        mx.clear_cache()  # MLX's cached buffers go back to the device
                    for r in plan.rows:
                        self._finish(r.seq, "error", error=f"engine error: {exc}")
        # A step whose KV writes go into the pools in place (the CUDA decode kernels) can
        # be queued before step N is read back: the device then runs N+1 while this
        # thread reads N, completes it and schedules N+2.
        # (A captured step has nothing for MLX to evaluate: it is queued already.)
        early = launched is not None and (not launched[3] or self.runner.last_step_in_place)
        if early and launched[3]:
            mx.async_eval(*launched[3])
        if self._inflight is not None:
            # (Read back after the next launch: its time is not the step's own.)
            produced += self._read_back(timed=False)
        if launched is not None and not early and launched[3]:
            # Otherwise queue step N+1 only now that step N has been read back: while step
            # N's graph is alive its views pin the KV arrays, so N+1's functional writes
            # would copy every array they touch (measured: 2 s instead of 5 ms per step on
            # a 768 MB pool). Building N+1's graph still overlapped with N's compute.
            mx.async_eval(*launched[3])
        self._inflight = launched
        self._scheduled = None
        return produced

    def _fail_steps(self, exc: Exception) -> int:
        """The device ran out of memory inside a step (evaluating it, or reading it back):
        the requests of the steps in flight fail with that error and the engine goes on, so
        a worker on a full device refuses work instead of dying. Their blocks go back to
        the pool; MLX's cached buffers go back to the device."""
        plans = [self._scheduled, self._inflight[0] if self._inflight is not None else None]
        self._inflight = self._scheduled = None
        log.error("out of device memory in a step (%s): failing its requests; %s", exc, budget.memory_report())
        try:
            self.runner.sync()
        except Exception:  # noqa: BLE001 - the device's own error again: nothing more to wait for
            pass
        mx.clear_cache()
        seqs = {id(r.seq): r.seq for p in plans if p is not None for r in p.rows}
        for seq in seqs.values():
            if seq.status is not Status.FINISHED:
                self._finish(seq, "error", error=f"engine error: out of device memory ({exc})")
        return 0

    def _read_back(self, timed: bool = True) -> int:
        """Wait for all of the in-flight step (a chunk that samples nothing has no tokens
        to read, but its graph must let go of the KV arrays) and emit its tokens. A timed
        step (one the speculator planned, read back before anything else launched) tells
        the speculator what it cost."""
        inflight, self._inflight = self._inflight, None
        try:
            sampled = inflight[1]
            ticket = sampled.ticket if sampled is not None else None
            if ticket is not None:
                sampled.host_tokens = self.runner.read_tokens(ticket)
            if inflight[3] and (ticket is None or sampled.host_tokens is None):
                mx.eval(*inflight[3])
            produced = self._complete(*inflight[:3])
        except Exception as exc:  # the device work of that step failed
            log.exception("step failed")
            for r in inflight[0].rows:
                self._finish(r.seq, "error", error=f"engine error: {exc}")
            return 0
        if timed and len(inflight) > 4:
            self.speculator.observe(inflight[0].rows, time.perf_counter() - inflight[4])
        return produced

    def _grow_store(self) -> None:
        """Make every block the pool handed out addressable in the store."""
        if self.pool.high_water > self.store.capacity:
            self.runner.flush()  # growing copies the pools: steps in flight write them first
            self.runner.release_pools()
        self.store.ensure_capacity(self.pool.high_water)
        self.pool.addressable = self.store.capacity  # evict cached blocks before growing it again

    # ---- streamed imports (engine thread) -----------------------------------------
    def _reserve(self, rid: bytes, num_tokens: int, on_event, priority: int) -> None:
        seq = Sequence(rid, [], 0, SamplingParams(), on_event, priority=priority, status=Status.RESERVED)
        n = self.pool.blocks_for(num_tokens)
        why = None
        if rid in self._by_id:
            why = "duplicate request id"
        elif n < 1 or not self.pool.can_allocate(n + self.scheduler.blocks_reserved()):
            # Blocks promised to running sequences (preemption off) are not free to take.
            why = f"the KV cache cannot hold {n} more blocks now ({self.pool.num_free} free)"
        if why is not None:
            self._emit(seq, TokenEvent(rid, [], error=why, kv_reserved=False))
            return
        seq.block_ids = self.pool.reserve(n)
        self._by_id[rid] = seq
        self._emit(seq, TokenEvent(rid, [], kv_reserved=True))

    def _receive_part(self, seq: Sequence | None, part: KVSnapshot) -> None:
        if seq is None or seq.status is not Status.RESERVED:
            return  # refused or aborted: that was answered
        n = part.keys[0].shape[0]
        if part.first_block != seq.kv_received or part.first_block + n > len(seq.block_ids):
            self._drop_reservation(seq, f"KV part of blocks [{part.first_block}, {part.first_block + n}) does not "
                                        f"follow the {seq.kv_received} received of the {len(seq.block_ids)} reserved")
            return
        seq.kv_received += n
        self._parts.append((seq, part))

    def _drop_reservation(self, seq: Sequence, why: str) -> None:
        """A reservation gone wrong: its blocks go back, its owner hears (no final event:
        the request has not started here), and its request can still be imported whole."""
        self.scheduler.remove(seq)
        self._by_id.pop(seq.request_id, None)
        self._emit(seq, TokenEvent(seq.request_id, [], error=why, kv_reserved=False))

    def _complete_import(self, held: Sequence, seq: Sequence) -> None:
        """The final import of a request whose parts went into ``held``'s blocks: those
        blocks pass to ``seq`` (with the parts not copied yet), which waits to be admitted
        like any import with only the blocks no part brought left to copy. A snapshot that
        does not fit the reservation (not over the wire: the assembler checks the geometry)
        drops it and is imported whole."""
        snap = seq.imported
        nb = self.pool.blocks_for(snap.num_computed)
        if nb != len(held.block_ids) or snap.block_size != self.pool.block_size:
            self._drop_reservation(held, f"the final KV snapshot has {nb} blocks, the reservation {len(held.block_ids)}")
            self._by_id[seq.request_id] = seq
            self.scheduler.add(seq)
            return
        first = held.kv_received
        seq.imported = replace(snap, keys=[k[first:] for k in snap.keys], values=[v[first:] for v in snap.values],
                               first_block=first)
        seq.block_ids, held.block_ids = held.block_ids, []
        held.status = Status.FINISHED
        self._parts = [(seq if s is held else s, p) for s, p in self._parts]
        self._by_id[seq.request_id] = seq
        self.scheduler.add(seq)

    def _import_parts(self) -> None:
        """Copy the parts that arrived into their reserved blocks (before this tick's
        schedule: a request admitted now has all of them in)."""
        parts, self._parts = self._parts, []
        parts = [(seq, p) for seq, p in parts if seq.status is not Status.FINISHED]
        if not parts:
            return
        self._grow_store()
        self.runner.flush()  # blocks may have changed owner since the mirror's last entries
        for seq, p in parts:
            first = p.first_block
            self.store.import_blocks(seq.block_ids[first : first + p.keys[0].shape[0]], p.keys, p.values)

    def _launch(self, plan: Plan):
        rows = plan.rows
        touched = False  # blocks written by MLX ops this step, before its forward
        if self.store is not None:
            self._grow_store()
            touched = bool(plan.copies) or any(r.seq.imported is not None for r in rows)
            if touched:
                self.runner.flush()  # blocks may have changed owner since the mirror's last entries
            for src, dst in plan.copies:
                self.store.copy_block(src, dst)
            for r in rows:
                snap = r.seq.imported
                if snap is not None:
                    nb = self.pool.blocks_for(snap.num_computed)
                    self.store.import_blocks(r.seq.block_ids[snap.first_block:nb], *_reblocked(snap, self.pool.block_size))
                    r.seq.imported = None
        L = max(r.n for r in rows)
        sampled_before = self._inflight[1] if self._inflight is not None else None
        prev = sampled_before.tokens if sampled_before is not None else None
        steady = (L == 1 and prev is not None and prev.shape[0] == len(rows)
                  and all(len(r.seq.tokens) <= r.start and r.seq.pending_index == i for i, r in enumerate(rows)))
        runner = self.runner
        samplers = [i for i, r in enumerate(rows) if r.samples]
        seqs = [rows[i].seq for i in samplers]
        masks = self.grammars.start_masks(seqs) if self.grammars is not None and seqs else None
        drafted = any(r.draft for r in rows)
        if (masks is None and (L == 1 or drafted) and not touched and all(r.samples for r in rows)
                and runner.can_capture(rows)):
            # A captured step: its work is queued already, with no MLX launches. Its rows
            # take their inputs from the sequences and the in-flight step's tokens itself;
            # a verifying row's tokens are the greedy pick at each of its positions.
            toks = runner.launch_captured(rows, prev)
            if toks is not None:
                self.scheduler.advance(plan)
                for i, r in enumerate(rows):
                    r.seq.pending_index = i
                return (plan, Sampled(toks), list(range(len(rows))), [])
        if prev is not None and not isinstance(prev, mx.array):
            prev = prev.as_mlx()  # a captured step's tokens: MLX's path reads them as an array of its own
        runner.sync()  # this step's MLX work touches the pools the captured steps wrote
        if steady:
            # Steady decode: every input is the in-flight sample, in its order. No host
            # array: each one is managed memory that the GPU faults in (on the H200 a
            # 64-index gather took 151 us), and no per-row copying on this thread.
            inputs = prev[:, None]
        else:
            inputs = self._host_inputs(rows, prev, keep_host=runner.takes_host_ids)
        logits = runner.forward(rows, inputs)
        sampled = None
        if samplers:
            if drafted:
                logits, params, indices, history = self._positions(rows, samplers, logits)
            else:
                if len(samplers) < len(rows):
                    logits = logits[mx.array(samplers)]
                params = [s.sampling for s in seqs]
                indices = [s.num_generated + s.pending for s in seqs]
                history = None
                if any(s.sampling.penalized for s in seqs):
                    history = [(s.tokens, len(s.tokens) - s.output_start) if s.sampling.penalized else None for s in seqs]
            bitmask = None
            if masks is not None:
                mx.async_eval(logits)  # the forward runs while the grammar thread finishes the masks
                bitmask = masks.result()
                if drafted:  # a row with a grammar drafts nothing: its one position takes its mask
                    bitmask = np.repeat(bitmask, [rows[i].logits for i in samplers], axis=0)
            sampled = sample(logits, params, indices, history, bitmask)
            pending = sampled.arrays()
            posted = runner.post_tokens(sampled.tokens) if len(pending) == 1 and not drafted else None
            if posted is not None:  # tokens alone: the runner may read them back its own way
                sampled.ticket, done = posted
                pending.append(done)
        else:
            pending = [logits]
        self.scheduler.advance(plan)
        for j, i in enumerate(samplers):
            rows[i].seq.pending_index = j
        return (plan, sampled, samplers, pending)

    def _positions(self, rows, samplers: list[int], logits: mx.array):
        """A step with drafts: the logits of every sampling row's positions (each row's
        ``logits`` of them, in order) and, per position, the row's sampling parameters,
        the index of the token it picks in its request and the tokens before it (for
        penalties): what a step without speculation would use for that token."""
        counts = [r.logits for r in rows]
        offsets = np.cumsum([0] + counts)
        if len(samplers) < len(rows):
            logits = logits[mx.array(np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in samplers]))]
        params, indices, history = [], [], []
        penalized = False
        for i in samplers:
            r = rows[i]
            s = r.seq
            penalized |= s.sampling.penalized
            for j in range(r.logits):
                params.append(s.sampling)
                indices.append(s.num_generated + s.pending + j)
                history.append((s.tokens + r.draft[:j], len(s.tokens) + j - s.output_start) if s.sampling.penalized else None)
        return logits, params, indices, history if penalized else None

    def _host_inputs(self, rows, prev, keep_host: bool = False):
        """The step's input tokens from the sequences, the in-flight step's samples
        (``prev``) where a row's last input is still pending. ``keep_host``: the numpy array
        where the host knows them all (the runner uploads them its own way)."""
        L = max(r.n for r in rows)
        host = np.zeros((len(rows), L), np.int32)
        dev_rows, dev_idx = [], []
        for i, r in enumerate(rows):
            known = r.seq.tokens[r.start : r.start + r.n]
            if r.draft:  # the last token, then the drafts
                known = known + r.draft
            host[i, : len(known)] = known
            if len(known) < r.n:  # the last input is the in-flight step's sample
                dev_rows.append(i)
                dev_idx.append(r.seq.pending_index)
        if dev_rows and not isinstance(prev, mx.array):  # a captured step's tokens
            vals = prev.tolist()
            for i, j in zip(dev_rows, dev_idx):
                host[i, rows[i].n - 1] = vals[j]
            dev_rows = []
        if keep_host and not dev_rows:
            return host
        inputs = mx.array(host)
        if dev_rows:
            inputs = inputs.at[mx.array(dev_rows), mx.array([rows[i].n - 1 for i in dev_rows])].add(prev[mx.array(dev_idx)])
        return inputs

    def _complete(self, plan: Plan, sampled, samplers: list[int]) -> int:
        produced = 0
        holds: list[Sequence] = []  # prefill-role sequences to export once this step's tokens are out
        if sampled is not None:
            toks = sampled.host_tokens if sampled.host_tokens is not None else sampled.tokens.tolist()
            lps = sampled.logprobs.tolist() if sampled.logprobs is not None else None
            top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
            top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        parts: list[Sequence] = []  # streamed exports: prompts whose chunk completed blocks
        for r in plan.rows:
            if not r.samples:  # a sampling row registers below, once its token is in
                self.scheduler.register_full_blocks(r.seq)
                if r.seq.stream_kv and r.seq.status is Status.RUNNING:
                    parts.append(r.seq)
        offset = 0
        for i in samplers:
            row = plan.rows[i]
            seq = row.seq
            at, offset = offset, offset + row.logits
            if seq.status is Status.FINISHED:
                continue  # stopped or aborted while this step was in flight
            seq.pending -= 1
            picks = toks[at : at + row.logits]
            if row.draft:
                accepted = self.speculator.accept(seq, row.draft, picks)
                picks = picks[: accepted + 1]
                if seq.status is Status.RUNNING:
                    # The KV of the last token and the accepted drafts stays; the rejected
                    # positions' entries lie past it, for later steps to overwrite.
                    seq.num_computed = row.start + 1 + accepted
            first = seq.num_generated == 0
            out, logprobs, reason, grammar_error = [], None, None, None
            for t, tok in enumerate(picks):
                seq.tokens.append(tok)
                seq.num_generated += 1
                produced += 1
                if seq.sampling.grammar is not None and self.grammars is not None:
                    grammar_error = self.grammars.advance(seq, tok)
                    if grammar_error is not None:
                        break
                if tok in seq.stop_ids:
                    reason = "stop"
                    break
                out.append(tok)
                if seq.sampling.logprobs is not None and lps is not None:  # one per emitted token
                    n = seq.sampling.logprobs
                    top = list(zip(top_ids[at + t][:n], top_lps[at + t][:n])) if top_ids is not None else []
                    logprobs = (logprobs or []) + [TokenLogprob(tok, lps[at + t], top)]
                if seq.num_generated >= seq.sampling.max_tokens:
                    reason = "length"
                    break
            self.scheduler.register_full_blocks(seq)
            if grammar_error is not None:
                self._finish(seq, "error", error=f"grammar: {grammar_error}")
            elif reason is not None:
                self._finish(seq, reason, last=out, logprobs=logprobs)
            else:
                # The first event already says how much of the prompt came from the prefix
                # cache: a consumer that stops reading early (a stop string) still knows.
                usage = Usage(seq.prompt_len, seq.num_generated, seq.num_cached_prompt) if first else None
                self._emit(seq, TokenEvent(seq.request_id, out, logprobs, usage=usage))
                if seq.hold:
                    holds.append(seq)
        for seq in parts:
            self._export_part(seq)
        # Every first token of the step is out before the first export starts.
        for seq in holds:
            self._export(seq)
        return produced

    def _export(self, seq: Sequence) -> None:
        """End a prefill-role sequence with its KV: a final event with no tokens and the
        snapshot (with ``stream_kv``, of the blocks no part carried). Its first token went
        out in an event before (with those of the whole step): the export (2-3 ms per
        256-token prompt on the CPU, one after another for a batch's prompts) is not on
        the way to the client."""
        nb = self.pool.blocks_for(seq.num_computed)
        first = seq.kv_exported if seq.stream_kv else 0
        self.runner.flush()
        keys, values = self.store.export_blocks(seq.block_ids[first:nb])
        snap = self._snapshot(seq, keys, values, list(seq.tokens), seq.num_computed, seq.num_generated, first)
        self._finish(seq, None, snapshot=snap)

    def _export_part(self, seq: Sequence) -> None:
        """``stream_kv``: hand out the prompt blocks a chunk completed, before the next
        chunk's launch overwrites what the store arrays hold (this step was read back
        first, see _tick). The copy is the one _export would make at the end anyway; the
        worker sends the part while the next chunk computes, so only the last chunk's
        blocks are left to move once the first token is out."""
        full = min(seq.num_computed, seq.prompt_len) // self.pool.block_size
        if full <= seq.kv_exported:
            return
        self.runner.flush()
        keys, values = self.store.export_blocks(seq.block_ids[seq.kv_exported:full])
        # The final geometry already: the whole prompt is computed before the token is sampled.
        snap = self._snapshot(seq, keys, values, list(seq.tokens[: seq.prompt_len]), seq.prompt_len, 0, seq.kv_exported)
        seq.kv_exported = full
        self._emit(seq, TokenEvent(seq.request_id, [], kv_part=snap))

    def _snapshot(self, seq: Sequence, keys, values, tokens: list[int], num_computed: int, num_generated: int,
                  first_block: int) -> KVSnapshot:
        sh = self.shape
        return KVSnapshot(seq.request_id, self.model_id, self.pool.block_size, sh.num_layers, sh.n_kv_heads, sh.head_dim,
                          dtype_name(sh.dtype), tokens, num_computed, seq.prompt_len, keys, values,
                          seq.sampling, num_generated, seq.num_cached_prompt, first_block)

    def _finish(self, seq: Sequence, reason: str | None, *, last=(), logprobs=None, error=None, snapshot=None) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            with self._lock:
                self._queued -= 1
        self.scheduler.remove(seq)
        self._by_id.pop(seq.request_id, None)
        if self.grammars is not None:
            self.grammars.drop(seq)
        if self.speculator is not None:
            self.speculator.drop(seq)
        usage = Usage(seq.prompt_len, seq.num_generated, seq.num_cached_prompt)
        self._emit(seq, TokenEvent(seq.request_id, list(last), logprobs, reason, usage, error, snapshot))

    def _emit(self, seq: Sequence, event: TokenEvent) -> None:
        try:
            seq.on_event(event)
        except Exception:
            log.exception("on_event callback for %s raised", seq.request_id.hex())

    def _shutdown(self) -> None:
        if self._inflight is not None:
            try:
                mx.eval(self._inflight[1].tokens) if self._inflight[1] is not None else None
            except Exception:
                pass
            self._inflight = None
        self._drain(None)
        for seq in list(self._by_id.values()):
            self._finish(seq, "abort")
        try:
            self.runner.quiesce()
        except Exception:
            log.exception("could not settle the KV store at shutdown")

    def _update_stats(self, dt: float, produced: int, ran: bool) -> None:
        with self._lock:
            self._queued = len(self.scheduler.waiting) + self._inbox.qsize()
        if produced:
            self._tok_rate = 0.9 * self._tok_rate + 0.1 * (produced / max(dt, 1e-6))
            self._step_ms = 0.9 * self._step_ms + 0.1 * dt * 1e3
        c = self.pool.counters
        spec = self.speculator.counters if self.speculator is not None else None
        self._stats = EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=self.pool.num_free, total_blocks=self.pool.num_blocks, block_size=self.pool.block_size,
            prefix_queries=c.prefix_queries, prefix_hits=c.prefix_hits, prefix_tokens_saved=c.prefix_tokens_saved,
            tokens_per_s=self._tok_rate, step_time_ms=self._step_ms, steps=self._stats.steps + int(ran),
            cached_blocks=self.pool.num_cached, preemptions=self.scheduler.preemptions,
            prefix_hit_ratio=c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0,
            spec_draft_tokens=spec.drafted if spec else 0, spec_accepted_tokens=spec.accepted if spec else 0,
            kv_store_bytes=self.store.nbytes if self.store is not None else 0, kv_mirror_bytes=self.runner.mirror_bytes(),
            mlx_cache_bytes=mx.get_cache_memory(),
        )

    # ---- helpers ------------------------------------------------------------------
    def _stop_ids(self, sp: SamplingParams) -> frozenset[int]:
        ids = set(int(t) for t in sp.stop_token_ids)
        if not sp.ignore_eos:
            ids |= self.eos_token_ids
        return frozenset(ids)

    def _check_grammar(self, sp: SamplingParams) -> None:
        if sp.grammar is None:
            return
        if self.grammars is None:
            raise ValueError(f"model {self.model_id} was loaded without its tokenizer: it cannot follow a grammar")
        self.grammars.check(sp.grammar)

    def _check_snapshot(self, snap: KVSnapshot, part: bool = False) -> None:
        """A snapshot this engine can import: a whole one, or with ``part`` a part of a
        streamed import (the prompt only: its ``tokens`` end where its KV does; in this
        pool's block size, where a whole snapshot is re-blocked at admission)."""
        sh = self.shape
        if self.store is None:
            raise ValueError(f"model {self.model_id} runs on dense caches and cannot import KV")
        problems = []
        if snap.model_id != self.model_id:
            problems.append(f"model {snap.model_id!r} != {self.model_id!r}")
        if (snap.num_layers, snap.num_kv_heads, snap.head_dim) != (sh.num_layers, sh.n_kv_heads, sh.head_dim):
            problems.append("layer/head shape differs")
        if snap.dtype != dtype_name(sh.dtype):
            problems.append(f"KV dtype {snap.dtype} != this engine's {dtype_name(sh.dtype)}")
        if not part and snap.first_block:
            problems.append("a part of a streamed export, not a whole snapshot")
        if part and snap.block_size != self.pool.block_size:
            problems.append(f"a part in blocks of {snap.block_size} tokens, this pool's are {self.pool.block_size}")
        if part and not 0 < snap.num_computed <= len(snap.tokens):
            problems.append("num_computed must be between 1 and len(tokens)")
        if not part and not 0 < snap.num_computed < len(snap.tokens):
            problems.append("num_computed must be between 1 and len(tokens) - 1")
        if len(snap.keys) != sh.num_layers or len(snap.values) != sh.num_layers:
            problems.append("wrong number of layers of KV")
        nb = -(-snap.num_computed // snap.block_size) if snap.block_size > 0 else -1
        for a in list(snap.keys) + list(snap.values):
            n = a.shape[0] if a.ndim == 4 else -1
            fits = 1 <= n <= nb - snap.first_block if part else n == nb
            if a.ndim != 4 or not fits or snap.first_block < 0 or a.shape[1] != sh.n_kv_heads or a.shape[2] != snap.block_size:
                problems.append(f"KV array shape {a.shape} from block {snap.first_block} does not match "
                                f"{nb} blocks of {snap.block_size}")
                break
        if problems:
            raise ValueError("cannot import KV snapshot: " + "; ".join(problems))


def _exports(plan: Plan) -> bool:
    """Whether a step ends with a KV export (a prefill worker's prompt got its first token,
    or a chunk of a prompt whose KV streams completed blocks)."""
    return any((r.samples and r.seq.export_after_prefill) or r.seq.stream_kv for r in plan.rows)


def _verifies(plan: Plan) -> bool:
    """Whether a step verifies drafts (its rows' next steps start where their drafts ended)."""
    return any(r.draft for r in plan.rows)


def _needs_history(plan: Plan) -> bool:
    """Whether a step has a row whose next pick needs this step's token on the host."""
    return any(r.seq.sampling.needs_history for r in plan.rows)


def _reblocked(snap: KVSnapshot, block_size: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Snapshot KV rearranged to this pool's block size (a no-op when they agree)."""
    if snap.block_size == block_size:
        return snap.keys, snap.values

    def one(a: np.ndarray) -> np.ndarray:
        nb, h, bs, d = a.shape
        flat = a.transpose(1, 0, 2, 3).reshape(h, nb * bs, d)[:, : snap.num_computed]
        n = -(-snap.num_computed // block_size)
        out = np.zeros((h, n * block_size, d), a.dtype)
        out[:, : snap.num_computed] = flat
        return out.reshape(h, n, block_size, d).transpose(1, 0, 2, 3)

    return [one(a) for a in snap.keys], [one(a) for a in snap.values]
