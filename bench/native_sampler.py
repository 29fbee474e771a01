"""Where one thread's C++ time goes: a wall-clock stack sampler (``native_sampler.c``).

The GPU machine has no perf, gdb or py-spy, and torch's profiler sees CUDA calls but not
MLX's own work, so the engine thread's encoding (~13 us a kernel against ~4 in
``encode_probe.py``) could not be split. This builds the C sampler with the machine's
compiler, samples one thread by its native id, resolves each frame with ``dladdr`` (exported
symbols; a static function shows as the exported one before it, marked ``~``) and
demangles with ``c++filt``.

    python3 bench/native_sampler.py --self-test     # samples a thread of its own
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".c")
# A frame this far past its nearest exported symbol is in some static function after it.
NEAR_SYMBOL_BYTES = 1 << 16
HANDLER_FRAMES = 2  # on_prof and the kernel's signal trampoline


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def build(out_dir: Path | None = None) -> Path:
    """The sampler as a shared library, compiled once per source text."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("native_sampler: no C compiler (cc or gcc) on PATH; set CC")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out_dir = out_dir or Path(tempfile.gettempdir())
    lib = out_dir / f"tandem_native_sampler_{digest}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-lrt"],
                       check=True, capture_output=True, text=True)
        tmp.replace(lib)
    return lib


class Sampler:
    """Samples one thread (its ``threading.get_native_id()``) between ``start`` and ``stop``."""

    def __init__(self, lib: Path | None = None) -> None:
        self._lib = ctypes.CDLL(str(lib or build()))
        self._lib.sampler_frame.restype = ctypes.c_void_p
        self._lib.sampler_frame.argtypes = [ctypes.c_int, ctypes.c_int]
        libc = ctypes.CDLL(None)
        try:
            self._dladdr = libc.dladdr
        except AttributeError:  # glibc before 2.34 keeps it in libdl
            self._dladdr = ctypes.CDLL("libdl.so.2").dladdr
        self._dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        self._names: dict[int, str] = {}
        self._symtabs: dict[str, tuple[list[int], list[str]]] = {}

    def start(self, native_tid: int, interval_us: int = 200, samples: int = 50_000, depth: int = 64) -> None:
        err = self._lib.sampler_start(native_tid, interval_us, samples, depth)
        if err:
            raise OSError(err, f"native_sampler: cannot sample thread {native_tid}: {os.strerror(err)}")

    def gate(self, open_: bool) -> None:
        """Keep samples only while open (from ``start``: open). Costs a ctypes call (~1 us)."""
        self._lib.sampler_gate(1 if open_ else 0)

    def stop(self) -> list[tuple[str, ...]]:
        """The stacks, innermost frame first, each frame a ``lib:function`` label."""
        n = self._lib.sampler_stop()
        raw = []
        for i in range(n):
            depth = self._lib.sampler_depth(i)
            raw.append([self._lib.sampler_frame(i, j) for j in range(HANDLER_FRAMES, depth)])
        self._resolve({a for stack in raw for a in stack if a})
        return [tuple(self._names.get(a, "?") for a in stack if a) for stack in raw]

    def _resolve(self, addresses: set[int]) -> None:
        todo = sorted(a for a in addresses if a not in self._names)
        mangled = []
        for a in todo:
            info = _DlInfo()
            # A return address points past its call; one byte back is inside the caller.
            if not self._dladdr(ctypes.c_void_p(a - 1), ctypes.byref(info)) or not info.dli_fname:
                mangled.append(("?", f"{a:#x}", False))
                continue
            path = info.dli_fname.decode(errors="replace")
            lib = os.path.basename(path) or "?"
            if info.dli_sname and info.dli_saddr and a - info.dli_saddr < NEAR_SYMBOL_BYTES:
                mangled.append((lib, info.dli_sname.decode(errors="replace"), False))
            elif (local := self._local_symbol(path, a - 1 - (info.dli_fbase or 0))) is not None:
                mangled.append((lib, local, False))
            elif info.dli_sname:
                mangled.append((lib, info.dli_sname.decode(errors="replace"), True))
            else:
                mangled.append((lib, f"+{a - (info.dli_fbase or 0):#x}", False))
        names = _demangle([m[1] for m in mangled])
        for a, (lib, _, far), name in zip(todo, mangled, names):
            self._names[a] = f"{lib}:{'~' if far else ''}{_shorten(name)}"

    def _local_symbol(self, path: str, offset: int) -> str | None:
        """The function holding ``offset`` in the library's full symbol table (``nm``), for the
        static functions ``dladdr`` cannot name; None when the library is stripped."""
        if path not in self._symtabs:
            starts, names = [], []
            nm = shutil.which("nm")
            if nm:
                out = subprocess.run([nm, "--defined-only", "-n", path], capture_output=True, text=True).stdout
                for line in out.splitlines():
                    parts = line.split(" ", 2)
                    if len(parts) == 3 and parts[1] in "tTwW":
                        starts.append(int(parts[0], 16))
                        names.append(parts[2])
            self._symtabs[path] = (starts, names)
        starts, names = self._symtabs[path]
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0 or offset - starts[i] >= NEAR_SYMBOL_BYTES:
            return None
        return names[i]


