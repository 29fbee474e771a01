"""KV transfers over real loopback sockets, every strategy, plus refusal, timeout and the selector."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from tandem.wire.kvchannel import KVSender
from tandem.wire.kvframes import KVOptions
from tandem.wire.transfer import AdaptiveSelector, KVIngest, KVRefused, send_snapshot
from tests.wire.test_kvframes import make_snapshot

SECRET = b"t" * 32


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _run(ctx, ingest, snap, options, connections=1):
    out = {}

    def sender():
        senders = []
        try:
            senders = [KVSender(ctx, ingest.endpoint, SECRET, "prefill-1") for _ in range(connections)]
            out["result"] = send_snapshot(senders, snap, options, stream_seq=1, attempt=2, timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc
        finally:
            for s in senders:
                s.close()

    t = threading.Thread(target=sender)
    t.start()
    done = []
    while t.is_alive() or not done:
        done += ingest.poll(0.2)
        if not t.is_alive() and not done:
            done += ingest.poll(0.2)
            break
    t.join(10)
    return out, done


@pytest.mark.parametrize(
    "options,connections",
    [
        (KVOptions(strategy="full"), 1),
        (KVOptions(strategy="streamed", blocks_per_chunk=2, compression="lz4"), 1),
        (KVOptions(strategy="layer_parallel", connections=3), 3),
        (KVOptions(strategy="layer_parallel", connections=2, quantization="int8"), 2),
    ],
    ids=lambda x: getattr(x, "strategy", str(x)),
)
def test_transfer_over_loopback(ctx, options, connections):
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    snap = make_snapshot(num_computed=100, layers=4)
    out, done = _run(ctx, ingest, snap, options, connections)
    assert "error" not in out, out.get("error")
    assert len(done) == 1
    header, got, peer = done[0]
    assert peer == "prefill-1" and header.stream_seq == 1 and header.attempt == 2
    assert got.tokens == snap.tokens and got.sampling == snap.sampling
    for a, b in zip(got.keys + got.values, snap.keys + snap.values):
        if options.quantization == "none":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=0.05)
    assert out["result"].nbytes == snap.nbytes and ingest.completed == 1
    ingest.close()


def test_refusal_reaches_the_sender(ctx):
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1", can_accept=lambda h: "at_capacity")
    out, done = _run(ctx, ingest, make_snapshot(), KVOptions())
    assert done == [] and isinstance(out["error"], KVRefused) and out["error"].reason == "at_capacity"
    ingest.close()


def test_partial_transfers_expire(ctx):
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1", timeout_s=5)
    from tandem.wire.kvframes import make_header

    ingest._on_header(b"peer", make_header(make_snapshot(), KVOptions()))
    assert ingest.expire() == []
    import time

    assert ingest.expire(time.monotonic() + 6) == [b"R" * 16]
    ingest.close()


def test_adaptive_selector_explores_then_exploits():
    sel = AdaptiveSelector(small_bytes=1000, explore_every=4)
    assert sel.choose("d1", 10) == "full"  # small: always full
    first, second = sel.choose("d1", 10_000), sel.choose("d1", 10_000)
    assert {first, second} == {"full", "layer_parallel"}
    sel.record("d1", "full", 10_000, 1e-5)  # 1 GB/s
    sel.record("d1", "layer_parallel", 10_000, 5e-6)  # 2 GB/s
    picks = [sel.choose("d1", 10_000) for _ in range(8)]
    assert picks.count("layer_parallel") >= 6 and "full" in picks  # mostly the faster, sometimes re-checks
    assert sel.bandwidth("d1") == pytest.approx(2.0)
    assert sel.choose("d2", 10_000) == "full"  # per peer
    assert sel.choose("d3", 10_000, streaming=True) in ("full", "layer_parallel", "streamed")


def test_large_transfers_through_a_small_arena_stay_bit_exact(ctx):
    # Frames above 64 KiB go through the sender's reused arena and are decrypted in place
    # on the receiver; a region reused before libzmq released it would corrupt data.
    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    snaps = [make_snapshot(num_computed=1024, layers=3, heads=4, block_size=16, head_dim=64, seed=s) for s in range(3)]
    strategies = [KVOptions(strategy="full"), KVOptions(strategy="streamed", blocks_per_chunk=32), KVOptions(strategy="full")]
    out, done = {}, []

    def sender():
        # A 6 MiB arena takes records of 1.5 MiB (a quarter of it: three 512 KiB frames),
        # so it wraps several times over the three transfers.
        tx = KVSender(ctx, ingest.endpoint, SECRET, "prefill-1", arena_bytes=6 << 20)
        try:
            for snap, options in zip(snaps, strategies):
                send_snapshot([tx], snap, options, timeout_s=10)
            out["arena_used"] = tx._arena._view is not None
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc
        finally:
            tx.close()

    t = threading.Thread(target=sender)
    t.start()
    while t.is_alive() or len(done) < len(snaps):
        done += ingest.poll(0.2)
        if not t.is_alive() and len(done) < len(snaps) and not ingest.poll(0.5):
            break
    t.join(10)
    assert "error" not in out, out.get("error")
    assert len(done) == 3 and snaps[0].nbytes > 2 << 20 and out["arena_used"]
    for (_, got, _), snap in zip(done, snaps):
        for a, b in zip(got.keys + got.values, snap.keys + snap.values):
            np.testing.assert_array_equal(a, b)
    ingest.close()


def test_send_arena_waits_for_release():
    from tandem.wire.kvchannel import SendArena

    class Tracker:
        def __init__(self):
            self.waited = self.done = False

        def wait(self):
            self.waited = self.done = True

    arena = SendArena(1000)
    assert arena.alloc(600) is None  # more than half: plain allocation instead
    a = arena.alloc(400)
    ta = Tracker()
    arena.track(ta)
    b = arena.alloc(400)
    arena.track(Tracker())
    assert len(a) == len(b) == 400 and not ta.waited
    tb = arena._inflight[-1][2]
    c = arena.alloc(400)  # wraps to 0: must wait for a's release first, not b's
    assert ta.waited and not tb.waited and len(c) == 400
    arena.track(Tracker())
    d = arena.alloc(150)  # [400, 550) overlaps b, still in flight
    assert tb.waited and len(d) == 150
    # Without waiting (a worker's IO thread): None while libzmq holds the region, then reuse.
    arena.track(Tracker())
    tc, td = arena._inflight[0][2], arena._inflight[1][2]
    tc.done = td.done = False
    assert len(arena.alloc(400, wait=False)) == 400  # [550, 950): clear of c and d
    arena.track(Tracker())
    assert arena.alloc(400, wait=False) is None and not tc.waited  # wraps onto c, still held
    tc.done = True
    assert len(arena.alloc(400, wait=False)) == 400 and not tc.waited
    from tandem.wire.kvchannel import RECORD_GROUP_BYTES

    assert SendArena(6 << 20).group_bytes() == 3 << 19 and SendArena(1 << 30).group_bytes() == RECORD_GROUP_BYTES


def test_send_arena_wrap_waits_for_newer_regions_it_overlaps():
    # Records of varying size: a region that does not fit before the end of the ring wraps
    # to 0, skipping a tail that holds an older region still in flight. The regions it
    # overlaps at 0 are newer than that one and must be released too, not only the oldest.
    from tandem.wire.kvchannel import SendArena

    class Tracker:
        def __init__(self, done=False):
            self.done, self.waited = done, False

        def wait(self):
            self.waited = self.done = True

    def take(arena, n, tracker, wait=True):
        got = arena.alloc(n, wait)
        if got is not None:
            arena.track(tracker)
        return got

    arena = SendArena(64)
    take(arena, 20, Tracker(done=True))  # [0, 20)
    take(arena, 20, Tracker(done=True))  # [20, 40)
    a = Tracker()
    take(arena, 20, a)  # [40, 60), in flight
    b, c = Tracker(), Tracker()
    take(arena, 20, b)  # wraps: [0, 20)
    take(arena, 20, c)  # [20, 40)
    assert not (a.waited or b.waited or c.waited)
    assert take(arena, 30, Tracker(), wait=False) is None  # [0, 30) would overwrite b and c
    region = take(arena, 30, Tracker())
    assert a.waited and b.waited and c.waited and len(region) == 30


def test_send_arena_never_hands_out_memory_in_flight():
    # Random record sizes, releases in any order, waiting and non-waiting callers: no
    # region handed out may overlap one libzmq still holds.
    import random

    from tandem.wire.kvchannel import SendArena

    rng = random.Random(5)
    live: list = []

    class Tracker:
        def __init__(self, span):
            self.span, self.done = span, False

        def wait(self):
            self.done = True

    for size in (64, 1000, 4096):
        arena, live = SendArena(size), []
        for _ in range(3000):
            for t in live:
                if not t.done and rng.random() < 0.3:
                    t.done = True  # libzmq released it (in any order)
            live = [t for t in live if not t.done]
            n = rng.randint(1, size // 2)
            region = arena.alloc(n, wait=rng.random() < 0.5)
            live = [t for t in live if not t.done]
            if region is None:
                continue
            start = _offset(arena, region)
            span = (start, start + n)
            assert all(span[1] <= t.span[0] or t.span[1] <= span[0] for t in live), (span, [t.span for t in live])
            t = Tracker(span)
            arena.track(t)
            live.append(t)


def _offset(arena, region) -> int:
    import numpy as np

    return np.frombuffer(region, dtype=np.uint8).ctypes.data - arena._array.ctypes.data


def test_retain_freed_memory_avoids_refaulting():
    # The receive pattern: a transfer's worth of 2 MiB frames, freed, then the next
    # transfer's. Without retention glibc returns them to the kernel and the second burst
    # faults every page again (32,756 faults measured in a fresh process).
    import resource

    from tandem.wire.transfer import retain_freed_memory

    if not retain_freed_memory():
        pytest.skip("mallopt unavailable (not glibc)")

    def burst():
        bufs = [np.ones(2 << 20, np.uint8) for _ in range(64)]
        assert all(b[-1] == 1 for b in bufs)

    burst()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    burst()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 3000, f"{faults} page faults for 128 MiB of re-allocated buffers"


def test_progressive_stream_completes_only_with_the_final_header(ctx):
    # An engine exporting during prefill: geometry known up front, blocks as computed,
    # the sampled token last. All blocks arriving must not complete the transfer early.
    from tandem.wire.kvframes import make_header
    from tandem.wire.transfer import KVStream

    ingest = KVIngest(ctx, "tcp://127.0.0.1:*", SECRET, "decode-1")
    final = make_snapshot(num_computed=96, layers=3, heads=2, block_size=8, head_dim=16)  # 12 blocks
    prompt_only = make_header(final, KVOptions())
    prompt_only.tokens = final.tokens[:-1]
    progress, out, done = threading.Event(), {}, []

    def sender():
        tx = KVSender(ctx, ingest.endpoint, SECRET, "prefill-1")
        try:
            stream = KVStream(tx, prompt_only, KVOptions(compression="lz4"))
            for b in range(0, 12, 5):
                stream.send_blocks([k[b : b + 5] for k in final.keys], [v[b : b + 5] for v in final.values], b)
            progress.wait(10)  # every block is out; the receiver checks it is not done yet
            out["result"] = stream.finish(make_header(final, KVOptions(), stream_seq=1), timeout_s=10)
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc
        finally:
            tx.close()

    t = threading.Thread(target=sender)
    t.start()
    import time

    deadline = time.monotonic() + 10
    while len(ingest._pending) == 0 or not ingest._pending[final.request_id].assembler._seen.all():
        assert not ingest.poll(0.2), "completed before the final header"
        assert time.monotonic() < deadline and "error" not in out, out.get("error", "blocks did not arrive")
    progress.set()
    while not done and t.is_alive():
        done += ingest.poll(0.5)
    t.join(10)
    assert "error" not in out, out.get("error")
    header, got, _ = done[0]
    assert header.final and got.tokens == final.tokens and header.stream_seq == 1
    for a, b in zip(got.keys + got.values, final.keys + final.values):
        np.testing.assert_array_equal(a, b)
    assert out["result"].nbytes == final.nbytes
    ingest.close()
