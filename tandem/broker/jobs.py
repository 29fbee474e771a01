"""One client request as the broker tracks it, from submit to its final token."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.kvtypes import SamplingParams, Usage

WAITING_SUB = "waiting_subscription"  # accepted; the client's SUB has not reached our XPUB yet
QUEUED = "queued"  # ready to dispatch, waiting for a worker with room
RUNNING = "running"
FINISHED = "finished"


@dataclass(slots=True)  # slots: one is built per request, and its fields are read on every message
class Job:
    request_id: bytes
    client: bytes  # frontend routing identity
    prompt: list[int]
    sampling: SamplingParams
    priority: int
    model: str
    arrived: float
    deadline: float  # monotonic: refuse if still not dispatched by then
    order: int  # arrival counter (FIFO within a priority)
    state: str = WAITING_SUB
    attempt: int = 0
    next_seq: int = 0
    generated: list[int] = field(default_factory=list)
    holders: set = field(default_factory=set)  # worker identities holding KV or work for it
    prefill_worker: bytes | None = None
    decode_worker: bytes | None = None
    migrations: int = 0
    excluded: set = field(default_factory=set)  # workers that refused or failed it
    resume: bool = False  # next dispatch continues from prompt + generated
    resumed_from: int = 0  # tokens generated before its last Resume (a resumed worker counts only its own)
    failed_over: bool = False  # its worker failed: it waits (failover_wait_s) for one that can continue it
    dispatched_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_prompt_tokens: int = 0
    worker_done: object = None  # a DONE that arrived before the final stream message
    worker_done_at: float | None = None
    # Stream messages that arrived ahead of a missing one (seq -> (attempt, message, raw
    # entry)): a prefill worker's first token and the decode worker's next ones reach
    # the broker over different connections, so they can arrive out of order.
    ahead: dict | None = None
    ahead_since: float = 0.0
    # SUBMIT's encoded prompt, sampling, priority and model (frames.submit_tail): a
    # DISPATCH repeats them as received instead of encoding them again.
    wire_tail: bytes | None = None
    # The client's stream topic (SUBMIT's ``stream``): its tokens go there, batched with
    # the client's other requests'; None: on the topic ``request_id``, one message each.
    stream: bytes | None = None

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.generated),
                     cached_prompt_tokens=self.cached_prompt_tokens)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.generated)
