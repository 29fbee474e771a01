"""A step's greedy tokens written by the GPU into pinned host memory, where the engine reads them.

MLX waits for a step through a CUDA event made with ``cudaEventBlockingSync``: the engine
thread sleeps in the driver and is woken after the device is done, and reading the tokens
back then copies them to host memory. For a step the engine waits for alone (a prefill:
nothing is queued behind it) that is latency on every request's first token: 0.17-0.38 ms
from the sampled token existing on the device to the engine's read-back ending, of a
12.8 ms prefill at one row (``bench/prefill_clock.py``).

So after the step's token kernel, one more kernel copies the tokens into a pinned box and
then raises the box's flag (``__threadfence_system`` between, so the flag never shows
before the tokens). The engine first waits, MLX's way, for an array a few layers before
the end (the runner's checkpoint): the wake-up after that wait overlaps the last layers.
Then it spins on the flag, giving up the GIL between reads, for at most ``SPIN_S``;
after that, or if the box is never filled, it falls back to MLX's wait and read.

Boxes are a ring of ``RING``; each has its own device-resident array holding its address,
so posting uploads nothing (a host-made array would be managed memory the GPU faults in).
The read-back ends ~0.1 ms after the token kernel against 0.2-0.3 without the box, in
every process; prefill throughput moved within the processes' spread.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time

import mlx.core as mx
import numpy as np

from tandem.kernels.cuda import kernel_files

log = logging.getLogger("tandem.engine")

MAX_ROWS = 256
RING = 4  # the engine has at most two steps in flight
SPIN_S = 0.020
THREADS = 256

# Box layout, int32: [flag, count, tokens...]. Inputs: tokens (n,) int32; box (1,) uint64,
# the box's address (pinned host memory, the same address on the device under UVA).
_SOURCE = r"""
  const int n = tokens_shape[0];
  volatile int* mb = reinterpret_cast<volatile int*>(box[0]);
  for (int i = threadIdx.x; i < n; i += blockDim.x) mb[2 + i] = tokens[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    mb[1] = n;
    __threadfence_system();
    mb[0] = 1;
    done[0] = n;
  }
"""


@functools.cache
def _kernel():
    return kernel_files.cuda_kernel(name="tandem_token_mailbox", input_names=["tokens", "box"],
                                    output_names=["done"], source=_SOURCE)


class Ticket:
    """One posted step: ``wait`` returns its tokens, or None where the box gave up (the
    caller then reads the tokens MLX's way)."""

    def __init__(self, box: "_Box", n: int, checkpoint: mx.array | None):
        self.box, self.n, self.checkpoint = box, n, checkpoint

    def wait(self, spin_s: float | None = None) -> list[int] | None:
        spin_s = SPIN_S if spin_s is None else spin_s
        if self.checkpoint is not None:
            mx.eval(self.checkpoint)
            self.checkpoint = None
        box = self.box
        deadline = time.perf_counter() + spin_s
        while box.flag() == 0:
            if time.perf_counter() > deadline:
                return None
            time.sleep(0)  # the GIL, for the process's IO threads
        return box.read(self.n)


class _Box:
    def __init__(self, host_ptr: int, addr: mx.array):
        self.ptr, self.addr = host_ptr, addr
        self._words = (ctypes.c_int32 * (2 + MAX_ROWS)).from_address(host_ptr)

    def flag(self) -> int:
        return self._words[0]

    def reset(self) -> None:
        self._words[0] = 0

    def read(self, n: int) -> list[int] | None:
        if self._words[1] != n:
            return None
        return list(self._words[2 : 2 + n])


class TokenMailbox:
    """``RING`` pinned boxes and the kernel that fills them (see the module doc)."""

    def __init__(self, host_alloc, kernel=None):
        nbytes = 4 * (2 + MAX_ROWS)
        base = host_alloc(RING * nbytes)
        self._kernel = kernel
        self.boxes = []
        for i in range(RING):
            ptr = base + i * nbytes
            addr = mx.array(np.array([ptr], np.uint64))
            mx.eval(addr + 0)  # its one read from managed memory happens now, not in a step
            self.boxes.append(_Box(ptr, addr))
        self._next = 0
        self.posted = self.spun = self.fell_back = 0

    def applies(self, tokens: mx.array) -> bool:
        return tokens.ndim == 1 and 0 < tokens.shape[0] <= MAX_ROWS and tokens.dtype == mx.int32

    def read(self, ticket: Ticket) -> list[int] | None:
        """The ticket's tokens, or None: read them MLX's way (counted either way)."""
        got = ticket.wait()
        if got is None:
            self.fell_back += 1
        else:
            self.spun += 1
        return got

    def post(self, tokens: mx.array, checkpoint: mx.array | None) -> tuple[Ticket, mx.array]:
        """A ticket for ``tokens`` and the array that fills its box: evaluate that with the step."""
        box = self.boxes[self._next]
        self._next = (self._next + 1) % RING
        box.reset()
        kernel = self._kernel or _kernel()
        (done,) = kernel(inputs=[tokens, box.addr], grid=(THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                         output_shapes=[(1,)], output_dtypes=[mx.int32])
        self.posted += 1
        return Ticket(box, tokens.shape[0], checkpoint), done


def make() -> TokenMailbox | None:
    """A mailbox where the CUDA driver is there; its kernel is compiled and checked once now (a first use mid-serving would stall every
    request for the NVRTC compile)."""
    from tandem.kernels.cuda import cuda_driver
    from tandem.kernels.cuda.quantized_matmul import cuda_available

    if not cuda_available():
        return None
    drv = cuda_driver.driver()
    if drv is None:
        return None
    drv.bind_context()
    box = TokenMailbox(drv.host_alloc)
    want = mx.array(np.arange(3, dtype=np.int32) + 7)
    ticket, done = box.post(want, None)
    mx.eval(done)
    got = ticket.wait(spin_s=1.0)
    if got != [7, 8, 9]:
        log.warning("token mailbox: its check read %s, not [7, 8, 9]: off", got)
        return None
    log.info("token mailbox: a prefill's greedy tokens are read from pinned memory")
    return box
