"""The KV byte budget: how many blocks the pool may hold (``engine.kv_cache_budget``)."""

from __future__ import annotations

import os
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
AUTO_FRACTION = 0.5  # of the memory available once the model is loaded


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"engine.kv_cache_budget={text!r}: use auto, none, or a size such as 2GiB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks(setting: str, bytes_per_block: int) -> int:
    """auto: half the available memory; none: as many as physical memory could hold
    (no guard); otherwise the given size. At least one block."""
    s = (setting or "auto").strip().lower()
    if s == "auto":
        nbytes = int(available_memory() * AUTO_FRACTION)
    elif s == "none":
        nbytes = total_memory()
    else:
        nbytes = parse_size(s)
    return max(1, nbytes // max(1, bytes_per_block))
