"""KV transfer throughput over loopback ZeroMQ, sealed with the cluster handshake + AES-256-GCM.

For each cache shape and prompt length it moves one KVSnapshot from this process (the
prefill side: a prefill worker's HandoffSender) to a receiver process (the decode side: a
decode worker's KVIngest, acknowledging as workers/transfers.py does) and reports GB/s of KV
moved (the snapshot's bytes / time from first byte encoded to the decode side's ack)
for every strategy x {raw, lz4, int8, int4}, next to two ceilings measured in the same
run: raw AES-256-GCM (sealing the same frames in one thread, no network) and raw
ZeroMQ (the same frames, zero-copy, unencrypted, same two processes, one warmed-up
connection, as sealed keeps its own). Target: sealed Full >= 60% of min(raw AES-GCM, raw
ZeroMQ). The headline is paired: per cache, alternating rounds time one transfer of each,
and the median over rounds of sealed / min(both ceilings of that round) is reported, with
the best-of ratios beside it.

A second table measures small control messages (a Dispatch of a 200-token prompt) per
second over plain ZeroMQ, ZeroMQ CURVE and the AES-GCM sealed channel: the measurement
behind using CURVE for control and token sockets (docs/protocol.md).

Data is random normal (with a few large channels in K, as real K caches have); such
data is nearly incompressible for LZ4, which is what this shows. Real caches compress
somewhat better, mostly in padding and zero blocks.

    .venv/bin/python bench/kv_transfer.py            # full run, writes docs/benchmarks/kv_transfer.{md,json}
    .venv/bin/python bench/kv_transfer.py --quick    # small shapes only, no files
    .venv/bin/python bench/kv_transfer.py --baseline REF  # also this tree vs commit REF, side by side
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if len(sys.argv) > 2 and sys.argv[1] == "--ab-child":  # run against another tandem tree (a baseline)
    sys.path.insert(0, sys.argv[2])

import tandem  # noqa: E402,F401  (BLAS preload before anything imports mlx)
import numpy as np  # noqa: E402
import zmq  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from tandem._malloc import retain_freed_memory  # noqa: E402
from tandem.kvtypes import KVSnapshot, SamplingParams  # noqa: E402
from tandem.wire import codec  # noqa: E402
from tandem.wire.handshake import Initiator, Responder  # noqa: E402
from tandem.wire.kvchannel import SendArena  # noqa: E402
from tandem.wire.messages import Abort, Dispatch, KVAck  # noqa: E402
from tandem.wire.settings import TransferSettings  # noqa: E402
from tandem.wire.sockets import make_socket  # noqa: E402
from tandem.workers import handoff  # noqa: E402
from tandem.workers.handoff import KVIngest  # noqa: E402
from tandem.workers.sender import HandoffSender  # noqa: E402

SECRET = b"bench-cluster-secret-0123456789ab"  # the receiver is a spawned process: must be a constant
SHAPES = {
    # SmolLM2-135M as the CPU engine keeps it (dense fp32 weights -> fp32 KV).
    "smollm2-135m": dict(layers=30, heads=3, head_dim=64, dtype="float32"),
    # A Llama-3-8B-shaped cache (GQA, 8 KV heads of 128) in fp16.
    "8b-shaped": dict(layers=32, heads=8, head_dim=128, dtype="float16"),
}
OPTIONS = {"raw": ("none", "none"), "lz4": ("lz4", "none"), "int8": ("none", "int8"), "int4": ("none", "int4")}
STRATEGIES = ("full", "streamed", "layer_parallel")
BLOCK = 16
DONE_ID = b"\xff" * 16
TARGET = 0.60  # sealed full/raw over min(raw AES-GCM, raw ZeroMQ)
ROUNDS_SMALL, ROUNDS_LARGE = 61, 21  # headline rounds per cache (caches over 256 MB: 21)


def make_snapshot(tokens: int, layers: int, heads: int, head_dim: int, dtype: str, seed: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    nb = -(-tokens // BLOCK)
    shape = (nb, heads, BLOCK, head_dim)
    channel_scale = np.ones(head_dim, np.float32)
    channel_scale[rng.choice(head_dim, 4, replace=False)] = 8.0  # K outlier channels
    keys, values = [], []
    for _ in range(layers):
        keys.append((rng.standard_normal(shape, np.float32) * channel_scale).astype(dtype))
        values.append(rng.standard_normal(shape, np.float32).astype(dtype))
    toks = [int(t) for t in rng.integers(0, 49152, tokens + 1)]
    return KVSnapshot(os.urandom(16), "bench", BLOCK, layers, heads, head_dim, dtype, toks, tokens, tokens,
                      keys, values, SamplingParams(), 1, 0)


# ---- the receiver process (decode side) ---------------------------------------------------


def ingest_kv(ingest: KVIngest, frames) -> None:
    """One message into the decode worker's ingest, answered as workers/transfers.py
    answers it: a new transfer's header is accepted, a completed transfer acknowledged."""
    for peer, _, header, snap in ingest.on_message(frames, at_capacity=lambda: False):
        ingest.reply(peer, KVAck(header.request_id, complete=snap is not None))


