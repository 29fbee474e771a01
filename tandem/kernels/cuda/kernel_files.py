"""Kernel text kept in files that a kernel's source only includes, so MLX hashes a short string.

MLX's CUDA backend (the 0.32.4 wheel's ``CustomKernel::eval_gpu``, read from its machine
code) names the module of a custom kernel ``fmt::format("{}_{}", name, std::hash(source))``
on every launch it encodes, and the source it hashes is the whole generated text: MLX's
prelude, the kernel's header, its signature, its body. tandem's one-row kernels are 8-14 KB
of text, and a one-row step encodes ~160 of them: ``std::_Hash_bytes`` was 13.8% of the
engine thread's samples at batch 1, about 0.45 ms of a 3.5 ms step.

So a kernel's header and body go into files named
by their content, and the text MLX sees and hashes is two ``#include`` lines and the
signature; the preprocessor puts the body back inside the function MLX writes, so the
compiled kernel is the same. MLX finds the inputs whose shape, strides or ndim a body reads
by searching the source for ``<input>_shape`` and the like; the short source names those in
a comment so the signature stays the same. The engine at batch 1 gained 5-20% (the thread
encoding a step in ~30% less time); batch 64 did not move.

The directory is created 0700 and must be the caller's: a file under a guessable name in a
shared temporary directory would otherwise be code another user could plant in a kernel.
Files are written whole and renamed into place; one that is there is read back and must
hold what it is named for. ``include=False`` hands MLX the texts themselves (tests).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from tandem import knobs

INCLUDE = True
SHAPE_SUFFIXES = ("shape", "strides", "ndim")

_written: dict[Path, str] = {}


def kernel_dir() -> Path:
    """``TANDEM_KERNEL_DIR``, else ``<tmp>/tandem-kernels-<uid>``; made private if new."""
    path = Path(knobs.KERNEL_DIR or Path(tempfile.gettempdir()) / f"tandem-kernels-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"kernel source directory {path} is not private to this user "
                           f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): "
                           f"remove it or set TANDEM_KERNEL_DIR to a directory of your own")
    return path


def include_line(tag: str, text: str) -> str:
    """``#include "<dir>/<tag>-<digest>.cuh"`` for ``text``, the file written if absent."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    path = kernel_dir() / f"{tag}-{digest}.cuh"
    if '"' in str(path) or "\\" in str(path):
        raise RuntimeError(f"kernel source path {path} cannot be written in an #include line")
    if _written.get(path) != text:
        if path.exists():
            if path.read_text() != text:
                raise RuntimeError(f"{path} does not hold the kernel text its name is for: remove it")
        else:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
        _written[path] = text
    return f'#include "{path}"\n'


def shape_reads(source: str, input_names: list[str]) -> list[str]:
    """The ``<input>_shape`` / ``_strides`` / ``_ndim`` names MLX would find in ``source``."""
    return [f"{n}_{s}" for n in input_names for s in SHAPE_SUFFIXES if f"{n}_{s}" in source]


def short_texts(name: str, source: str, header: str, input_names: list[str]) -> tuple[str, str]:
    """(source, header) as MLX should see them: include lines, and the shape names read."""
    reads = shape_reads(source, input_names)
    short_source = include_line(name, source) + (f"// reads {' '.join(reads)}\n" if reads else "")
    return short_source, include_line(f"{name}_header", header) if header else ""


def cuda_kernel(*, name: str, input_names: list[str], output_names: list[str], source: str,
                header: str = "", include: bool | None = None, **kwargs):
    """``mx.fast.cuda_kernel`` with the texts in files when ``include`` (default ``INCLUDE``)."""
    shared = int(kwargs.get("shared_memory") or 0)
    if INCLUDE if include is None else include:
        source, header = short_texts(name, source, header, input_names)
    fn = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                             source=source, header=header, **kwargs)
    return _Kernel(fn, KernelSpec(name, list(input_names), list(output_names), source, header, shared))


# A recorder, while one is active on this thread, sees every kernel call made through
# ``cuda_kernel``: ``pipeline.graph_step`` records one decode step's launches this way and
# replays them as a CUDA graph.
_local = threading.local()


@dataclass
class KernelSpec:
    """What a kernel was made from: the texts MLX was handed and its argument names."""
    name: str
    input_names: list[str]
    output_names: list[str]
    source: str
    header: str
    shared_memory: int = 0  # dynamic shared bytes each launch gets (``extern __shared__``)
    cubin: bytes | None = None  # a precompiled kernel (``precompiled_kernel``): its machine code


@dataclass
class Launch:
    spec: KernelSpec
    inputs: list
    outputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    init_value: float | None
    scalars: list = field(default_factory=list)  # a precompiled kernel's int arguments, after its outputs


class _Kernel:
    """``mx.fast.cuda_kernel``'s callable, and the spec a recorder needs."""

    def __init__(self, fn, spec: KernelSpec):
        self._fn, self.spec = fn, spec

    def __call__(self, **kw):
        outs = self._fn(**kw)
        rec = getattr(_local, "recorder", None)
        if rec is not None:
            rec.append(Launch(self.spec, list(kw["inputs"]), list(outs), list(kw.get("template") or []),
                              tuple(kw["grid"]), tuple(kw["threadgroup"]), kw.get("init_value")))
        return outs


def precompiled_kernel(*, name: str, cubin: bytes, inputs: list, output_shapes: list, output_dtypes: list,
                       scalars: list, grid: tuple, threadgroup: tuple, shared_memory: int = 0,
                       init_value: float | None = None) -> list:
    """``mx.fast.precompiled_cuda_kernel`` (row-contiguous inputs; int ``scalars``), seen by
    an active recorder as :func:`cuda_kernel`'s calls are: its parameters are the inputs'
    addresses, the outputs' and the scalars, in that order."""
    outs = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
        output_dtypes=output_dtypes, scalars=scalars, grid=grid, threadgroup=threadgroup,
        shared_memory=shared_memory, init_value=init_value, ensure_row_contiguous=True)
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        spec = KernelSpec(name, [f"in{i}" for i in range(len(inputs))], [f"out{j}" for j in range(len(outs))],
                          "", "", shared_memory, cubin)
        rec.append(Launch(spec, list(inputs), list(outs), [], tuple(grid), tuple(threadgroup), init_value,
                          [int(v) for v in scalars]))
    return outs


@contextmanager
def recording():
    """Collect the launches made on this thread inside the block (a list of :class:`Launch`)."""
    prev = getattr(_local, "recorder", None)
    launches: list[Launch] = []
    _local.recorder = launches
    try:
        yield launches
    finally:
        _local.recorder = prev
