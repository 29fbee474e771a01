"""Pick the BLAS that mlx's CPU backend will call, before mlx is imported, and the kernels
numpy's bundled OpenBLAS (the CPU prefill's products) runs, before numpy is imported."""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from tandem import knobs



def _mkl_candidates() -> list[str]:
    # The PyPI `mkl` wheel installs its libraries into <prefix>/lib, not site-packages.
    prefixes = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    found: list[str] = []
    for prefix in prefixes:
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    return found


def preload_blas() -> str:
    """Load the chosen BLAS globally; return a short name of what mlx will use.

    Must run before the first ``import mlx``: once libmlx has bound its BLAS
    symbols, loading another library changes nothing.
    """
    try:
        choice = knobs.BLAS or "auto"
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if choice == "reference" or sys.platform != "linux":
        return "reference" if sys.platform == "linux" else "platform"
    if "mlx.core" in sys.modules:
        return "unknown (mlx was imported before tandem)"
    for path in _mkl_candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        # MKL defaults to one thread per core; mlx already runs its own threads.
        os.environ.setdefault("MKL_NUM_THREADS", str(os.cpu_count() or 1))
        return "mkl"
    if choice == "mkl":
        raise SystemExit("TANDEM_BLAS=mkl but libmkl_rt was not found: pip install mkl")
    return "reference"


# The AVX-512 subsets OpenBLAS's SkylakeX kernels are built with, and its cores that have them.
_SKYLAKEX_FLAGS = frozenset(("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"))
_AVX512_CORES = frozenset(("skylakex", "cooperlake", "sapphirerapids"))


def openblas_coretype(cpuinfo: str, forced: str | None) -> str | None:
    """The ``OPENBLAS_CORETYPE`` tandem sets, given /proc/cpuinfo's text and the value the
    environment has (None: unset), or None to leave it: ``SkylakeX`` where the environment
    forces a core without AVX-512 (e.g. ``Haswell``, which some images set for every
    process) on a CPU whose kernel reports the AVX-512 subsets those kernels need. The
    prefill's products are OpenBLAS calls (:func:`openblas_sgemm`), and on a CPU with two
    512-bit FMA pipes a core the AVX2 kernels leave half of them idle (measured in
    docs/cpu-performance.md, "Sixteen clients on a Zen 5"). Unset, OpenBLAS picks them itself."""
    if forced is None or forced.strip().lower() in _AVX512_CORES:
        return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return "SkylakeX" if _SKYLAKEX_FLAGS <= set(value.split()) else None
    return None


def choose_openblas_core() -> str | None:
    """Apply :func:`openblas_coretype` to this process before anything imports numpy
    (OpenBLAS reads the variable once, when numpy loads it); returns the value the
    environment had when it was replaced, else None. ``TANDEM_PREFILL_BLAS=mkl`` keeps the
    prefill off OpenBLAS altogether, and the environment as it is."""
    forced = os.environ.get("OPENBLAS_CORETYPE")
    if forced is None or "numpy" in sys.modules or sys.platform != "linux" or knobs.PREFILL_BLAS != "auto":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            core = openblas_coretype(f.read(), forced)
    except OSError:
        return None
    if core is None:
        return None
    os.environ["OPENBLAS_CORETYPE"] = core
    return forced


def openblas_core() -> str | None:
    """The kernels numpy's bundled OpenBLAS runs (``Haswell``, ``SkylakeX``, ...), or None
    where numpy bundles none."""
    lib = _openblas_lib()
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename"):
        fn = getattr(lib, name, None) if lib is not None else None
        if fn is not None:
            fn.restype = ctypes.c_char_p
            return fn().decode()
    return None


def _openblas_lib():
    import numpy

    libdir = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "libscipy_openblas*.so*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


# numpy's wheels bundle OpenBLAS (64-bit sizes, symbols prefixed scipy_ and suffixed 64_;
# some builds 32-bit sizes without the suffix): tried in this order.
_OPENBLAS_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_", True),
                     ("scipy_cblas_sgemm", "scipy_openblas_set_num_threads", False))
_openblas: tuple[int, bool] | None | bool = False  # False: not looked for yet


def openblas_sgemm() -> tuple[int, bool] | None:
    """The address of numpy's bundled OpenBLAS ``cblas_sgemm`` and whether it takes 64-bit
    sizes, or None where numpy has no bundled OpenBLAS (or ``TANDEM_PREFILL_BLAS=mkl``).

    Prefill products call it from tandem's own thread pool, one single-threaded call per
    thread (``q4_kernels.blas_rows``), so this sets the library to one thread: numpy's
    own matrix products in this process then run on one core as well. On the 2-core
    EPYC (Zen 4) its SkylakeX kernels ran the prefill shapes of the default model at
    ~200 GFLOP/s where MKL (which takes its generic code path on AMD CPUs) ran at
    ~165-180 (docs/cpu-performance.md)."""
    global _openblas
    if _openblas is not False:
        return _openblas
    _openblas = None
    if knobs.PREFILL_BLAS != "auto":
        return None
    lib = _openblas_lib()
    if lib is not None:
        for sgemm, set_threads, ilp64 in _OPENBLAS_SYMBOLS:
            fn, threads = getattr(lib, sgemm, None), getattr(lib, set_threads, None)
            if fn is None or threads is None:
                continue
            threads.argtypes = [ctypes.c_int]
            threads(1)
            _openblas = (ctypes.cast(fn, ctypes.c_void_p).value, ilp64)
            return _openblas
    return None
