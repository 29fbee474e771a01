"""Pick the BLAS that mlx's CPU backend will call, before mlx is imported."""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CHOICES = ("auto", "mkl", "reference")


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
    choice = os.environ.get("TANDEM_BLAS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise SystemExit(f"TANDEM_BLAS={choice!r} is not one of {', '.join(_CHOICES)}")
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
