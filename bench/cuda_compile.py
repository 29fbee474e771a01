"""Compile tandem's CUDA kernel sources with the local nvcc: syntax errors and register /
spill / shared-memory counts per template variant, without a GPU.

A device call costs minutes of a 30-minute budget; a kernel that does not compile wastes
one. MLX wraps ``mx.fast.cuda_kernel`` sources in a ``__global__`` function whose
parameters are the inputs (``const T*``, plus ``<name>_shape``), the outputs (``T*``) and
the template arguments; this script writes the same shape of function and runs
``nvcc -cubin -Xptxas -v`` on it for sm_90 (the H200).

    python bench/cuda_compile.py            # every variant the engine uses on the 8B shape
    python bench/cuda_compile.py --keep /tmp/cu   # keep the .cu files

Each line ends with a digest of the variant's machine code (the cubin's ``.text``
sections, not its symbol names): a refactor, or a new template argument that leaves a
variant's code alone, shows the same digest as before, so the kernels a GPU run measured
are known to be the kernels now (compare two checkouts' outputs line by line).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import struct
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from tandem.kernels.cuda import constants  # noqa: E402
from tandem.kernels.cuda import paged_attention_cuda as pac  # noqa: E402
from tandem.kernels.cuda import decode_attention_cuda as dac  # noqa: E402
from tandem.kernels.cuda import argmax_cuda  # noqa: E402
from tandem.kernels.cuda import embed_cuda  # noqa: E402
from tandem.kernels.cuda import kv_write_cuda as kvw  # noqa: E402
from tandem.kernels.cuda import qgemv as qg  # noqa: E402
from tandem.kernels.cuda import quantized_matmul as qmm  # noqa: E402
from tandem.kernels.cuda import swiglu_cuda  # noqa: E402
from tandem.kernels.cuda import w4gemm  # noqa: E402
from tandem.kernels.cuda import w4mma  # noqa: E402
from tandem.kernels.cuda import w4wgmma  # noqa: E402

PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cooperative_groups.h>
#define inf (__int_as_float(0x7f800000))
"""


def variant(name: str, source: str, header: str, inputs: list[tuple[str, str]],
            outputs: list[tuple[str, str]], template: list[tuple[str, str, str]]) -> str:
    """One kernel instantiation. template: (kind, name, value) with kind 'typename' or a
    C type for a value parameter."""
    tparams = ", ".join(f"{k} {n}" for k, n, _ in template)
    targs = ", ".join(v for _, _, v in template)
    params = []
    for n, t in inputs:
        params += [f"const {t}* {n}", f"const int32_t* {n}_shape"]
    params += [f"{t}* {n}" for n, t in outputs]
    body = f"template <{tparams}>\n__global__ void {name}({', '.join(params)}) {{\n{source}\n}}\n"
    inst = f"void* instantiate = (void*)&{name}<{targs}>;\n"
    return PRELUDE + header + body + inst


def eps_consts(on: bool) -> list[tuple[str, str, str]]:
    """kernels.constants' eps arguments: in the template (on) or read from fparams."""
    bits = str(constants.float_bits(1e-5)) if on else "0"
    return [("bool", "CONSTS", str(on).lower()), ("int", "EPS_BITS", bits)]


def att_consts(on: bool) -> list[tuple[str, str, str]]:
    """kernels.constants' attention arguments (scale 1/sqrt(128), 64-token partitions) or none."""
    bits = str(constants.float_bits(128 ** -0.5)) if on else "0"
    return [("bool", "CONSTS", str(on).lower()), ("int", "PART_C", "64" if on else "0"), ("int", "SCALE_BITS", bits)]


def multirow_variants():
    ins = [("x", "__half"), ("w", "uint32_t"), ("scales", "__half"), ("biases", "__half"),
           ("norm_w", "__half"), ("res", "__half"), ("fparams", "float")]
    for norm, swiglu, res in ((True, False, False), (True, True, False), (False, False, True)):
        t = [("typename", "T", "__half"), ("int", "BITS", "4"), ("int", "MMAX", "4"), ("int", "R", "2"),
             ("bool", "HALF", "true"), ("bool", "NORM", str(norm).lower()), ("bool", "SWIGLU", str(swiglu).lower()),
             ("bool", "RES", str(res).lower())] + eps_consts(norm and not swiglu)
        yield (f"multirow norm={norm} swiglu={swiglu} res={res}",
               variant("tandem_qmv", qmm._SOURCE, qmm._HEADER, ins, [("y", "__half")], t))


