"""How scalar parameters (a norm's eps, attention's scale and partition size) reach a kernel.

In the kernel's template: the kernel reads no memory for them. The other way
(``IN_TEMPLATE = False``, kept for tests) passes them as a small float32 input array, made
once and cached. MLX's CUDA allocator serves every array of 8 bytes or less from one 64 KB pool of
managed memory (``mlx/backend/cuda/allocator.cpp``: ``SmallSizePool``; the 0.32.4 wheel
advises it accessed-by the GPU), and the step's own tiny arrays live there too: at batch 1
the sampled token and its int32 copy are GPU writes into that pool, the token's read on the
host a host access, every scalar Python makes a host write. A page the host touched last
is in host memory, and the GPU's read of it either crosses the bus or faults the page
back: every block of every layer's kernel that reads such a parameter can wait on that.

What it cost (H200, engine, alternating processes in one call):
- the one-launch decode attention read its scale and partition from one: 24.6-33.2 us a
  layer in the engine against 15.8 with them in the template;
- the one-row product with the rms_norm inside (``qgemv``) read its eps from one and lost
  to the norm as its own launch by ~20%; with the eps in the template it wins by ~20%.

The array stays an input either way, so a kernel's signature does not change.
"""

from __future__ import annotations

import struct

IN_TEMPLATE = True


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
