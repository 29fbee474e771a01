"""A kernel launch recorded through MLX, rebuilt to launch outside it (``pipeline.graph_step``).

MLX generates a ``__global__`` function around each ``mx.fast.cuda_kernel`` source: the
inputs as ``const T*`` (each followed by its ``Shape`` / ``Strides`` / ``ndim`` where the
source names them), the outputs as ``T*``, the template as constants at the top of the
body. :func:`kernel_text` writes the same function under ``extern "C"`` with a prelude of
its own in place of MLX's headers (which live inside libmlx), and says what each
parameter is, so a launcher can fill them from the recorded arrays. :func:`device_pointers`
reads the addresses MLX's kernels see for a list of arrays.
"""

from __future__ import annotations

import re

import mlx.core as mx

from tandem.kernels.cuda import kernel_files


class Unsupported(RuntimeError):
    """This step cannot be captured; the reason says what to change."""


# MLX's ``dtype_to_cuda_type``, with the 64-bit integers spelled without the typedefs the
# prelude does not make under NVRTC.
_PARAM_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
                mx.int64: "long long", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
                mx.uint64: "unsigned long long", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
                mx.float32: "float"}
MAX_NDIM = 10  # the Shape / Strides a kernel takes by value

# What a kernel body may use from MLX's prelude, without MLX's headers (which live inside
# libmlx): fp16 / bf16, the 32-bit integer types, ``inf``, and Shape / Strides by value.
PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)
typedef int int32_t;
typedef unsigned int uint32_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
#else
#include <cstdint>
#endif
#define inf (__int_as_float(0x7f800000))
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif
#ifndef NAN
#define NAN (__int_as_float(0x7fffffff))
#endif
#define TANDEM_MAX_NDIM %d
struct Shape { int v[TANDEM_MAX_NDIM]; __device__ __forceinline__ int operator[](int i) const { return v[i]; } };
struct Strides {
  long long v[TANDEM_MAX_NDIM];
  __device__ __forceinline__ long long operator[](int i) const { return v[i]; }
};
""" % MAX_NDIM

def kernel_name(spec: kernel_files.KernelSpec) -> str:
    """The captured kernel's function: named after MLX's kernel, so a trace tells them apart."""
    return "graph_" + re.sub(r"\W", "_", spec.name)
def template_lines(template: list) -> str:
    """The constants MLX writes at the top of the kernel body for ``template``."""
    lines = []
    for n, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {n} = {v};\n")
        elif v in _PARAM_TYPES:
            lines.append(f"  using {n} = {_PARAM_TYPES[v]};\n")
        else:
            raise Unsupported(f"template argument {n}={v!r}: not a type MLX passes")
    return "".join(lines)


def kernel_text(launch: kernel_files.Launch) -> tuple[str, list[tuple[str, int]]]:
    """The launch's kernel as a source of its own, the one MLX generates (the same
    parameters in the same order, the template as constants, then the body) under
    ``extern "C"`` ``graph_<kernel name>``; and the parameters' layout: (kind, index) with
    kind ``in``, ``shape``, ``strides``, ``ndim`` (of input index) or ``out``."""
    spec = launch.spec
    params, layout = [], []
    for i, (n, a) in enumerate(zip(spec.input_names, launch.inputs)):
        if a.dtype not in _PARAM_TYPES:
            raise Unsupported(f"kernel {spec.name}: input {n} of {a.dtype}")
        params.append(f"const {_PARAM_TYPES[a.dtype]}* {n}")
        layout.append(("in", i))
        if a.ndim > 0:  # MLX adds what the source names (kernel_files keeps the names in it)
            for kind, decl in (("shape", "const Shape"), ("strides", "const Strides"), ("ndim", "const int")):
                if f"{n}_{kind}" in spec.source:
                    params.append(f"{decl} {n}_{kind}")
                    layout.append((kind, i))
    for j, (n, o) in enumerate(zip(spec.output_names, launch.outputs)):
        params.append(f"{_PARAM_TYPES[o.dtype]}* {n}")
        layout.append(("out", j))
    tl = template_lines(launch.template)
    text = (PRELUDE + spec.header
            + f'\nextern "C" __global__ void {kernel_name(spec)}(' + ", ".join(params) + ") {\n"
            + tl + ("\n" if tl else "") + spec.source + "\n}\n")
    return text, layout


_PROBES: dict = {}


def row_strides(shape) -> list[int]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return out[::-1]


def device_pointers(arrays: list[mx.array]) -> list[int]:
    """Each (evaluated) array's device address, offset included, as a kernel sees it:
    read by a one-thread kernel that writes its input pointer out."""
    outs = []
    for a in arrays:
        k = _PROBES.get(a.dtype)
        if k is None:
            k = _PROBES[a.dtype] = kernel_files.cuda_kernel(
                name="tandem_pointer_probe", input_names=["x"], output_names=["out"],
                source="if (threadIdx.x == 0) out[0] = (unsigned long long)(const void*)x;",
                include=False, ensure_row_contiguous=False)
        outs.append(k(inputs=[a], template=[("T", a.dtype)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                      output_shapes=[(1,)], output_dtypes=[mx.uint64])[0])
    mx.eval(outs)
    return [int(o.item()) for o in outs]
