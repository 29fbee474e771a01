"""A model-free engine with the real Engine's interface, for tests and benchmarks; and
``python -m tests.stub_engine``, the real ``tandem worker`` process serving it.

The next token is a fixed function of every token before it (a rolling hash), so a
request continued elsewhere from ``prompt + tokens streamed so far`` produces exactly
the tokens an uninterrupted run would: the same property greedy decoding has, which
is what migration and handoff tests need to check. Exported snapshots carry a tiny
"KV" that encodes the tokens, and ``import_kv`` refuses a snapshot whose KV does not
match its tokens, so a corrupted handoff cannot go unnoticed.

It lives with the tests, not in ``tandem/``: the product's ``tandem worker`` always
loads a model. ``python -m tests.stub_engine [-v] worker [--stub-step-ms MS] ...`` runs
the command's own code (sockets, heartbeats, handoffs, drain) with this engine put in
place of the model's; the repository root must be on ``sys.path`` (run it from there or
through ``PYTHONPATH``).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from tandem.kvtypes import KVSnapshot, Usage
from tandem.pipeline.api import EngineRefused, EngineRequest, EngineStats, TokenEvent

VOCAB = 50_000
_MOD = (1 << 61) - 1


_SEED = 1469598103934665603


def _fold(h: int, t: int) -> int:
    return (h * 1000003 + t + 1) % _MOD


def _hash(history: list[int]) -> int:
    h = _SEED
    for t in history:
        h = _fold(h, t)
    return h


def next_token(history: list[int]) -> int:
    return _hash(history) % VOCAB


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What an uninterrupted stub run of ``prompt`` yields (no EOS)."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass
class _Seq:
    req: EngineRequest
    tokens: list[int]
    prompt_len: int
    generated: int = 0
    out: list[int] = field(default_factory=list)
    computed: int = 0  # stream_kv: prompt tokens prefilled (one chunk a step)
    exported: int = 0  # stream_kv: leading blocks handed out in parts
    # The rolling hash of ``tokens``, kept up to date: hashing the whole history each
    # step made a long stream's steps cost O(length) (the stub, not the path measured).
    h: int | None = None


class StubEngine:
    BLOCK = 16

    def __init__(self, *, parallel: int = 64, max_queue: int = 256, step_s: float = 0.0, total_blocks: int = 4096,
                 model_id: str = "stub", prefill_chunk: int = 0, kv_blocks: int | None = None):
        self.parallel, self.max_queue, self.step_s = parallel, max_queue, step_s
        # prefill_chunk > 0: a prompt longer than that is prefilled a chunk a step, and a
        # request with stream_kv hands out each chunk's completed blocks (TokenEvent.kv_part),
        # as the real engine does; the worker reads the chunk size from ``settings``.
        if prefill_chunk:
            self.settings = SimpleNamespace(prefill_chunk_size=prefill_chunk, block_size=self.BLOCK)
        self.prefill_chunk = prefill_chunk
        self.bytes_per_block = 2 * self.BLOCK * self.BLOCK * 4
        self.total_blocks, self.model_id = total_blocks, model_id
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[_Seq] = []
        self._running: dict[bytes, _Seq] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._pending = 0  # submitted but not yet picked up by the loop
        # Streamed imports (reserve_kv): rid -> [blocks reserved, blocks received, on_event],
        # refused past ``kv_blocks`` reserved at once; parts_imported counts the parts taken.
        self.kv_blocks = total_blocks if kv_blocks is None else kv_blocks
        self.reserved: dict[bytes, list] = {}
        self.parts_imported = 0

    # -- the Engine interface -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="stub-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)

    def submit(self, req: EngineRequest) -> None:
        with self._lock:
            if self._pending + len(self._waiting) >= self.max_queue:
                raise EngineRefused("queue full", 0.1)
            self._pending += 1
        self._inbox.put(("submit", _Seq(req, list(req.prompt_tokens), len(req.prompt_tokens))))
        self._wake.set()

    def import_kv(self, snapshot: KVSnapshot, on_event, priority: int = 0) -> None:
        if not _kv_matches(snapshot):
            raise EngineRefused("KV snapshot does not match its tokens", 0.0)
        with self._lock:
            self._pending += 1
        req = EngineRequest(snapshot.request_id, list(snapshot.tokens), snapshot.sampling, on_event, priority)
        s = _Seq(req, list(snapshot.tokens), snapshot.prompt_len, generated=snapshot.num_generated)
        self._inbox.put(("import", s))
        self._wake.set()

    def reserve_kv(self, request_id: bytes, num_tokens: int, on_event, priority: int = 0) -> None:
        self._inbox.put(("reserve", (request_id, math.ceil(num_tokens / self.BLOCK), on_event)))
        self._wake.set()

    def import_part(self, part: KVSnapshot) -> None:
        if not _kv_matches(part):
            raise ValueError("KV part does not match its tokens")
        self._inbox.put(("part", part))
        self._wake.set()

    def abort(self, request_id: bytes) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def can_accept(self, n_tokens: int) -> bool:
        with self._lock:
            return self._pending + len(self._waiting) + len(self._running) < self.parallel + self.max_queue

    def stats(self) -> EngineStats:
        with self._lock:
            used = sum(math.ceil(len(s.tokens) / self.BLOCK) for s in self._running.values())
            used += sum(r[0] for r in self.reserved.values())
            return EngineStats(running=len(self._running), waiting=len(self._waiting) + self._pending,
                               free_blocks=self.total_blocks - used, total_blocks=self.total_blocks,
                               block_size=self.BLOCK, steps=self._steps)

    # -- the step loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._running and not self._waiting:
                self._wake.wait(0.05)
            self._wake.clear()
            self._admit()
            if self._running:
                if self.step_s:
                    time.sleep(self.step_s)  # before the step: the first token takes a step too
                self._step()

    def _admit(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if kind in ("reserve", "part") or (kind == "import" and item.req.request_id in self.reserved):
                    self._streamed_import(kind, item)
                    continue
                if kind == "abort":
                    r = self.reserved.pop(item, None)
                    if r is not None:
                        r[2](TokenEvent(item, [], finish_reason="abort"))
                    s = self._running.pop(item, None)
                    for w in [w for w in self._waiting if w.req.request_id == item]:
                        self._waiting.remove(w)
                        s = w
                    if s is not None:
                        s.req.on_event(TokenEvent(item, [], finish_reason="abort", usage=self._usage(s)))
                    continue
                self._pending -= 1
                self._waiting.append(item)
        with self._lock:
            while self._waiting and len(self._running) < self.parallel:
                s = self._waiting.pop(0)
                self._running[s.req.request_id] = s

    def _step(self) -> None:
        self._steps += 1
        done = []
        for rid, s in list(self._running.items()):
            if self.prefill_chunk and s.generated == 0 and s.computed + self.prefill_chunk < s.prompt_len:
                s.computed += self.prefill_chunk  # a chunk of a long prompt: no token yet
                full = s.computed // self.BLOCK
                if s.req.stream_kv and full > s.exported:
                    kv = _encode_kv(s.tokens[: s.prompt_len], self.BLOCK)[s.exported:full]
                    part = KVSnapshot(rid, self.model_id, self.BLOCK, 1, 1, self.BLOCK, "float32", list(s.tokens),
                                      s.prompt_len, s.prompt_len, [kv], [kv.copy()], s.req.sampling, first_block=s.exported)
                    s.exported = full
                    s.req.on_event(TokenEvent(rid, [], kv_part=part))
                continue
            if s.h is None:
                s.h = _hash(s.tokens)
            tok = s.h % VOCAB
            s.tokens.append(tok)
            s.h = _fold(s.h, tok)
            s.generated += 1
            sp = s.req.sampling
            finish = None
            if tok in sp.stop_token_ids and not sp.ignore_eos:
                finish = "stop"
            elif s.generated >= sp.max_tokens:
                finish = "length"
            if s.req.export_after_prefill and finish is None:
                kv = _encode_kv(s.tokens[:-1], self.BLOCK)[s.exported:]
                snap = KVSnapshot(rid, self.model_id, self.BLOCK, 1, 1, self.BLOCK, "float32",
                                  list(s.tokens), len(s.tokens) - 1, s.prompt_len, [kv], [kv.copy()],
                                  sp, num_generated=s.generated, first_block=s.exported)
                # As the engine does: the first token, then the KV in a final event without tokens.
                s.req.on_event(TokenEvent(rid, [tok], usage=self._usage(s)))
                s.req.on_event(TokenEvent(rid, [], usage=self._usage(s), snapshot=snap))
                done.append(rid)
                continue
            usage = self._usage(s) if finish else None
            s.req.on_event(TokenEvent(rid, [tok], finish_reason=finish, usage=usage))
            if finish:
                done.append(rid)
        with self._lock:
            for rid in done:
                self._running.pop(rid, None)

    def _streamed_import(self, kind: str, item) -> None:
        """Reservations, parts and final parts of streamed imports (under the lock)."""
        if kind == "reserve":
            rid, n, on_event = item
            if rid in self.reserved or sum(r[0] for r in self.reserved.values()) + n > self.kv_blocks:
                on_event(TokenEvent(rid, [], error="KV cache full: no room to reserve", kv_reserved=False))
            else:
                self.reserved[rid] = [n, 0, on_event]
                on_event(TokenEvent(rid, [], kv_reserved=True))
            return
        rid = item.request_id if kind == "part" else item.req.request_id
        r = self.reserved.get(rid)
        if kind == "part":
            if r is None:
                return  # refused or aborted: answered
            n = item.keys[0].shape[0]
            if item.first_block != r[1] or r[1] + n > r[0]:
                del self.reserved[rid]
                r[2](TokenEvent(rid, [], error="KV part out of order", kv_reserved=False))
            else:
                r[1] += n
                self.parts_imported += 1
            return
        self._pending -= 1  # the final import of a reserved one: its blocks pass to the request
        del self.reserved[rid]
        self._waiting.append(item)

    @staticmethod
    def _usage(s: _Seq) -> Usage:
        return Usage(prompt_tokens=s.prompt_len, completion_tokens=s.generated)


def _kv_matches(snap: KVSnapshot) -> bool:
    """Whether a snapshot (or a part of one, from ``first_block``) holds its tokens' KV."""
    expected = _encode_kv(snap.tokens[: snap.num_computed], snap.block_size)
    got = np.asarray(snap.keys[0])
    return np.array_equal(got, expected[snap.first_block : snap.first_block + len(got)]) and (
        snap.first_block + len(got) == len(expected) or len(snap.tokens) == snap.num_computed)


def _encode_kv(tokens: list[int], block: int) -> np.ndarray:
    n = max(1, math.ceil(len(tokens) / block))
    arr = np.zeros((n, 1, block, block), dtype=np.float32)
    flat = np.zeros(n * block, dtype=np.float32)
    flat[: len(tokens)] = tokens
    arr[:, 0, :, 0] = flat.reshape(n, block)
    return arr


def main(argv: list[str] | None = None) -> int:
    """``tandem`` with ``worker``'s engine replaced by a :class:`StubEngine` that sleeps
    ``--stub-step-ms`` a step (taken out of the arguments; the rest are the command's)."""
    import argparse
    import sys

    from tandem import cli
    from tandem.commands import worker

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--stub-step-ms", type=float, default=0.0)
    p.add_argument("--stub-prefill-chunk", type=int, default=0, help="prompt tokens prefilled a step (0: a whole prompt)")
    ours, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)

    def build_engine(cfg, args, log):
        eng = StubEngine(parallel=cfg.engine.parallel, max_queue=cfg.engine.max_queue_depth,
                         step_s=ours.stub_step_ms / 1000, prefill_chunk=ours.stub_prefill_chunk)
        return eng, eng.model_id

    worker.build_engine = build_engine
    return cli.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
