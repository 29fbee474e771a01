"""One request as the engine tracks it: tokens, progress, blocks."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.kvtypes import KVSnapshot, SamplingParams
from tandem.pipeline.block_pool import ROOT_HASH


_serials = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    # A streamed import whose KV is still arriving: it holds blocks reserved for all of
    # it and receives parts into them; not in the scheduler until its last part is in.
    RESERVED = "reserved"


@dataclass(eq=False)
class Sequence:
    request_id: bytes
    tokens: list[int]  # prompt followed by every token read back so far
    prompt_len: int
    sampling: SamplingParams  # always carries a seed (assigned at submit when absent)
    on_event: Callable[[Any], None]
    priority: int = 0
    arrival: int = 0
    export_after_prefill: bool = False
    stream_kv: bool = False  # with export_after_prefill: export blocks chunk by chunk
    kv_exported: int = 0  # stream_kv: leading blocks already handed out in parts
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the blocks (or queued to be written)
    num_generated: int = 0  # sampled tokens read back
    pending: int = 0  # sampled tokens not read back yet (their values live on the device)
    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks registered in the prefix cache
    last_hash: int = ROOT_HASH
    num_cached_prompt: int = 0
    hold: bool = False  # prefill role: decode no further once the first token is out
    last_tick: int = -1
    finish_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()
    imported: KVSnapshot | None = None  # KV waiting to be copied in at admission
    kv_received: int = 0  # a streamed import (RESERVED): leading blocks whose part arrived
    dense_cache: Any = None  # per-sequence mlx-lm cache when the model cannot be paged
    num_preemptions: int = 0
    serial: int = field(default_factory=lambda: next(_serials))  # unique for the process's life
    pending_index: int = -1  # row of the in-flight step's sampled tokens holding the pending one

    @property
    def num_tokens(self) -> int:
        """Tokens that exist, including sampled ones not read back yet."""
        return len(self.tokens) + self.pending

    @property
    def output_start(self) -> int:
        """Where the generated tokens begin in ``tokens``: a resumed request's prompt ends
        with the ``seed_offset`` tokens it generated before it moved here."""
        return max(0, self.prompt_len - self.sampling.seed_offset)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def can_generate(self) -> bool:
        return self.num_generated + self.pending < self.sampling.max_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.arrival)


@dataclass
class Row:
    """One sequence's share of a forward: ``n`` tokens starting at position ``start``."""

    seq: Sequence
    start: int
    n: int
    samples: bool  # whether this row's last position yields a token
    # Drafted tokens this row verifies: its inputs are the sequence's last token and then
    # these (n = 1 + len(draft)), and the step returns the logits of all n positions.
    draft: list[int] = field(default_factory=list)

    @property
    def logits(self) -> int:
        """How many of this row's last positions the forward returns logits for."""
        return 1 + len(self.draft)
