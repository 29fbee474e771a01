"""How long ``decode_block``'s grid barrier takes, and when each block starts.

A kernel of ``blocks`` x ``threads`` runs ``n`` grid barriers and records, per block, the
global timer at its start and after each barrier. Prints the spread of block starts and
the median barrier interval, per configuration (threads, dynamic shared memory, counter size). The
first barrier's time includes the page faults of the timestamp buffer, which the host
read back after the previous launch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from tandem.kernels.cuda import decode_block as db  # noqa: E402
from tandem.kernels.cuda import w4wgmma  # noqa: E402

SRC = r"""
  auto now = []() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; };
  int* barrier = const_cast<int*>(bar);
  if (threadIdx.x == 0) ts[blockIdx.x * (NB + 1)] = now();
  for (int i = 0; i < NB; ++i) {
    tdb::grid_sync(barrier, 0);
    if (threadIdx.x == 0) ts[blockIdx.x * (NB + 1) + i + 1] = now();
  }
"""


def main() -> int:
    sms = w4wgmma.sm_count()
    out = []
    nb = 20
    smem = db.shared_bytes([(4096, 64), (14336, 224)])
    for threads, smem, blocks, words in [(512, smem, sms, 2), (512, smem, sms, 64), (512, 0, sms, 64),
                                         (512, smem, sms, 4096)]:
        k = mx.fast.cuda_kernel(name=f"tandem_barrier_probe_{threads}_{smem}", input_names=["bar"],
                                output_names=["ts"], source=SRC,
                                header=f"constexpr int THREADS = {threads};\n" + db._HEADER,
                                shared_memory=smem)
        bar = mx.zeros((words,), mx.int32)
        mx.eval(bar)
        for rep in range(3):
            (ts,) = k(inputs=[bar], template=[("NB", nb)], grid=(blocks * threads, 1, 1),
                      threadgroup=(threads, 1, 1), output_shapes=[(blocks * (nb + 1),)],
                      output_dtypes=[mx.uint64])
            t = np.array(ts).reshape(blocks, nb + 1).astype(np.int64)
        t -= t.min()
        starts = t[:, 0]
        exits = np.median(t[:, 1:], axis=0)
        row = dict(threads=threads, smem=smem, blocks=blocks, counter_words=words,
                   start_spread_us=float(starts.max() / 1e3), start_p50_us=float(np.median(starts) / 1e3),
                   first_exit_us=float(exits[0] / 1e3), barrier_us=float(np.median(np.diff(exits)) / 1e3))
        out.append(row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
