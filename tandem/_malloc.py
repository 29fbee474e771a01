"""glibc malloc settings for a process that serves: one arena, large thresholds.

The engine runs on its own thread, so glibc gives its allocations an arena of their
own, and that arena hands a prefill's large temporaries (the 1-25 MB numpy arrays of
the host prefill layers) back to the kernel as they are freed. After the first decode
step the next prefills paid for it in page faults: 16 prompts of 170 tokens after 8
others took 3.4-3.7 s instead of 3.0-3.1, with ~350,000 minor faults (0.9 s of system
time) against ~5,000 (docs/cpu-performance.md, "Page faults after the first decode").
One arena and thresholds above those sizes keep the memory in the process: the same
run took 3.04-3.07 s with none of those faults.

Set at import, before any thread allocates; a no-op where there is no ``mallopt``
(macOS, musl), and ``TANDEM_MALLOC=default`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import mmap

from tandem import knobs

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 64 << 20  # above a prefill's largest temporary (4 x 512 tokens: ~25 MB)
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap's top before it is returned


def _mallopt(settings: list[tuple[int, int]]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value); False where there is none (macOS,
    musl) or glibc refused one."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) for param, value in settings)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc 2.33+
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_free_bytes() -> int:
    """Freed memory glibc keeps in the heap for reuse and that is resident (0 where it
    cannot say).

    The settings here keep freed memory in the process by design, so a worker's resident
    memory is the high-water mark of what it ever held at once (its largest batch, its
    largest KV transfers), not what it holds now: resident memory minus this is what a
    leak would grow. Free chunks inside the heap count whole (they were handed out, so
    written); the top chunk counts only its resident pages: ``M_TOP_PAD`` grows it ahead
    by pages never touched, while a large temporary freed at the top leaves its pages
    resident there, and those are free memory too."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.fordblks - info.keepcost) + _top_resident_bytes(int(info.keepcost))


def _top_resident_bytes(top: int) -> int:
    """Resident bytes of the main heap's top chunk: the last ``top`` bytes below the
    program break (with one arena every thread allocates there). 0 where it cannot be
    read (no sbrk/mincore, or the range is not mapped: a heap that moved to mmap).
    Allocates nothing on the heap while it looks (one vector made at import, reused): an
    allocation would land at the top it measures."""
    if _LIBC is None or top <= 0:
        return 0
    page, vec, span = _PAGE, _VEC, len(_VEC) * _PAGE
    end = _LIBC.sbrk(0)
    if not end:
        return 0
    resident = 0
    for start in range(-(-(end - top) // page) * page, end, span):
        n = min(end - start, span) // page
        if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
            return 0
        resident += bytes(vec)[:n].count(1)  # bit 0: resident; the others are reserved (0)
    return resident * page


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_PAGE = mmap.PAGESIZE
_VEC = (ctypes.c_ubyte * 65536)()  # mincore's answer for 256 MiB of 4 KiB pages


def tune_malloc() -> bool:
    """Apply the settings; True if glibc took them."""
    if knobs.MALLOC == "default":
        return False
    return _mallopt([(_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)])


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the heap instead of returning it to the kernel.

    A KV receiver gets tens to hundreds of MB per transfer in fresh buffers; when glibc
    unmaps them after each transfer, the next one page-faults every 4 KiB again (on the
    development machine ~32,800 faults and ~60 ms of CPU per 134 MB transfer; with this
    call, none after the first). Costs resident memory up to the largest transfer seen.
    The trim threshold is glibc's largest (2 GiB): at 1 GiB, freeing one 1 GB transfer
    (an 8k-token 8B-shaped cache) still handed it back, and the next one faulted again.
    Call once in a prefill or decode worker (after :func:`tune_malloc`, whose thresholds it
    replaces). Returns False where mallopt is unavailable (not glibc)."""
    # 32 MiB is glibc's largest mmap threshold: frames (one layer's K or V) above it stay mmapped.
    return _mallopt([(_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 256 << 20), (_M_MMAP_THRESHOLD, 32 << 20)])
