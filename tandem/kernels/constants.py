"""How scalar parameters (a norm's eps, attention's scale and partition size) reach a kernel.

By default they travel as a small float32 input array, made once and cached. MLX's CUDA
allocator serves every array of 8 bytes or less from one pool of managed memory advised
read-mostly (``mlx/backend/cuda/allocator.cpp``: ``SmallSizePool``), and the step's own
tiny arrays live there too: at batch 1 the sampled token, its int32 copy, and any other
one-row result are GPU writes into that pool, the token's read on the host a host read.
A write to a read-mostly page collapses its copies, and the next read on the other side
waits for a page fault. Every block of every layer's kernel that reads such a parameter
can meet one. Run 86 showed what that costs where the reads are many:
``kernels.decode_block`` with its two eps values in such an array made the engine's
one-row step 4.8 ms (run 86) against 3.9 ms with the same values in the kernel's template
(run 87; the separate kernels 3.3-3.5 ms in both).

With ``TANDEM_KERNEL_CONSTS=1`` the attention kernels (scale, partition) and the
norm-fused products (eps) take the values in their template instead: the kernel reads no
memory for them. The array stays an input either way, so a kernel's signature does not
change, and with the setting off the kernels compile to what they were. Off until an
engine A/B on the GPU shows it helps (``bench/gpu_ab.py --config "" --config
"TANDEM_KERNEL_CONSTS=1"``); ``decode_block`` always takes its eps this way.
"""

from __future__ import annotations

import os
import struct

IN_TEMPLATE = os.environ.get("TANDEM_KERNEL_CONSTS", "0") == "1"


def float_bits(x: float) -> int:
    """An fp32's bits as a signed int, for a template argument (``__int_as_float`` reads it back)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def eps_template(eps: float, in_template: bool | None = None) -> list[tuple[str, int | bool]]:
    """Template arguments for a kernel whose source reads ``CONSTS ? __int_as_float(EPS_BITS)
    : fparams[0]``. Off, EPS_BITS is 0, so every eps shares one compiled kernel as before."""
    on = IN_TEMPLATE if in_template is None else in_template
    return [("CONSTS", on), ("EPS_BITS", float_bits(eps) if on else 0)]


def attention_template(scale: float, part: int,
                       in_template: bool | None = None) -> list[tuple[str, int | bool]]:
    """Template arguments for an attention kernel whose source reads ``CONSTS ? PART_C :
    params[1]`` and ``CONSTS ? __int_as_float(SCALE_BITS) : params[0]``."""
    on = IN_TEMPLATE if in_template is None else in_template
    return [("CONSTS", on), ("PART_C", part if on else 0), ("SCALE_BITS", float_bits(scale) if on else 0)]
