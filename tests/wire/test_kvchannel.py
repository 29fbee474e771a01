"""The send arena sealed KV records go out of: a region is handed out again only after
libzmq let go of it, whatever the sizes and the order of releases."""

from __future__ import annotations

import numpy as np

from tandem.wire.kvchannel import RECORD_GROUP_BYTES, SendArena


def test_send_arena_waits_for_release():
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
    assert SendArena(6 << 20).group_bytes() == 3 << 19 and SendArena(1 << 30).group_bytes() == RECORD_GROUP_BYTES


def test_send_arena_wrap_waits_for_newer_regions_it_overlaps():
    # Records of varying size: a region that does not fit before the end of the ring wraps
    # to 0, skipping a tail that holds an older region still in flight. The regions it
    # overlaps at 0 are newer than that one and must be released too, not only the oldest.
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
    return np.frombuffer(region, dtype=np.uint8).ctypes.data - arena._array.ctypes.data