def qgemv_stream_variants():
    ins = [("x", "__half"), ("w", "uint32_t"), ("scales", "__half"), ("biases", "__half"), ("norm_w", "__half"),
           ("res", "__half"), ("fparams", "float")]
    outs = [("y", "__half")]
    for label, k, pair, res, norm, unpack, lo in [
            ("qkv", 4096, 0, 0, 0, 0, 0), ("o+res", 4096, 0, 1, 0, 0, 0), ("gate/up pair", 4096, 1, 0, 0, 0, 0),
            ("down+res", 14336, 0, 1, 0, 0, 0), ("qkv+norm", 4096, 0, 0, 1, 0, 0),
            ("gate/up pair+norm unpack1", 4096, 1, 0, 1, 1, 0), ("down+res unpack1", 14336, 0, 1, 0, 1, 0),
            ("gate/up loads-only", 4096, 1, 0, 0, 0, 1)]:
        for cpl, h, p in [(1, 8, 1), (1, 4, 4), (1, 8, 2), (1, 4, 2)]:
            if (k // 32) % (32 * cpl) or (lo and (h, p) not in ((8, 1), (4, 4))):
                continue
            t = [("int", "K", str(k)), ("int", "CPL", str(cpl)), ("int", "H", str(h)), ("int", "P", str(p)),
                 ("bool", "PAIR", str(bool(pair)).lower()), ("bool", "RES", str(bool(res)).lower()),
                 ("bool", "NORM", str(bool(norm)).lower()), ("int", "UNPACK", str(unpack)),
                 ("bool", "LOADS_ONLY", str(bool(lo)).lower())] + eps_consts(bool(norm and unpack))
            yield (f"qgemv-stream {label} c{cpl} h{h} p{p}",
                   variant("tandem_qgemv_stream", qg._STREAM_SOURCE, qg._HEADER, ins, outs, t))
            if not lo and cpl == 1:  # as the kernel runs: only the inputs the call reads
                names = qg.lean_inputs(bool(norm), bool(res), not (norm and unpack))
                yield (f"qgemv-stream-lean {label} c{cpl} h{h} p{p}",
                       variant("tandem_qgemv_stream_lean", qg.lean_source(names), qg._HEADER,
                               [i for i in ins if i[0] in names], outs, t))


def attention_variants():
    ins = [("q", "T"), ("k_pool", "T"), ("v_pool", "T"), ("table", "int32_t"), ("lens", "int32_t"),
           ("params", "float")]
    for ver in ("v2", "v6"):
        for single in (True, False):
            src = (pac._ATT_SOURCE if ver == "v2" else pac._ATT_TILE_SOURCE) + pac._MERGE_TAIL
            t = [("typename", "T", "__half"), ("int", "D", "128"), ("int", "KVH", "8"), ("int", "G", "4"),
                 ("int", "BS", "16"), ("bool", "SINGLE", str(single).lower())]
            t += att_consts(single)
            outs = [("out", "T" if single else "float")]
            yield f"attention {ver} single={single}", variant("tandem_paged_decode", src, pac.HEADER, ins, outs, t)
    for dtype, d, g in (("__half", 128, 4), ("__nv_bfloat16", 128, 4), ("__half", 64, 4), ("__half", 128, 8)):
        for single in (True, False):
            t = [("typename", "T", dtype), ("int", "D", str(d)), ("int", "KVH", "8"), ("int", "G", str(g)),
                 ("int", "BS", "16"), ("bool", "SINGLE", str(single).lower())] + att_consts(single)
            yield (f"attention tc {dtype} D={d} G={g} single={single}",
                   variant("tandem_paged_decode_tc", pac._ATT_TC_SOURCE + pac._MERGE_TAIL,
                           pac.kernel_header("tc"), ins, [("out", "T" if single else "float")], t))
    yield "attention merge", variant("tandem_paged_reduce", pac._REDUCE_SOURCE, pac.HEADER, [("part", "float")],
                                     [("o", "T")], [("typename", "T", "__half"), ("int", "D", "128")])
    ins = [("qkv", "T"), ("pos", "int32_t"), ("slots", "int32_t"), ("inv_freq", "float"),
           ("k_pool", "T"), ("v_pool", "T")]
    for hpt in (1, 8):
        t = [("typename", "T", "__half"), ("int", "H", "32"), ("int", "KVH", "8"), ("int", "D", "128"),
             ("bool", "ROPE", "true"), ("bool", "TRAD", "false"), ("int", "HPT", str(hpt))]
        yield f"write_kv_rope hpt={hpt}", variant("tandem_write_kv_rope", kvw._WRITE_SOURCE, pac.HEADER,
                                                  ins, [("q_out", "T"), ("k_out", "T")], t)
    ins += [("table", "int32_t"), ("params", "float"), ("counters", "int32_t")]
    for dtype, d in (("__half", 128), ("__half", 64), ("__nv_bfloat16", 128)):
        t = [("typename", "T", dtype), ("int", "D", str(d)), ("int", "KVH", "8"), ("int", "G", "4"),
             ("int", "BS", "16"), ("bool", "ROPE", "true"), ("bool", "TRAD", "false"), ("int", "NIT", "4")]
        for smerge in ("false", "true"):
            yield (f"decode attention fused {dtype} D={d} staged-merge={smerge}",
                   variant("tandem_decode_attention_fused", dac._SOURCE, pac.HEADER, ins,
                           [("out", "T"), ("part", "float")],
                           t + [("bool", "SMERGE", smerge)] + att_consts(smerge == "true")))


def tile_write_variants():
    ins = [("qkv", "T"), ("k_pool", "T"), ("v_pool", "T"), ("table", "int32_t"), ("lens", "int32_t"),
           ("params", "float"), ("pos", "int32_t"), ("slots", "int32_t"), ("inv_freq", "float")]
    for ver, single in (("v6", "true"), ("v6", "false"), ("tc", "true"), ("tc", "false")):
        kind, extra, _ = pac.tile_variant(ver, mx.float16, 128, 4)
        t = [("typename", "T", "__half"), ("int", "D", "128"), ("int", "KVH", "8"), ("int", "G", "4"),
             ("int", "BS", "16"), ("bool", "SINGLE", single), ("bool", "TRAD", "false")]
        t += [("bool", name, str(value).lower()) for name, value in extra] + att_consts(single == "true")
        outs = [("out", "T" if single == "true" else "float")]
        yield (f"decode attention tile+write {ver} single={single}",
               variant("tandem_paged_decode_tile_write", dac._TILE_WRITE_SOURCES[kind],
                       pac.kernel_header(kind), ins, outs, t))


def w4mma_variants():
    ins = [("x", "__half"), ("w", "uint32_t"), ("scales", "__half"), ("biases", "__half"), ("res", "__half")]
    for mt in (1, 2, 4, 8):
        for atomic in (False, True):
            t = [("int", "MT", str(mt)), ("int", "RT", str(w4mma.row_tiles(mt))), ("int", "NW", "4"),
                 ("int", "ST", str(w4mma.stages(mt))), ("int", "GS", "64"),
                 ("bool", "ATOMIC", str(atomic).lower()), ("bool", "RES", "true"), ("bool", "LOADS_ONLY", "false")]
            outs = [("y", "float" if atomic else "__half")]
            yield (f"w4mma mt={mt} atomic={atomic}",
                   variant("tandem_w4mma", w4mma._SOURCE, w4mma._HEADER, ins, outs, t))


def w4gemm_variants():
    ins = [("x", "__half"), ("wp", "uint32_t"), ("sbp", "__half"), ("res", "__half")]
    for mt, rt, gs, atomic in ((8, 2, 64, False), (8, 2, 64, True), (8, 1, 64, True), (4, 2, 64, True),
                               (2, 2, 64, False), (8, 2, 32, False), (8, 2, 128, True)):
        t = [("int", "MT", str(mt)), ("int", "RT", str(rt)), ("int", "NW", str(w4gemm.WARPS)),
             ("int", "ST", str(w4gemm.STAGES)), ("int", "GS", str(gs)),
             ("bool", "ATOMIC", str(atomic).lower()), ("bool", "RES", "true"), ("int", "PROBE", "0")]
        outs = [("y", "float" if atomic else "__half")]
        yield (f"w4gemm mt={mt} rt={rt} g{gs} atomic={atomic}",
               variant("tandem_w4gemm", w4gemm.SOURCE, w4gemm.HEADER, ins, outs, t))


def w4wgmma_variants():
    """Complete sources (NVRTC-compiled at run time for sm_90a, not wrapped by MLX)."""
    for gs, atomic, res, mb in ((64, False, False, 0), (64, True, True, 0), (32, False, True, 0), (64, True, True, 2)):
        yield (f"w4wgmma g{gs} atomic={atomic} res={res} min_blocks={mb}",
               w4wgmma.kernel_source(gs, atomic, res, min_blocks=mb)[1])
    for probe in (1, 2, 3, 4):
        yield (f"w4wgmma probe {probe}", w4wgmma.kernel_source(64, True, False, probe=probe)[1])


def embed_variants():
    ins = [("ids", "int32_t"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")]
    for dtype, bits, gs in (("__half", 4, 64), ("__half", 8, 32), ("__nv_bfloat16", 4, 128)):
        t = [("typename", "T", dtype), ("int", "BITS", str(bits)), ("int", "GS", str(gs)),
             ("int", "WPR", str(4096 * bits // 32))]
        yield (f"embedding {dtype} {bits}-bit g{gs}",
               variant("tandem_quantized_embedding", embed_cuda._SOURCE, "", ins, [("out", "T")], t))


def swiglu_variants():
    for dtype in ("__half", "__nv_bfloat16"):
        yield (f"swiglu {dtype}", variant("tandem_swiglu", swiglu_cuda._SOURCE, "", [("y", dtype)],
                                          [("out", dtype)], [("typename", "T", dtype)]))


def argmax_variants():
    for dtype in ("__half", "__nv_bfloat16"):
        yield (f"argmax {dtype}", variant("tandem_argmax_rows", argmax_cuda._SOURCE,
                                          f"constexpr int THREADS = {argmax_cuda.THREADS};\n",
                                          [("logits", dtype)], [("out", "int32_t")], [("typename", "T", dtype)]))


def code_digest(cubin: Path) -> str:
    """12 hex digits of sha256 over a cubin's ``.text.*`` section contents, in section order
    (a cubin is an ELF64 file; its section names carry the mangled kernel name, which a
    template argument changes, its contents only the code)."""
    data = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def section(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size
    _, str_off, _ = section(shstrndx)
    h = hashlib.sha256()
    for i in range(shnum):
        name, offset, size = section(i)
        end = data.index(b"\0", str_off + name)
        if data[str_off + name:end].startswith(b".text."):
            h.update(data[offset:offset + size])
    return h.hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--keep", help="write the generated .cu files here")
    ap.add_argument("--only", default="", help="compile only the variants whose label contains this")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("nvcc not found: nothing to check", file=sys.stderr)
        return 2
    work = Path(args.keep or tempfile.mkdtemp(prefix="tandem-cu-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = 0
    for i, (label, code) in enumerate([*multirow_variants(), *qgemv_stream_variants(), *attention_variants(), *tile_write_variants(), *w4mma_variants(), *w4gemm_variants(), *w4wgmma_variants(),
                                      *embed_variants(), *swiglu_variants(), *argmax_variants()]):
        if args.only not in label:
            continue
        cu = work / f"k{i}.cu"
        cu.write_text(code)
        arch = args.arch + "a" if label.startswith("w4wgmma") and args.arch == "sm_90" else args.arch  # wgmma
        p = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(cu.with_suffix(".cubin")),
                            "-Xptxas", "-v", str(cu)], capture_output=True, text=True)
        info = p.stderr
        if p.returncode:
            failed += 1
            print(f"FAIL {label}\n{info}")
            continue
        if "serialized" in info:  # ptxas gave up overlapping wgmma: a regression worth failing on
            failed += 1
            print(f"SERIALIZED {label}: {info.strip().splitlines()[-1]}")
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        smem = re.search(r"(\d+) bytes smem", info)
        print(f"ok   {label:32s} regs {regs.group(1) if regs else '?':>4s}  "
              f"spill {spill.group(1) if spill else '0':>5s} B  smem {smem.group(1) if smem else '0':>6s} B  "
              f"code {code_digest(cu.with_suffix('.cubin'))}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
