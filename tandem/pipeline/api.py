"""What goes into and comes out of the engine. Plain data: workers and tests use these
without touching the engine's internals.

The engine calls ``EngineRequest.on_event`` from its own thread; the callback must
return quickly (normally ``queue.put``), because the step loop waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tandem.kvtypes import KVSnapshot, SamplingParams, TokenLogprob, Usage


class EngineRefused(Exception):
    """A submit the engine will not queue (queue full, prompt too long, ...)."""

    def __init__(self, reason: str, retry_after_s: float = 1.0):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class TokenEvent:
    """The tokens one engine step produced for one request, and how it ended if it did."""

    request_id: bytes
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    # Set on the final event of a request submitted with export_after_prefill=True.
    snapshot: KVSnapshot | None = None
    # stream_kv: the blocks one prefill chunk completed, while later chunks still run
    # (a part: see KVSnapshot.first_block); the final event's snapshot holds the rest.
    kv_part: KVSnapshot | None = None
    # Engine.reserve_kv's answer: True once the blocks are held; False when they are not
    # (or no longer: ``error`` says why), which ends nothing (the request has not started).
    kv_reserved: bool | None = None


@dataclass
class EngineRequest:
    request_id: bytes
    prompt_tokens: list[int]
    sampling: SamplingParams
    on_event: Callable[[TokenEvent], None]
    priority: int = 0  # higher runs first and is preempted last
    # Prefill role: prefill, sample the first token, then finish with a KVSnapshot
    # (finish_reason None unless the first token already ended the request) and free the blocks.
    export_after_prefill: bool = False
    # With export_after_prefill: hand out each prefill chunk's completed blocks as it
    # finishes (TokenEvent.kv_part), so they travel while the next chunk computes.
    stream_kv: bool = False


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_tokens_saved: int = 0
    tokens_per_s: float = 0.0
    step_time_ms: float = 0.0
    steps: int = 0
    # Added by the engine; zero from anything that does not fill them.
    cached_blocks: int = 0  # free blocks still holding reusable prefix KV (part of free_blocks)
    preemptions: int = 0
    prefix_hit_ratio: float = 0.0  # prefix_hits / prefix_queries
    spec_draft_tokens: int = 0  # tokens drafted for verification (speculative decoding)
    spec_accepted_tokens: int = 0  # drafted tokens the target accepted
    kv_store_bytes: int = 0  # bytes the KV store's arrays hold now (it grows up to its block budget)
    kv_mirror_bytes: int = 0  # the runner's decode mirror (ModelRunner.mirror_bytes)
    mlx_cache_bytes: int = 0  # freed arrays' memory MLX keeps for reuse (mx.get_cache_memory)