class SealedControl:
    """The receiving end of the sealed control-message measurement: the cluster handshake,
    then AES-GCM records on a plain ROUTER (the channel KV travels on, carrying control
    messages instead)."""

    def __init__(self, ctx):
        self.sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", hwm=handoff.KV_HWM)
        self._responders: dict = {}
        self._channels: dict = {}

    def handle(self, frames) -> None:
        peer, body = codec.split_route(frames)
        channel = self._channels.get(peer)
        if channel is None:
            responder = self._responders.pop(peer, None)
            if responder is None:
                responder = self._responders[peer] = Responder(SECRET, "control-bench")
                codec.send(self.sock, [peer, *responder.on_hello(body)])
            else:
                self._channels[peer] = responder.on_proof(body)
            return
        opened = channel.open(body)
        if opened is not None and getattr(codec.decode(opened), "request_id", None) == DONE_ID:
            codec.send(self.sock, [peer, *channel.seal(codec.encode(Abort(DONE_ID)))])


def receiver_main(conn) -> None:
    retain_freed_memory()  # as a decode worker does: no page faults per transfer
    ctx = zmq.Context()
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", secret=SECRET, node_id="decode-bench", timeout_s=300)
    raw = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", hwm=64)
    curve = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", security=SECRET)
    sealed = SealedControl(ctx)
    eps = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (ingest.sock, raw, curve, sealed.sock)]
    conn.send(eps)
    poller = zmq.Poller()
    for s in (ingest.sock, raw, curve, sealed.sock):
        poller.register(s, zmq.POLLIN)
    running = True
    while running:
        for sock, _ in poller.poll(1000):
            if sock is ingest.sock:
                while True:  # drain: a KV message is many records back to back
                    try:  # no name keeps the received record: its buffer is freed once opened
                        ingest_kv(ingest, codec.recv_frames(sock, copy=False, flags=zmq.NOBLOCK, max_frames=4096))
                    except zmq.Again:
                        break
            elif sock is sealed.sock:
                sealed.handle(codec.recv_frames(sock, copy=False))
            else:
                frames = sock.recv_multipart(copy=False)
                body = frames[1:]
                if bytes(body[0]) == b"stop":
                    running = False
                elif bytes(body[0]) == b"bulk":
                    sock.send_multipart([frames[0], b"ok"])
                elif bytes(body[0]) == b"cpu":
                    sock.send_multipart([frames[0], repr(_process_cpu()).encode()])
                else:
                    msg = codec.decode(body)
                    if getattr(msg, "request_id", None) == DONE_ID:
                        sock.send_multipart([frames[0], b"ok"])
    ingest.close()
    ctx.destroy(linger=0)


# ---- measurements (prefill side) ----------------------------------------------------------


def start_receiver():
    """The decode side in its own process; returns it and its (KV, raw ZeroMQ) endpoints."""
    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=receiver_main, args=(child,), daemon=True)
    proc.start()
    return proc, parent.recv()


def stop_receiver(ctx, proc, eps) -> None:
    stop = make_socket(ctx, zmq.DEALER, connect=eps[1])
    stop.send(b"stop")
    proc.join(10)
    stop.close(0)


def layer_frames(snap: KVSnapshot) -> list:
    return [memoryview(a).cast("B") for pair in zip(snap.keys, snap.values) for a in pair]


def cpu_pair(ctx, endpoint: str) -> tuple[float, float]:
    """(this process's CPU seconds, the receiver process's CPU seconds), both including
    their libzmq I/O threads."""
    sock = make_socket(ctx, zmq.DEALER, connect=endpoint)
    sock.send(b"cpu")
    theirs = float(sock.recv())
    sock.close(0)
    return _process_cpu(), theirs


def raw_aes_gbps(snap: KVSnapshot, repeats: int) -> float:
    aead = AESGCM(os.urandom(32))
    frames = layer_frames(snap)
    best = 0.0
    for r in range(repeats):
        t0 = time.perf_counter()
        for i, f in enumerate(frames):
            aead.encrypt((r * 100000 + i).to_bytes(12, "big"), f, b"head")
        best = max(best, snap.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


class RawZmq:
    """The raw ZeroMQ ceiling: the same frames, zero-copy, unencrypted, to the same receiver
    process, over ONE connection kept for every timed transfer of a cache and warmed up with
    one untimed full-size transfer, as the sealed measurements keep and warm theirs (a fresh
    connection per timed run, as this bench had until 2026-11-30 17:41 UTC, starts with
    small kernel socket buffers; it was slower for the 8B-shaped 1k cache in every run, by
    7-12% in medians, mixed for the others: docs/benchmarks/kv_transfer.md). Socket options
    are the KV sockets' (handoff.SEND_HWM, the factory's defaults)."""

    def __init__(self, ctx, endpoint: str, snap: KVSnapshot):
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, hwm=handoff.SEND_HWM)
        self.frames = [b"bulk", *layer_frames(snap)]
        self.nbytes = snap.nbytes
        self.sock.send_multipart([b"bulk", b"warm-up"])  # connect outside the timed runs
        self.sock.recv()
        self.gbps()  # the untimed full-size warm-up transfer

    def gbps(self) -> float:
        t0 = time.perf_counter()
        codec.send(self.sock, self.frames)
        self.sock.recv()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.sock.close(0)


