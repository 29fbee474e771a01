"""Block-table widths of the CUDA decode step: few shapes, so few traces and captures."""

from __future__ import annotations


def table_width(nb: int) -> int:
    """Block-table columns for a decode step whose longest row spans ``nb`` blocks: the
    next of 4, 6, 8, 12, 16, 24, ... (2^k and 3 x 2^(k-1)). The compiled step is traced
    once per table shape, and a trace of 32 layers stalls every running request for
    ~10 ms: with the exact width a decode retraced each time its longest row entered a
    new block, which made the slowest token gaps three to four times the median. Padded
    columns point at the scratch block and lie past every row's length, so no kernel
    reads them; the price is a few empty attention partitions."""
    w = 4
    while w < nb:
        w = w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3
    return w


def decode_rows(B: int) -> int:
    """The rows a decode step of ``B`` sequences runs: ``B`` up to 4, else the next of 6, 8,
    12, 16, 24, 32, 48, 64, 96, 128, ... (the widths' sequence). The compiled step is traced
    per (rows, width), so a batch that grew or shrank by one retraced (~10 ms of every running
    request's time, at every batch size serving met for the first time); with a few row classes
    the warm-up traces them all before READY. The padded rows write nowhere (slot -1), attend
    over nothing but their own token, and their logits are dropped; a step's time grows little
    with its rows (the weights are read once for all of them)."""
    return B if B <= 4 else table_width(B)


def row_classes(lo: int, hi: int) -> list[int]:
    """The row classes (:func:`decode_rows`) of batches of ``lo`` to ``hi`` sequences, ascending."""
    return sorted({decode_rows(b) for b in range(lo, hi + 1)})
