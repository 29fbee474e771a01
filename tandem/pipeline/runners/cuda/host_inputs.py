"""Step inputs made on the host (token ids, positions, slots, block tables) as MLX arrays
that the GPU can read without a page fault.

MLX 0.32.4 puts ``mx.array(numpy)`` in managed memory, and the CPU writes it. The first
kernel that reads such an array faults its pages over to the GPU:
- 196-200 us for a 512-token prompt's ids in the embedding, the first kernel of every
  prefill;
- 172 us for a decode step's state in the first layer's attention.

``MODE`` says what happens to such an array before any kernel reads it:

- ``managed`` (the mode in use): nothing, MLX's array as it is;
- ``prefetch``: its pages move to the GPU (``cuMemPrefetchAsync``). The thread waits for
  the move, a few microseconds a page.
- ``prefetch-async``: the move is queued and the thread goes on: it overlaps the building
  of the step, and a kernel that reads the array before the move is done faults as before.
- ``mapped``: its pages stay in host memory, and the GPU reads them there (preferred
  location host, accessed by the GPU). Nothing migrates either way, not even when MLX
  reuses the buffer for the next host array. The advice stays with the buffer: should
  MLX's cache hand it out later for a GPU op's output (a few KB), that output lives in
  host memory too.

On a machine without the CUDA driver every mode is ``managed``. Neither prefetching nor
mapping made a prefill or a decode step faster than leaving the array managed; the fault
that matters is avoided by the prefill's input box and the decode state's device copy.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from tandem.kernels.cuda import cuda_driver

log = logging.getLogger("tandem.engine")

MODES = ("managed", "prefetch", "prefetch-async", "mapped")
_NEEDS = {"prefetch": "cuMemPrefetchAsync_v2", "prefetch-async": "cuMemPrefetchAsync_v2",
          "mapped": "cuMemAdvise_v2"}


def parse_mode(value: str) -> str:
    if value not in MODES:
        raise ValueError(f"host inputs {value!r}: use one of {', '.join(MODES)} (default managed)")
    return value


MODE = "managed"


class _Placer:
    """Places host arrays for one mode through one driver (a stream of its own for the
    prefetches); turns itself off, with one warning, where the driver cannot."""

    def __init__(self, mode: str, drv: cuda_driver.Driver | None):
        self.mode, self.drv, self._stream = mode, drv, None
        if mode != "managed" and drv is not None and not drv.has(_NEEDS[mode]):
            log.warning("host inputs %s need %s, which this driver lacks: managed arrays instead",
                        mode, _NEEDS[mode])
            self.drv = None

    def place(self, a: mx.array) -> None:
        if self.mode == "managed" or self.drv is None or a.nbytes == 0:
            return
        # A host-made array is one managed buffer: its address is the CPU's and the GPU's.
        ptr = np.frombuffer(memoryview(a), np.uint8).ctypes.data
        drv = self.drv
        drv.bind_context()
        if self.mode.startswith("prefetch"):
            if self._stream is None:
                self._stream = drv.stream()
            drv.prefetch_to_device(ptr, a.nbytes, self._stream)
            if self.mode == "prefetch":
                # MLX's kernels are queued on its own stream after this returns: the pages are there.
                drv.call("cuStreamSynchronize", self._stream)
        else:
            drv.map_from_host(ptr, a.nbytes)


_placers: dict[str, _Placer] = {}


def array(host: np.ndarray, mode: str | None = None) -> mx.array:
    """``mx.array(host)``, placed as ``mode`` says (None: ``MODE``)."""
    mode = MODE if mode is None else mode
    a = mx.array(host)
    if mode != "managed":
        placer = _placers.get(mode)
        if placer is None:
            placer = _placers[mode] = _Placer(mode, cuda_driver.driver())
        placer.place(a)
    return a