def fresh_raw_zmq_gbps(ctx, endpoint: str, snap: KVSnapshot) -> float:
    """One timed raw ZeroMQ transfer on a fresh connection (connected with a tiny message
    first): the ceiling as this bench measured it until 2026-11-30 17:41 UTC, kept beside
    the fair one so the two statistics can be compared in one run."""
    sock = make_socket(ctx, zmq.DEALER, connect=endpoint, hwm=handoff.SEND_HWM)
    sock.send_multipart([b"bulk", b"warm-up"])
    sock.recv()
    t0 = time.perf_counter()
    codec.send(sock, [b"bulk", *layer_frames(snap)])
    sock.recv()
    gbps = snap.nbytes / (time.perf_counter() - t0) / 1e9
    sock.close(0)
    return gbps


def raw_zmq_gbps(ctx, endpoint: str, snap: KVSnapshot, repeats: int) -> float:
    """Best of ``repeats`` timed transfers on one warmed-up connection (:class:`RawZmq`)."""
    raw = RawZmq(ctx, endpoint, snap)
    best = max(raw.gbps() for _ in range(repeats))
    raw.close()
    return best


class SealedSender:
    """A prefill worker's sending path (workers.sender.HandoffSender over workers.handoff.KVPeer,
    never blocking), driven here until the decode side acknowledges each transfer. Keeps its
    connections (and their warmed send arena) across transfers, as a worker does."""

    def __init__(self, ctx, endpoint: str, transfer: TransferSettings):
        self.poller = zmq.Poller()
        self.sender = HandoffSender(ctx, secret=SECRET, node_id="prefill-bench", transfer=transfer, timeout_s=300,
                                    poller=self.poller)
        self.endpoint = endpoint
        self.attempt = 0

    def send(self, snap: KVSnapshot) -> tuple[float, int]:
        """One transfer: (GB/s of KV from the first byte encoded to the ack, payload bytes sent)."""
        self.attempt += 1
        t0 = time.perf_counter()
        self.sender.start(snap, attempt=self.attempt, decode_node="decode-bench", address=self.endpoint,
                          stream_seq=0, priority=0)
        outgoing = [p.pending[snap.request_id] for p in self.sender.peers.values() if snap.request_id in p.pending]
        while True:
            for sock, _ in self.poller.poll(1000):
                for rid, failure in self.sender.on_message(self.sender.peer_for(sock), sock.recv_multipart(copy=False)):
                    if failure is not None:
                        raise RuntimeError(failure)
                    if rid == snap.request_id:
                        return snap.nbytes / (time.perf_counter() - t0) / 1e9, sum(o.wire_bytes for o in outgoing)
            for _, failure in self.sender.expired(time.monotonic()):
                raise RuntimeError(failure)

    def gbps(self, snap: KVSnapshot) -> float:
        return self.send(snap)[0]

    def close(self) -> None:
        self.sender.close()


