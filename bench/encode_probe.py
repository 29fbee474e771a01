"""What MLX's host side costs per op on CUDA: a chain of N ops built, handed to
``mx.async_eval`` (MLX encodes them into CUDA graphs on this thread) and waited for.

At batch 1 the engine thread, not the GPU, sets the decode step (H200 run 88: 1.87 ms of
encoding and 0.60 of graph building a step, 0.05 waiting), ~11 us an op. This prints, per
kind of op, the microseconds an op spends in building, in encoding and in all, so the
engine's step can be shaped around what costs: the kernel's inputs, its outputs, the
shapes its source reads, host-made inputs, five kernels in turn, views, built-in ops, a
compiled replay, and whether encoding waits on a device that is behind (ops of 15 us of GPU
time each, a chain encoded while the previous one runs)::

    python bench/encode_probe.py --ops 160 --rounds 30 --out $OUT/encode

Every row is the median of ``--rounds`` chains. CPU runs (no CUDA) time MLX's CPU ops only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

N = 4096


def _spin_kernel(spin_us: int):
    # ~spin_us of GPU time an op (clock64 at ~1.98 GHz), so the device falls behind the host.
    body = (f"  const long long t0 = clock64();\n  while (clock64() - t0 < {spin_us} * 1980LL) {{}}\n"
            f"  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < {N}) y[i] = x0[i];\n")
    return mx.fast.cuda_kernel(name=f"probe_spin_{spin_us}", input_names=["x0"], output_names=["y"],
                               source=body, ensure_row_contiguous=False)


def _copy_kernel(n_inputs: int, reads_shape: bool):
    # Reads only the first input: what MLX does with the others is the cost measured.
    body = "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    body += "  if (i < x0_shape[0]) y[i] = x0[i];\n" if reads_shape else f"  if (i < {N}) y[i] = x0[i];\n"
    return mx.fast.cuda_kernel(name=f"probe_copy_{n_inputs}_{int(reads_shape)}",
                               input_names=[f"x{i}" for i in range(n_inputs)], output_names=["y"],
                               source=body, ensure_row_contiguous=False)


def chains(ops: int, host: list) -> dict[str, callable]:
    """name -> f(x, extras) building a chain of ``ops`` ops from x."""
    cuda = mx.cuda.is_available()
    out: dict[str, callable] = {}

    def kernel_chain(n_inputs, reads_shape=False, others_from="device"):
        """others_from: the extra inputs are device arrays, 2-byte ones, or made on the host."""
        k = _copy_kernel(n_inputs, reads_shape)

        def build(x, extras, tiny):
            others = {"device": extras, "tiny": tiny, "host": host}[others_from][: n_inputs - 1]
            for _ in range(ops):
                (x,) = k(inputs=[x, *others], grid=(N, 1, 1), threadgroup=(256, 1, 1),
                         output_shapes=[(N,)], output_dtypes=[mx.float16])
            return x
        return build

    if cuda:
        out["kernel, 1 input"] = kernel_chain(1)
        out["kernel, 4 inputs"] = kernel_chain(4)
        out["kernel, 8 inputs"] = kernel_chain(8)
        out["kernel, 8 inputs, 7 of them 2-byte arrays"] = kernel_chain(8, others_from="tiny")
        out["kernel, 1 input, source reads its shape"] = kernel_chain(1, True)
        out["kernel, 8 inputs, 7 of them host-made (managed) arrays"] = kernel_chain(8, others_from="host")

        def distinct(x, extras, tiny):
            # Five kernels in turn, as a layer's are: commits of 20 ops repeat one topology.
            ks = [_copy_kernel(n, False) for n in (2, 3, 5, 6, 7)]
            for i in range(ops):
                n = (2, 3, 5, 6, 7)[i % 5]
                (x,) = ks[i % 5](inputs=[x, *extras[: n - 1]], grid=(N, 1, 1), threadgroup=(256, 1, 1),
                                 output_shapes=[(N,)], output_dtypes=[mx.float16])
            return x
        out["five kernels in turn, 2-7 inputs"] = distinct

        spin = _spin_kernel(15)

        def spinning(x, extras, tiny):
            for _ in range(ops):
                (x,) = spin(inputs=[x], grid=(N, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[(N,)], output_dtypes=[mx.float16])
            return x
        out["kernel of 15 us GPU time, 1 input"] = spinning
        out["kernel of 15 us GPU time, queued behind the previous chain"] = spinning

    def add_chain(x, extras, tiny):
        for _ in range(ops):
            x = x + extras[0]
        return x
    out["built-in add"] = add_chain

    def view_chain(x, extras, tiny):
        for _ in range(ops):
            x = x.reshape(64, N // 64).reshape(N)
        return x + 0  # one real op, so the chain is evaluated
    out["reshape (views), 2 an op"] = view_chain
    return out


def measure(build, ops: int, rounds: int, compiled: bool, behind: bool = False) -> dict[str, float]:
    """behind: each timed chain is built and encoded while the previous one still runs on
    the GPU (as the engine queues step N+1 before reading step N)."""
    x = mx.random.normal((N,)).astype(mx.float16)
    extras = [mx.random.normal((N,)).astype(mx.float16) for _ in range(8)]
    tiny = [mx.zeros((1,), mx.float16) for _ in range(8)]
    mx.eval(x, *extras, *tiny)
    fn = mx.compile(lambda a, *e: build(a, list(e[:8]), list(e[8:]))) if compiled else \
        (lambda a, *e: build(a, list(e[:8]), list(e[8:])))
    b_t, e_t, w_t = [], [], []
    for i in range(rounds + 3):
        mx.synchronize()
        if behind:
            mx.async_eval(fn(x, *extras, *tiny))
        t0 = time.perf_counter()
        y = fn(x, *extras, *tiny)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        if i >= 3:  # the first calls trace and compile
            b_t.append(t1 - t0)
            e_t.append(t2 - t1)
            w_t.append(t3 - t0)
    us = 1e6 / ops
    return {"build_us_per_op": statistics.median(b_t) * us, "encode_us_per_op": statistics.median(e_t) * us,
            "total_us_per_op": statistics.median(w_t) * us}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    print(f"{args.ops} ops a chain, median of {args.rounds}; device {mx.default_device()}")
    print("| op | compiled | build us/op | encode us/op | all us/op |\n|---|---|---|---|---|")
    host = [mx.array(np.random.standard_normal(N).astype(np.float16)) for _ in range(8)]
    for name, build in chains(args.ops, host).items():
        for compiled in (False, True):
            behind = "queued behind" in name
            r = {"op": name, "compiled": compiled, **measure(build, args.ops, args.rounds, compiled, behind)}
            rows.append(r)
            print(f"| {name} | {'yes' if compiled else 'no'} | {r['build_us_per_op']:.2f} | "
                  f"{r['encode_us_per_op']:.2f} | {r['total_us_per_op']:.2f} |", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "encode_probe.json").write_text(json.dumps({"ops": args.ops, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
