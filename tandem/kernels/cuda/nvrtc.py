"""NVRTC through ctypes: CUDA C++ source to a cubin for this GPU, cached on disk.

``pipeline.graph_step`` compiles the kernels it captures itself: MLX's CUDA backend keeps
the modules of ``mx.fast.cuda_kernel`` in memory only (its PTX cache directory holds its
own fused kernels, not custom ones: H200, 2026-12-02), and exposes no handle to them.
``kernels.w4wgmma`` compiles its ``sm_90a`` kernel here too. MLX loads the same library
(``libnvrtc.so.13`` from its wheel's dependencies), so this finds it among the process's
loaded libraries first, then in an ``nvidia-cuda-nvrtc`` wheel on ``sys.path``.

Cubins go to ``kernel_files.kernel_dir()`` (private to the user, checked) under the
digest of the source, the architecture and NVRTC's version: a restart loads them instead
of compiling (~1-2 s a variant).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
from pathlib import Path

from tandem.kernels.cuda import kernel_files


class CompileError(RuntimeError):
    pass


def _find_library() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as f:
            loaded = sorted({line.split()[-1] for line in f if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        loaded = []
    # The nvidia-cuda-nvrtc wheel's copy, where the process has not loaded one yet.
    wheels = sorted(str(p) for d in sys.path if d and Path(d, "nvidia").is_dir()
                    for p in Path(d, "nvidia").glob("*/lib/libnvrtc.so.*") if "builtins" not in p.name)
    for name in loaded + wheels + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = _find_library()
    if lib is None:
        return None
    p, c, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    for name, args in {"nvrtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2,
                       "nvrtcCreateProgram": [ctypes.POINTER(p), c, c, ctypes.c_int, p, p],
                       "nvrtcCompileProgram": [p, ctypes.c_int, ctypes.POINTER(c)],
                       "nvrtcGetProgramLogSize": [p, ctypes.POINTER(sz)],
                       "nvrtcGetProgramLog": [p, c],
                       "nvrtcGetCUBINSize": [p, ctypes.POINTER(sz)],
                       "nvrtcGetCUBIN": [p, c],
                       "nvrtcDestroyProgram": [ctypes.POINTER(p)]}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def version() -> tuple[int, int]:
    lib = library()
    a, b = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def include_dirs() -> list[str]:
    """Where cuda_fp16.h is: MLX's own search (CUDA_HOME, CUDA_PATH, /usr/local/cuda)."""
    out = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").exists():
            out.append(str(Path(root) / "include"))
    return out


def compile_cubin(source: str, arch: str, name: str = "kernel.cu") -> bytes:
    """``source`` compiled for ``arch`` (``sm_90``...); the disk cache first."""
    lib = library()
    if lib is None:
        raise CompileError("no libnvrtc in this process or on the loader's path")
    opts = [f"--gpu-architecture={arch}", "--std=c++17"] + [f"--include-path={d}" for d in include_dirs()]
    key = hashlib.sha256("\0".join([source, *opts, repr(version())]).encode()).hexdigest()[:24]
    path = kernel_files.kernel_dir() / f"nvrtc-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc:
        raise CompileError(f"nvrtcCreateProgram failed ({rc})")
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if rc:
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value + 1)
            lib.nvrtcGetProgramLog(prog, buf)
            raise CompileError(f"NVRTC could not compile {name} ({rc}): {buf.value.decode(errors='replace')[:2000]}")
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw[: n.value]
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(path)
    return cubin