def sealed_gbps(ctx, endpoint: str, snap: KVSnapshot, strategy: str, option: str, repeats: int) -> tuple[float, float]:
    compression, quantization = OPTIONS[option]
    tx = SealedSender(ctx, endpoint, TransferSettings(strategy=strategy, compression=compression, quantization=quantization,
                                                      blocks_per_chunk=256 // BLOCK * 4, connections=2))  # streamed: 1024-token chunks
    tx.send(snap)  # warm-up: connections, send arena first touch
    best, wire_ratio = 0.0, 1.0
    for _ in range(repeats):
        gbps, wire_bytes = tx.send(snap)
        best = max(best, gbps)
        wire_ratio = wire_bytes / snap.nbytes
    tx.close()
    return best, wire_ratio


def _machine_busy(receiver_pid: int) -> tuple[float, float]:
    """(CPU seconds the whole machine spent busy outside this benchmark's two processes,
    wall seconds) so far: what other work ran during the measurement (/proc/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    ours = 0.0
    for pid in (os.getpid(), receiver_pid):
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ours += (int(stat[11]) + int(stat[12])) / tick
    return busy - ours, time.monotonic()


def _quantile(ordered: list, q: float) -> float:
    """Linear-interpolated quantile of an ascending list (q=0.5: the median)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def control_rates(ctx, eps: list[str], n: int) -> dict[str, dict[str, float]]:
    """Per transport: msgs/s, and CPU microseconds per message spent by the sending
    process, in its Python thread (the broker's dispatch loop pays this) and in total
    (including libzmq's I/O thread, where CURVE encrypts). CPU time is robust to other
    load on the machine; wall-clock rate is not."""
    msg = codec.encode(Dispatch(b"r" * 16, "prefill", list(range(200)), SamplingParams(), 0, "m", "d", "tcp://127.0.0.1:1"))
    done = codec.encode(Abort(DONE_ID))
    out = {}

    def measure(send, finish):
        t0, c0, p0 = time.perf_counter(), time.thread_time(), _process_cpu()
        for _ in range(n):
            send()
        finish()
        wall, thread, proc = time.perf_counter() - t0, time.thread_time() - c0, _process_cpu() - p0
        return {"msgs_per_s": n / wall, "python_us_per_msg": thread / n * 1e6, "process_us_per_msg": proc / n * 1e6}

    for name, endpoint, security in (("plain ZeroMQ", eps[1], None), ("ZeroMQ CURVE", eps[2], SECRET)):
        sock = make_socket(ctx, zmq.DEALER, connect=endpoint, security=security)
        sock.send_multipart(done)
        sock.recv()  # connected and handshaken
        out[name] = measure(lambda: sock.send_multipart(msg), lambda: (sock.send_multipart(done), sock.recv()))
        sock.close(0)
    sock = make_socket(ctx, zmq.DEALER, connect=eps[3], hwm=handoff.SEND_HWM)
    initiator = Initiator(SECRET, "control-bench")
    codec.send(sock, initiator.hello())
    proof, channel, _ = initiator.on_challenge(codec.recv_frames(sock))
    codec.send(sock, proof)

    def finish():
        codec.send(sock, channel.seal(done))
        channel.open(codec.recv_frames(sock))
    finish()  # handshaken and answering
    out["AES-GCM sealed"] = measure(lambda: codec.send(sock, channel.seal(msg)), finish)
    sock.close(0)
    return out


def ab_child(shape: str, tokens: int, rounds: int) -> None:
    """One side of --baseline: sealed full/raw and raw ZeroMQ in alternating rounds with
    whichever ``tandem`` is first on sys.path (and its own receiver process); prints JSON."""
    retain_freed_memory()
    proc, eps = start_receiver()
    ctx = zmq.Context()
    snap = make_snapshot(tokens, **SHAPES[shape])
    tx = SealedSender(ctx, eps[0], TransferSettings(strategy="full"))
    tx.send(snap)  # warm-up
    raw = RawZmq(ctx, eps[1], snap)
    out = {"tandem": str(Path(tandem.__file__).parent), "zmq": [], "sealed": [], "cpu_zmq": [], "cpu_sealed": []}
    for _ in range(rounds):
        c0 = cpu_pair(ctx, eps[1])
        out["zmq"].append(raw.gbps())
        c1 = cpu_pair(ctx, eps[1])
        out["sealed"].append(tx.gbps(snap))
        c2 = cpu_pair(ctx, eps[1])
        out["cpu_zmq"].append((c1[0] - c0[0] + c1[1] - c0[1]) / (snap.nbytes / 1e9))
        out["cpu_sealed"].append((c2[0] - c1[0] + c2[1] - c1[1]) / (snap.nbytes / 1e9))
    tx.close()
    raw.close()
    stop_receiver(ctx, proc, eps)
    ctx.destroy(linger=0)
    print(json.dumps(out))


def compare_baseline(ref: str, cases: list, rounds: int) -> dict:
    """Sealed full/raw of this tree and of git ``ref``, each against raw ZeroMQ in its own
    runs, in alternating child processes so both see the same machine load."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import baseline_tree

    trees = {"this tree": str(Path(__file__).resolve().parents[1]), f"baseline {ref}": str(baseline_tree(ref))}
    runs: dict = {}
    for shape, tokens in cases:
        for r in range(rounds):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for label, tree in order:
                cmd = [sys.executable, __file__, "--ab-child", tree, shape, str(tokens), "3"]
                got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
                assert got["tandem"].startswith(tree), (got["tandem"], tree)  # the tree asked for, not the installed one
                runs.setdefault(f"{shape} {tokens}", {}).setdefault(label, []).append(got)
    summary = {}
    for case, by_tree in runs.items():
        for label, rs in by_tree.items():
            ratios = sorted(s / z for r in rs for s, z in zip(r["sealed"], r["zmq"]))
            cpu = sorted(s / z for r in rs for s, z in zip(r["cpu_sealed"], r["cpu_zmq"]))
            summary.setdefault(case, {})[label] = {"ratio_median": ratios[len(ratios) // 2], "cpu_ratio_median": cpu[len(cpu) // 2],
                                                   "sealed_gbps_best": max(x for r in rs for x in r["sealed"]), "runs": len(ratios)}
            print(f"{case:26s} {label:22s} sealed/raw ZeroMQ median {summary[case][label]['ratio_median']:.0%}, "
                  f"CPU sealed/raw {summary[case][label]['cpu_ratio_median']:.2f}x", flush=True)
    return {"ref": ref, "rounds": rounds, "cases": summary}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--ab-child":
        ab_child(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k-token prompts only, one repeat, no files written")
    ap.add_argument("--out", help="path prefix for .md and .json (default docs/benchmarks/kv_transfer; "
                    "a run with --caches or --headline-only writes files only when given one)")
    ap.add_argument("--baseline", metavar="GIT_REF", help="also compare sealed full/raw (1k-token caches) with this commit's, alternating")
    ap.add_argument("--caches", metavar="SHAPE:TOKENS,...", help=f"only these caches (shapes: {', '.join(SHAPES)}), e.g. smollm2-135m:1024")
    ap.add_argument("--headline-only", action="store_true", help="skip control messages and the strategy x option table: "
                    "only the alternating rounds of raw ZeroMQ, raw AES-GCM and sealed full/raw")
    ap.add_argument("--rounds", type=int, help=f"alternating rounds per cache (default {ROUNDS_SMALL}, or {ROUNDS_LARGE} over 256 MB)")
    args = ap.parse_args()
    cases = [(s, t) for s in SHAPES for t in ((1024,) if args.quick else (1024, 8192))]
    if args.caches:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.caches.split(",")]
        if unknown := [s for s, _ in cases if s not in SHAPES]:
            raise SystemExit(f"unknown cache shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    out = args.out or (None if args.quick or args.caches or args.headline_only else "docs/benchmarks/kv_transfer")

    retain_freed_memory()  # as a prefill worker should: quantized chunks are fresh buffers
    proc, eps = start_receiver()
    ctx = zmq.Context()
    results = []
    quiet0 = _machine_busy(proc.pid)
    try:
        # Control messages first, before the multi-GB KV runs churn memory.
        control: dict[str, dict[str, float]] = {}
        for _ in range(0 if args.headline_only else 1 if args.quick else 5):  # alternating rounds, best of each
            for name, m in control_rates(ctx, eps, 2000 if args.quick else 20000).items():
                best = control.setdefault(name, {"msgs_per_s": 0.0, "python_us_per_msg": 1e9, "process_us_per_msg": 1e9})
                best["msgs_per_s"] = max(best["msgs_per_s"], m["msgs_per_s"])
                best["python_us_per_msg"] = min(best["python_us_per_msg"], m["python_us_per_msg"])
                best["process_us_per_msg"] = min(best["process_us_per_msg"], m["process_us_per_msg"])
        for name, m in control.items():
            print(f"control {name:15s} {m['msgs_per_s']:8,.0f} msgs/s, sender CPU {m['python_us_per_msg']:5.1f} us/msg in Python, "
                  f"{m['process_us_per_msg']:5.1f} us/msg in total", flush=True)
        for shape, tokens in cases:
            snap = make_snapshot(tokens, **SHAPES[shape])
            # Best of N; the first run also warms up (arena first touch, connections).
            repeats = 1 if args.quick else (2 if snap.nbytes > (256 << 20) else 3)
            aes = raw_aes_gbps(snap, repeats)
            zq = raw_zmq_gbps(ctx, eps[1], snap, repeats)
            entry = {"shape": shape, "tokens": tokens, "kv_bytes": snap.nbytes, "dtype": snap.dtype,
                     "raw_aes_gcm_gbps": aes, "raw_zmq_gbps": zq, "sealed": {}}
            print(f"\n{shape} {tokens} tokens: {snap.nbytes / 1e6:.0f} MB of {snap.dtype} KV; "
                  f"raw AES-GCM {aes:.2f} GB/s, raw ZeroMQ {zq:.2f} GB/s", flush=True)
            for strategy in () if args.headline_only else STRATEGIES:
                for option in OPTIONS:
                    gbps, ratio = sealed_gbps(ctx, eps[0], snap, strategy, option, repeats)
                    entry["sealed"][f"{strategy}/{option}"] = {"gbps": gbps, "wire_ratio": ratio}
                    print(f"  {strategy:15s} {option:5s} {gbps:6.2f} GB/s  (wire {ratio:.2f}x)", flush=True)
            # The headline: rounds of raw ZeroMQ, raw AES-GCM and sealed full/raw, in
            # alternating order (forward in even rounds, backward in odd ones, so neither side
            # always runs first after the previous cache's churn); each round's ratio is sealed
            # over the lower of that round's two ceilings, and the headline is their median.
            rounds = args.rounds or (1 if args.quick else (ROUNDS_LARGE if snap.nbytes > (256 << 20) else ROUNDS_SMALL))
            entry["sealed"].setdefault("full/raw", {"gbps": 0.0, "wire_ratio": 1.0})
            tx = SealedSender(ctx, eps[0], TransferSettings(strategy="full"))
            tx.send(snap)  # warm-up
            raw = RawZmq(ctx, eps[1], snap)  # warmed up the same way
            cpu = {"raw ZeroMQ": [], "sealed full/raw": []}  # (sender, receiver) CPU seconds per run
            pairs = []  # (sealed, raw ZeroMQ, raw AES-GCM) GB/s of each round
            fresh = []  # raw ZeroMQ on a fresh connection, each round (the old statistic's ceiling)

            def timed_cpu(name, run):
                c0 = cpu_pair(ctx, eps[1])
                gbps = run()
                c1 = cpu_pair(ctx, eps[1])
                cpu[name].append((c1[0] - c0[0], c1[1] - c0[1]))
                return gbps

            steps = [
                lambda got: got.__setitem__(3, fresh_raw_zmq_gbps(ctx, eps[1], snap)),
                lambda got: got.__setitem__(1, timed_cpu("raw ZeroMQ", raw.gbps)),
                lambda got: got.__setitem__(2, raw_aes_gbps(snap, 1)),
                lambda got: got.__setitem__(0, timed_cpu("sealed full/raw", lambda: tx.gbps(snap))),
            ]
            for r in range(rounds):
                got = [0.0, 0.0, 0.0, 0.0]
                for step in steps if r % 2 == 0 else steps[::-1]:
                    step(got)
                pairs.append(got[:3])
                fresh.append(got[3])
            tx.close()
            raw.close()
            zq, aes = max(zq, max(b for _, b, _ in pairs)), max(aes, max(c for *_, c in pairs))
            cell = entry["sealed"]["full/raw"]
            cell["gbps"] = max(cell["gbps"], max(a for a, _, _ in pairs))
            # CPU per GB moved, best (lowest) run: unlike GB/s, this does not depend on other load.
            entry["cpu_s_per_gb"] = {
                k: {"sender": min(a for a, _ in v) / (snap.nbytes / 1e9), "receiver": min(b for _, b in v) / (snap.nbytes / 1e9)}
                for k, v in cpu.items()
            }
            entry["raw_aes_gcm_gbps"], entry["raw_zmq_gbps"] = aes, zq
            entry["rounds"] = [{"sealed_full_gbps": a, "raw_zmq_gbps": b, "raw_aes_gcm_gbps": c, "raw_zmq_fresh_connection_gbps": f}
                               for (a, b, c), f in zip(pairs, fresh)]
            # The statistic this bench reported until 2026-11-30 17:41 UTC: the same median, but
            # over raw ZeroMQ alone, measured on a fresh connection per round.
            entry["round_ratio_median_fresh_zmq"] = _quantile(sorted(a / f for (a, _, _), f in zip(pairs, fresh)), 0.5)
            ratios = sorted(a / min(b, c) for a, b, c in pairs)  # each round against its own ceiling
            entry["round_ratio_median"] = _quantile(ratios, 0.5)
            entry["round_ratio_quartiles"] = [_quantile(ratios, 0.25), _quantile(ratios, 0.75)]
            entry["rounds_meeting_target"] = sum(r >= TARGET for r in ratios)
            entry["round_ceiling_is_zmq"] = sum(b <= c for _, b, c in pairs)
            # Best sealed / best ceiling of the same rounds only: both from one stretch of
            # time, so a slow (or fast) spell between the strategy table and the rounds cannot
            # land on one side of the ratio alone.
            entry["round_best_ratio"] = max(a for a, _, _ in pairs) / min(max(b for _, b, _ in pairs), max(c for *_, c in pairs))
            ceiling = min(aes, zq)
            for cell in entry["sealed"].values():
                cell["vs_ceiling"] = cell["gbps"] / ceiling
            full = entry["sealed"]["full/raw"]["gbps"]
            q1, q3 = entry["round_ratio_quartiles"]
            print(f"  {rounds} alternating rounds: median of per-round sealed / min(raw AES-GCM, raw ZeroMQ) "
                  f"{entry['round_ratio_median']:.0%} (quartiles {q1:.0%}-{q3:.0%}, {entry['rounds_meeting_target']} of {rounds} "
                  f"rounds >= {TARGET:.0%}); best-of: sealed {full:.2f} / ceiling {ceiling:.2f} GB/s = {full / ceiling:.0%}, "
                  f"same rounds alone {entry['round_best_ratio']:.0%}; old statistic (over fresh-connection raw ZeroMQ) "
                  f"{entry['round_ratio_median_fresh_zmq']:.0%}", flush=True)
            for k, v in entry["cpu_s_per_gb"].items():
                print(f"  CPU per GB, {k}: sender {v['sender']:.3f} s, receiver {v['receiver']:.3f} s", flush=True)
            results.append(entry)
            del snap
        others_cpu_s, wall_s = (b - a for a, b in zip(quiet0, _machine_busy(proc.pid)))
        control["_others"] = {"cpu_s": others_cpu_s, "wall_s": wall_s}
        print(f"\nother processes: {others_cpu_s:.1f} CPU-s in {wall_s:.0f} s ({others_cpu_s / wall_s / os.cpu_count():.0%} of the machine)")
    finally:
        stop_receiver(ctx, proc, eps)
        ctx.destroy(linger=0)
    baseline = compare_baseline(args.baseline, [c for c in cases if c[1] == 1024], 2 if args.quick else 6) if args.baseline else None
    if out:
        write_results(Path(out), results, control, baseline)
    return 0


def write_results(prefix: Path, results: list, control: dict, baseline: dict | None = None) -> None:
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "zmq": zmq.zmq_version(),
            "load_avg_1m_at_end": os.getloadavg()[0], "others": control.pop("_others", None)}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps({"meta": meta, "kv": results, "control": control, "baseline": baseline}, indent=2))
    lines = [
        "# KV transfer over loopback (generated by bench/kv_transfer.py)", "",
        f"{meta['date']}, {meta['cpus']} CPUs ({meta['machine']}), Python {meta['python']}, libzmq {meta['zmq']}, "
        + (f"other processes used {meta['others']['cpu_s']:.1f} CPU-seconds during the {meta['others']['wall_s']:.0f} s of "
           f"the measurement ({meta['others']['cpu_s'] / meta['others']['wall_s'] / meta['cpus']:.0%} of the machine; /proc/stat less "
           "this benchmark's two processes, so it includes kernel threads that do some of its network work). "
           if meta["others"] else "") +
        "GB/s = KV bytes of the snapshot / time from encoding start to the decode side's ack. "
        "Ceiling = min(raw AES-256-GCM, raw ZeroMQ); target: sealed full/raw >= 60% of it. "
        "Raw ZeroMQ moves the same frames zero-copy, unencrypted, between the same two processes, over one connection "
        "kept for all its timed runs of a cache and warmed up with one untimed full-size transfer, as every sealed "
        "measurement keeps and warms its connections (as a prefill worker does; the first transfer also touches the "
        "sender's send arena); both use the KV sockets' options. The development box has 2 cores (shared with other "
        "work, though the run holds an exclusive lock among this project's engineers); single runs vary by up to 2x. "
        "Random normal data: LZ4 barely compresses it (wire ratio ~1.0); "
        "real caches compress somewhat better, mostly in padding and zero blocks. "
        "The receiver is a separate process (the decode side); quantization and LZ4 run on one CPU core in numpy / python-lz4, "
        "so they pay off only on links slower than those rates.", "",
        "**Headline** (the paired statistic): per cache, rounds of raw ZeroMQ, raw AES-GCM and sealed full/raw, one "
        f"timed transfer each, in alternating order (forward, then backward); {ROUNDS_SMALL} rounds per cache "
        f"({ROUNDS_LARGE} for caches over 256 MB). Each round's ratio is its sealed rate over the lower of that same "
        "round's two ceilings; the headline is the median of those ratios, with their quartiles and how many rounds "
        "reached 60%. For transparency, the best-of columns: the best sealed full/raw of all its runs (3 in the "
        "strategy table, then one per round) over the lower of the two best ceilings of all runs, and the same ratio "
        "over the rounds alone. Best-of sets one lucky run of either side against the other's best. The last column is "
        "the statistic this bench reported until 2026-11-30 (kv_transfer.md of 17:41 UTC and earlier), measured in the same rounds: the median of sealed "
        "over raw ZeroMQ alone, timed on a fresh connection each round (a new TCP connection starts with small kernel "
        "buffers, which slowed raw ZeroMQ and flattered the ratio).", "",
        "| cache | **median of per-round sealed / ceiling** | quartiles | rounds >= 60% | target (median >= 60%) "
        "| best sealed | best ceiling | best / best | best / best, rounds alone | old: median over fresh-connection raw ZeroMQ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results:
        ceiling = min(e["raw_aes_gcm_gbps"], e["raw_zmq_gbps"])
        full = e["sealed"]["full/raw"]["gbps"]
        n = len(e["rounds"])
        q1, q3 = e["round_ratio_quartiles"]
        lines.append(f"| {e['shape']} {e['tokens']} tokens | **{e['round_ratio_median']:.0%}** of {n} | {q1:.0%}-{q3:.0%} | "
                     f"{e['rounds_meeting_target']} of {n} | {'met' if e['round_ratio_median'] >= TARGET else 'NOT met'} | "
                     f"{full:.2f} GB/s | {ceiling:.2f} GB/s | {full / ceiling:.0%} | {e['round_best_ratio']:.0%} | "
                     f"{e['round_ratio_median_fresh_zmq']:.0%} |")
    lower_aes = [f"{e['shape']} {e['tokens']}: {len(e['rounds']) - e['round_ceiling_is_zmq']} of {len(e['rounds'])}"
                 for e in results if e["round_ceiling_is_zmq"] < len(e["rounds"])]
    lines += ["", "Rounds whose lower ceiling was raw AES-GCM rather than raw ZeroMQ: " + (", ".join(lower_aes) or "none") + "."]
    lines += ["", "CPU seconds per GB of KV moved (lowest of the alternating rounds; sender and receiver processes, "
              "each including its libzmq I/O thread). Sealing adds one AES-GCM pass on each side to the copies loopback "
              "TCP already makes, so on a machine whose cores are busy the sealed rate is bounded by this ratio, not by "
              "the AES-GCM ceiling.", "",
              "| cache | raw ZeroMQ sender / receiver | sealed full sender / receiver | sealed / raw CPU |", "|---|---|---|---|"]
    for e in results:
        r, s_ = e["cpu_s_per_gb"]["raw ZeroMQ"], e["cpu_s_per_gb"]["sealed full/raw"]
        ratio = (s_["sender"] + s_["receiver"]) / max(1e-9, r["sender"] + r["receiver"])
        lines.append(f"| {e['shape']} {e['tokens']} tokens | {r['sender']:.3f} / {r['receiver']:.3f} | "
                     f"{s_['sender']:.3f} / {s_['receiver']:.3f} | {ratio:.2f}x |")
    arena = handoff.ARENA_BYTES
    record = SendArena(arena).group_bytes()
    lines += ["", "How the sealed path gets there (tandem/wire/sealed.py, kvchannel.py; the worker's sender, "
              "tandem/workers/handoff.py): a KV message is sealed as AES-GCM "
              f"records of about {record / (1 << 20):g} MiB (consecutive frames share one, and a frame over 1.5 records travels as "
              "pieces, each decrypted straight into one buffer for the frame; the first and last records of "
              "a message are smaller, since their cipher work overlaps nothing), one ZeroMQ message each, so the "
              "fixed costs per record - a ZeroMQ message, a zero-copy release through pyzmq's garbage-collector thread, "
              "wake-ups of the threads on each side - are paid once per few MB; the sender encrypts each record "
              f"with one call into a reused, already-faulted {arena >> 20} MiB arena (never waiting for it: a region "
              "libzmq still holds is passed over for a fresh buffer) that ZeroMQ sends zero-copy while the next "
              "record is sealed; the receiver decrypts each record as it arrives, while the rest is in flight, into a buffer of its own "
              "(so the received one is freed at once and libzmq's next records land in the same cache-hot memory) "
              "and hands the KV on as views of those buffers (cryptography releases the GIL inside these calls). "
              "What is left above raw ZeroMQ is mostly the AES-GCM pass itself on each side (~0.1 CPU-s/GB each here), "
              "and on two cores the four threads of a transfer (sealing, two libzmq I/O threads, opening) leave the "
              "machine ~15-20% idle while they wait on each other, where raw ZeroMQ has two.", "",
              "Reading these numbers: each GB/s in the tables below is the best of its runs, and a ratio of bests sets "
              "one lucky run against another (raw ZeroMQ of one cache moved from under 2 to over 5 GB/s between "
              "processes on this box, idle or not); the headline's per-round ratios compare transfers timed back to back "
              "and are the steadier comparison. CPU per GB does not depend on how busy the machine is as much, but it "
              "does on memory placement and cache contention from other work.", ""]
    for e in results:
        ceiling = min(e["raw_aes_gcm_gbps"], e["raw_zmq_gbps"])
        lines += [f"## {e['shape']}, {e['tokens']} tokens ({e['kv_bytes'] / 1e6:.0f} MB {e['dtype']})", "",
                  f"raw AES-GCM {e['raw_aes_gcm_gbps']:.2f} GB/s, raw ZeroMQ {e['raw_zmq_gbps']:.2f} GB/s, ceiling {ceiling:.2f} GB/s", "",
                  "| strategy | " + " | ".join(OPTIONS) + " |", "|---|" + "---|" * len(OPTIONS)]
        for strategy in STRATEGIES:
            cells = [e["sealed"].get(f"{strategy}/{o}") for o in OPTIONS]  # --headline-only: full/raw alone
            lines.append(f"| {strategy} | " + " | ".join(f"{c['gbps']:.2f} ({c['vs_ceiling']:.0%}, wire {c['wire_ratio']:.2f}x)"
                                                        if c else "-" for c in cells) + " |")
        lines.append("")
    if baseline:
        lines += [f"## This tree vs `{baseline['ref']}` (sealed full/raw, 1k-token caches)", "",
                  f"Each tree in its own processes (sender and receiver), {baseline['rounds']} alternating rounds of 3 "
                  "transfers, each sealed transfer right after a raw ZeroMQ one of the same cache; medians of the "
                  "per-pair ratios, so both trees see the same machine load.", "",
                  "| cache | tree | sealed / raw ZeroMQ (median) | CPU sealed / raw ZeroMQ (median) | best sealed GB/s |",
                  "|---|---|---|---|---|"]
        for case, by_tree in baseline["cases"].items():
            for label, v in by_tree.items():
                lines.append(f"| {case} tokens | {label} | {v['ratio_median']:.0%} | {v['cpu_ratio_median']:.2f}x | {v['sealed_gbps_best']:.2f} |")
        lines.append("")
    lines += ["## Control messages (a Dispatch with a 200-token prompt)", "",
              "Best of 5 alternating rounds of 20,000 messages. CPU time is the sending process's "
              "(its Python thread alone, and in total with libzmq's I/O thread), measured with "
              "thread_time/getrusage: unlike msgs/s it does not depend on the other load on the machine.", "",
              "| transport | msgs/s | sender CPU in Python (us/msg) | sender CPU total (us/msg) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['msgs_per_s']:,.0f} | {v['python_us_per_msg']:.1f} | {v['process_us_per_msg']:.1f} |" for k, v in control.items()]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {prefix}.md and {prefix}.json")


if __name__ == "__main__":
    sys.exit(main())
