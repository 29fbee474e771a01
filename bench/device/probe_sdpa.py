"""On the device (after env.sh): which fresh-prefill shapes make MLX abort.

The CUDA runner's fresh prefill attends with MLX's causal ``scaled_dot_product_attention``
over the chunk's own keys (8B shape: 32 query heads, 8 KV heads, 128 dims, fp16). A warm-up
that ran two 64-token prompts through the compiled prefill layers died with
``cudaStreamEndCapture ... failed due to a previous error during capture`` (docs/gpu.md);
one 64-token prompt had passed. Each (prompts, length, compiled) case runs here in a process
of its own, since the failure aborts the process, and prints its exit code:

    python3 bench/device/probe_sdpa.py
"""
from __future__ import annotations

import subprocess
import sys

CASE = r"""
import sys

import mlx.core as mx

B, L, comp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
H, KVH, D = 32, 8, 128
y = mx.random.normal((B * L, (H + 2 * KVH) * D)).astype(mx.float16)


def attend(y):  # as KernelRunner._prefill_attend lays out q, k, v
    q = y[:, : H * D].reshape(B, L, H, D).transpose(0, 2, 1, 3)
    k = y[:, H * D : (H + KVH) * D].reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
    v = y[:, (H + KVH) * D :].reshape(B, L, KVH, D).transpose(0, 2, 1, 3)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal")
    return o.transpose(0, 2, 1, 3).reshape(B * L, H * D)


mx.eval((mx.compile(attend) if comp else attend)(y))
print("ok")
"""
CASES = [(2, 64, 0), (2, 64, 1), (1, 64, 0), (2, 512, 0), (2, 128, 0), (4, 64, 0), (3, 64, 0), (8, 64, 0),
         (1, 128, 0), (2, 256, 0), (1, 448, 0), (4, 512, 0)]  # the most telling first


def main() -> int:
    for B, L, comp in CASES:
        try:
            r = subprocess.run([sys.executable, "-c", CASE, str(B), str(L), str(comp)], capture_output=True,
                               text=True, timeout=60)
            tail = [line for line in (r.stdout + r.stderr).strip().splitlines() if "Warn" not in line][-2:]
            print(f"prompts {B} length {L} compiled {comp}: exit {r.returncode} {tail}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"prompts {B} length {L} compiled {comp}: no answer in 60 s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
