"""A fresh prefill's host-made inputs in pinned memory, copied into device memory by its first kernel.

MLX 0.32.4 puts ``mx.array(numpy)`` in managed memory, and the first kernel that reads such
an array faults its pages over to the GPU. In a one-row 512-token prefill that was
0.16-0.34 ms in the embedding (the ids) and 40-65 us more in layer 0 (positions and slots
in the KV write), of the 12.8 ms a prefill may take for 40k tok/s
(``bench/prefill_clock.py``). Prefetching or advising each array took the fault away but
cost the engine thread a driver call per array before its first hand-over, and the device
started later by as much (those modes were measured and deleted).

So the host writes the ids, slots and row ends into one of ``RING`` boxes of pinned memory
allocated once, and one kernel, the first of the step, copies them into its output (an
array the GPU writes first, as any kernel's) and fills in the positions, the same for every
prompt of a length. The step reads views of that output: MLX's graph orders the copy before
them (a buffer written in place would not be: MLX draws a graph's edges from outputs to
inputs only). No fault, no driver call, and the host's part is a few numpy writes.

A box is written again ``RING`` posts later. The engine holds at most two steps in flight
and reads one back before it launches a third, so the copy that read a box has run long
before; the kernel also copies the post's serial within the box's header once it has read
it all, and a box whose last copy has not finished is not written (``post`` returns None,
and the caller makes its own arrays). The CUDA runner uses it for every fresh prefill
(``pipeline/runners/cuda/runner.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import mlx.core as mx
import numpy as np

from tandem.kernels.cuda import kernel_files

log = logging.getLogger("tandem.engine")

RING = 4
MAX_TOKENS = 16384  # B * L of a chunk a box carries; the engine's chunks are 2,048 by default
MAX_ROWS = 256
HEADER = 5  # int32: tokens (B * L), chunk length L, rows B, the post's serial, the last serial copied
WORDS = 2 * MAX_TOKENS + MAX_ROWS  # ids, slots, row ends
THREADS = 1024
PER_THREAD = 8  # loads a thread has in flight at once: a round trip over PCIe is ~1-2 us

# Input: box (1,) uint64, the box's address (pinned host memory: the same address on the
# device under UVA). Output: out (3n + rows,) int32: ids (n), positions (n), slots (n), row
# ends (rows). One block, so that its thread 0 can say when every read of the box is done.
_SOURCE = r"""
  volatile int* hdr = reinterpret_cast<volatile int*>(box[0]);
  const int* words = reinterpret_cast<const int*>(box[0]) + HEADER;
  const int n = hdr[0], len = hdr[1], rows = hdr[2], serial = hdr[3];
  const int total = 2 * n + rows;
  for (int base = threadIdx.x; base < total; base += THREADS * PER_THREAD) {
    int v[PER_THREAD];
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
      const int i = base + k * THREADS;
      v[k] = i < total ? words[i] : 0;
    }
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
      const int i = base + k * THREADS;
      if (i < n) {
        out[i] = v[k];
        out[n + i] = i % len;
      } else if (i < total) {
        out[n + i] = v[k];  // slots from 2n, row ends from 3n
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) hdr[4] = serial;  // every read of the box is done: the host may write it
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(name="tandem_input_box", input_names=["box"],
                                    output_names=["out"], source=_SOURCE,
                                    header=f"#define HEADER {HEADER}\n#define THREADS {THREADS}\n"
                                           f"#define PER_THREAD {PER_THREAD}\n")


class PrefillInputs:
    """A fresh prefill's device arrays: ids (B, L), positions and slots (B * L,), row ends (B,)."""

    def __init__(self, ids, pos, slots, last):
        self.ids, self.pos, self.slots, self.last = ids, pos, slots, last


class _Box:
    def __init__(self, host_ptr: int, addr: mx.array):
        self.ptr, self.addr = host_ptr, addr
        self.header = (ctypes.c_int32 * HEADER).from_address(host_ptr)
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * WORDS).from_address(host_ptr + 4 * HEADER))

    def free(self) -> bool:
        return self.header[4] == self.header[3]


class InputBox:
    """``RING`` pinned boxes and the copy kernel (see the module doc).
    ``kernel``: a stand-in for the GPU's (tests on the CPU)."""

    def __init__(self, host_alloc, kernel=None):
        nbytes = 4 * (HEADER + WORDS)
        base = host_alloc(RING * nbytes)
        self._kernel = kernel
        self.boxes = []
        for i in range(RING):
            ptr = base + i * nbytes
            ctypes.memset(ptr, 0, 4 * HEADER)
            addr = mx.array(np.array([ptr], np.uint64))
            mx.eval(addr + 0)  # its one read from managed memory happens now, not in a step
            self.boxes.append(_Box(ptr, addr))
        self._next = 0
        self.posted = self.busy = 0

    @staticmethod
    def applies(B: int, L: int) -> bool:
        return 0 < B <= MAX_ROWS and 0 < L and B * L <= MAX_TOKENS

    def post(self, ids: np.ndarray, slots: np.ndarray, last: np.ndarray) -> PrefillInputs | None:
        """The device arrays of a fresh prefill from its host ids (B, L), slots (B * L) and
        row ends (B); None where the next box is still being read (make them another way)."""
        B, L = ids.shape
        n = B * L
        box = self.boxes[self._next]
        if not self.applies(B, L) or not box.free():
            self.busy += 1
            return None
        self._next = (self._next + 1) % RING
        w = box.words
        w[:n] = ids.reshape(-1)
        w[n : 2 * n] = slots
        w[2 * n : 2 * n + B] = last
        h = box.header
        h[0], h[1], h[2], h[3] = n, L, B, h[3] + 1
        kernel = self._kernel or _kernel()
        (dev,) = kernel(inputs=[box.addr], grid=(THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                        output_shapes=[(3 * n + B,)], output_dtypes=[mx.int32])
        self.posted += 1
        return PrefillInputs(dev[:n].reshape(B, L), dev[n : 2 * n], dev[2 * n : 3 * n], dev[3 * n : 3 * n + B])


def make() -> InputBox | None:
    """Boxes where the CUDA driver is there; the kernel compiled and checked once now (a first
    use mid-serving would stall every request for the NVRTC compile). None otherwise."""
    from tandem.kernels.cuda import cuda_driver
    from tandem.kernels.cuda.quantized_matmul import cuda_available

    if not cuda_available():
        return None
    drv = cuda_driver.driver()
    if drv is None:
        return None
    drv.bind_context()
    box = InputBox(drv.host_alloc)
    if not check(box):
        return None
    log.info("prefill input box: a fresh prefill's ids, slots and row ends go through pinned memory")
    return box


def check(box: InputBox) -> bool:
    """One post through every box of the ring: the arrays it gives are the host's, with the positions made."""
    ids = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    slots = np.array([3, 4, -1, 7, 8, 9], np.int32)
    last = np.array([1, 5], np.int32)
    for _ in range(RING):
        got = box.post(ids, slots, last)
        if got is None:
            mx.synchronize()
            got = box.post(ids, slots, last)
        arrays = [np.array(a) for a in (got.ids, got.pos, got.slots, got.last)] if got is not None else None
        want = [ids, np.array([0, 1, 2, 0, 1, 2], np.int32), slots, last]
        if arrays is None or not all(np.array_equal(a, b) for a, b in zip(arrays, want)):
            log.warning("prefill input box: its check read %s, not %s: off", arrays, want)
            return False
    box.posted = 0
    return True