def _demangle(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if not filt or not names:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def _shorten(name: str, limit: int = 110) -> str:
    """Drops argument lists (the template arguments stay): a stack's rows fit a line."""
    depth, out = 0, []
    for ch in name:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip() or name
    return short if len(short) <= limit else short[:limit - 3] + "..."


def children(stacks: list[tuple[str, ...]], parent: str) -> Counter:
    """For the stacks through a frame holding ``parent`` (its outermost such frame), the frame
    it was in one call down (``<self>`` when the parent itself was running): how the
    parent's time splits."""
    out: Counter = Counter()
    for stack in stacks:
        idx = next((i for i in range(len(stack) - 1, -1, -1) if parent in stack[i]), None)
        if idx is not None:
            out[stack[idx - 1] if idx > 0 else "<self>"] += 1
    return out


def report(stacks: list[tuple[str, ...]], top: int = 30, log=print, focus: tuple[str, ...] = (),
           parents: tuple[str, ...] = ()) -> dict:
    """Self (innermost frame) and inclusive (anywhere in the stack) shares, and the shares of
    each library; what the benches print and keep in their JSON. ``focus``: the inclusive
    rows only for frames holding one of these strings (the interpreter's frames are in
    every stack and say nothing)."""
    n = max(len(stacks), 1)
    self_time = Counter(s[0] for s in stacks if s)
    inclusive = Counter(f for s in stacks for f in set(s) if not focus or any(k in f for k in focus))
    libs = Counter(s[0].split(":", 1)[0] for s in stacks if s)
    rows = {}
    for title, counter in (("self", self_time), ("inclusive", inclusive), ("library (self)", libs)):
        log(f"\n{title}: {len(stacks)} samples")
        rows[title] = []
        for name, c in counter.most_common(top):
            rows[title].append({"frame": name, "share": c / n})
            log(f"  {100 * c / n:5.1f}%  {name}")
    for parent in parents:
        split = children(stacks, parent)
        total = sum(split.values())
        log(f"\nunder {parent}: {100 * total / n:.1f}% of samples")
        rows[f"under {parent}"] = []
        for name, c in split.most_common(top // 2):
            rows[f"under {parent}"].append({"frame": name, "share": c / n})
            log(f"  {100 * c / n:5.1f}%  {name}")
    return {"samples": len(stacks), **rows}


def _self_test(seconds: float) -> int:
    """Samples a thread that spins in ``zlib.compress``: most samples must be in zlib (the
    unit test, tests/test_bench_native_sampler.py, also checks a sleeping thread). For a
    machine where the tests do not run, such as the lent GPU's."""
    import zlib

    stop = threading.Event()
    ids: dict[str, int] = {}

    def busy():
        ids["busy"] = threading.get_native_id()
        data = os.urandom(1 << 16)
        while not stop.is_set():
            zlib.compress(data, 9)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    while "busy" not in ids:
        time.sleep(0.001)
    sampler = Sampler()
    sampler.start(ids["busy"], interval_us=500)
    time.sleep(seconds)
    stacks = sampler.stop()
    stop.set()
    t.join()
    r = report(stacks, top=8)
    zlib_share = sum(1 for s in stacks if any("libz" in f or "deflate" in f for f in s)) / max(len(stacks), 1)
    print(f"\nsamples in zlib: {zlib_share:.0%}")
    return 0 if r["samples"] > 0 and zlib_share > 0.5 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    if not args.self_test:
        ap.error("use it from a bench (gpu_probe.py --sections engine-sample) or run --self-test")
    sys.exit(_self_test(args.seconds))
