"""tandem's malloc settings keep a serving thread's large temporaries in the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tandem

# Arrays of a host prefill's sizes (1.4-7.5 MB), made, written and freed round after
# round on a thread other than the main one, as the engine thread does; the page faults
# of rounds 3-6 are what the settings remove (with glibc's defaults: ~8,500 here).
SNIPPET = textwrap.dedent("""
    import resource, threading
    import tandem  # noqa: F401
    import numpy as np

    def work(out):
        sizes = [1_400_000, 2_400_000, 3_800_000, 7_500_000]
        for r in range(6):
            if r == 2:
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            arrs = [np.ones(n // 4, np.float32) for n in sizes]
            del arrs
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)

    out = []
    t = threading.Thread(target=work, args=(out,))
    t.start()
    t.join()
    print(out[0])
""")


@pytest.mark.skipif(not tandem.MALLOC_TUNED, reason="no glibc mallopt here")
def test_a_threads_large_temporaries_are_reused_without_page_faults():
    pages = 4 * sum([1_400_000, 2_400_000, 3_800_000, 7_500_000]) // 4096  # touched in rounds 3-6
    faults = int(subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True,
                                check=True).stdout)
    assert faults < pages // 100, f"{faults} minor faults for {pages} pages written"


RETAIN_SNIPPET = textwrap.dedent("""
    import resource
    import numpy as np
    from tandem._malloc import retain_freed_memory

    def burst():  # a transfer's worth of 2 MiB frames, received, then freed
        bufs = [np.ones(2 << 20, np.uint8) for _ in range(64)]
        assert all(b[-1] == 1 for b in bufs)

    ok = retain_freed_memory()
    burst()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    burst()
    print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not tandem.MALLOC_TUNED, reason="no glibc mallopt here")
def test_retain_freed_memory_avoids_refaulting_the_next_transfer():
    # Without retention glibc returns the frames to the kernel and the second burst
    # faults every page again (~32,800 faults for these 128 MiB).
    ok, faults = subprocess.run([sys.executable, "-c", RETAIN_SNIPPET], capture_output=True, text=True,
                                check=True).stdout.split()
    assert ok == "True"
    assert int(faults) < 3000, f"{faults} page faults for 128 MiB of re-allocated buffers"


# A worker's allocator settings and libc's malloc/free, for the heap_free_bytes tests.
HEAP_PROLOGUE = textwrap.dedent("""
    import ctypes
    import tandem  # noqa: F401  (one arena, large thresholds)
    from tandem import _malloc
    assert _malloc.retain_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
""")


def test_heap_free_bytes_counts_freed_memory_the_heap_keeps():
    """What a worker reports as not in use: freed memory glibc keeps (mallinfo2's fordblks)."""
    from tandem import _malloc

    if _malloc._MALLINFO2 is None:
        pytest.skip("no glibc mallinfo2 here (glibc < 2.33, macOS, musl): workers report 0")
    code = HEAP_PROLOGUE + textwrap.dedent("""
        blocks = [libc.malloc(1 << 20) for _ in range(40)]  # below the mmap threshold: heap
        before = _malloc.heap_free_bytes()
        for p in blocks[:-1]:  # the last one keeps the freed ones from being the heap's trimmed top
            libc.free(p)
        print(_malloc.heap_free_bytes() - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 39 << 20


def test_heap_free_bytes_counts_the_written_pages_of_the_heaps_top():
    """A large temporary freed at the heap's top joins the top chunk: its written pages stay
    resident and are free memory; the pages ``M_TOP_PAD`` grows the top by ahead of use were
    never written and are not resident, so they must not count."""
    from tandem import _malloc

    if _malloc._MALLINFO2 is None or _malloc._LIBC is None:
        pytest.skip("no glibc mallinfo2 here (glibc < 2.33, macOS, musl): workers report 0")
    code = HEAP_PROLOGUE + textwrap.dedent("""
        n = 24 << 20  # below the 32 MiB mmap threshold: from the heap's top
        libc.sbrk.restype = ctypes.c_void_p

        def at_the_top():  # a block just below the top chunk: freeing it joins the top
            held = []
            while True:
                p = libc.malloc(n)
                if abs(p + n - (libc.sbrk(0) - _malloc._MALLINFO2().keepcost)) < 4096:
                    return p, held
                held.append(p)  # a free chunk inside the heap served it: keep it, ask again

        untouched, held = at_the_top()
        # Pages the top may reuse were written before (imports): give this block's back to
        # the kernel, as pages M_TOP_PAD adds are, never written.
        page = _malloc._PAGE
        start = -(-untouched // page) * page + page
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.madvise(ctypes.c_void_p(start), n - 2 * page, 4) == 0  # MADV_DONTNEED
        before = _malloc.heap_free_bytes()
        libc.free(untouched)
        grown_unwritten = _malloc.heap_free_bytes() - before
        written, held2 = at_the_top()
        ctypes.memset(written, 1, n)
        before = _malloc.heap_free_bytes()
        libc.free(written)
        print(grown_unwritten, _malloc.heap_free_bytes() - before)
    """)
    unwritten, written = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True).stdout.split())
    assert unwritten < 1 << 20, f"{unwritten} bytes of never-written top pages counted as free"
    assert written >= (24 << 20) - (1 << 20), f"only {written} of 24 MiB written and freed at the top counted"
