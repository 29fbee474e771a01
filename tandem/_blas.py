"""Pick the BLAS that mlx's CPU backend will call, before mlx is imported."""

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
    import numpy

    libdir = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "libscipy_openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sgemm, set_threads, ilp64 in _OPENBLAS_SYMBOLS:
            fn, threads = getattr(lib, sgemm, None), getattr(lib, set_threads, None)
            if fn is None or threads is None:
                continue
            threads.argtypes = [ctypes.c_int]
            threads(1)
            _openblas = (ctypes.cast(fn, ctypes.c_void_p).value, ilp64)
            return _openblas
    return None
