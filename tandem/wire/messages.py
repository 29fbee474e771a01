"""Every message between client/edge, broker and workers, as a dataclass with its wire schema.

A message travels as ``[header, *payload]`` (see :mod:`tandem.wire.codec`): the header
frame is ``b"TD" + version + type`` followed by the msgpack array of the fields in the
order declared here. Only :class:`KVChunk` carries payload frames (raw array bytes).
docs/protocol.md lists the same fields with their bounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tandem.kvtypes import SamplingParams, TokenLogprob, Usage
from tandem.wire import protocol as P
from tandem.wire import schema as S
from tandem.wire.protocol import MsgType

REGISTRY: dict[int, type] = {}


def w(spec: S.Spec, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its wire spec."""
    return field(default=default, default_factory=default_factory, metadata={"wire": spec})


def message(msg_type: MsgType):
    def register(cls):
        cls = dataclass(cls)
        cls.TYPE = msg_type
        fields = dataclasses.fields(cls)
        cls.SPECS = tuple((f.name, f.metadata["wire"]) for f in fields if "wire" in f.metadata)
        # Compiled forms of the SPECS checks and packing (see schema.compile_unpacker):
        # ``unpack_fields(array) -> message`` and ``pack_fields(message) -> array``.
        positional = [f.name for f in fields[: len(cls.SPECS)]] == [name for name, _ in cls.SPECS]
        cls.unpack_fields = staticmethod(S.compile_unpacker(cls.__name__, cls.SPECS, cls, keywords=not positional))
        cls.pack_fields = staticmethod(S.compile_packer(cls.SPECS))
        assert msg_type not in REGISTRY, msg_type
        REGISTRY[msg_type] = cls
        return cls

    return register


# ---- client / edge <-> broker frontend -------------------------------------------------


@message(MsgType.SUBMIT)
class Submit:
    """Client -> broker: run this prompt. The client subscribes to ``stream`` (or
    ``request_id``) first."""

    request_id: bytes = w(S.REQUEST_ID)
    prompt: list[int] = w(S.PROMPT)
    sampling: SamplingParams = w(S.Sampling())
    priority: int = w(S.PRIORITY, 0)
    model: str = w(S.MODEL, "")
    # The client's own stream topic (P.CLIENT_STREAM_BYTES), subscribed before this SUBMIT:
    # the tokens come there in TOKEN_BATCHes. None: on the topic ``request_id``, one
    # TOKENS message each (protocol v5).
    stream: bytes | None = w(S.Opt(S.Bytes(P.CLIENT_STREAM_BYTES)), None)


@message(MsgType.ACCEPTED)
class Accepted:
    """Broker -> client: queued; tokens will arrive on the request's topic."""

    request_id: bytes = w(S.REQUEST_ID)
    queue_depth: int = w(S.COUNT, 0)


@message(MsgType.REFUSED)
class Refused:
    """Broker -> client (or worker -> broker): not taken; retry after ``retry_after_s``."""

    request_id: bytes = w(S.REQUEST_ID)
    reason: str = w(S.Str(32, P.REFUSE_REASONS))
    message: str = w(S.TEXT, "")
    retry_after_s: float = w(S.RETRY_AFTER, 1.0)


@message(MsgType.ABORT)
class Abort:
    """Client -> broker -> worker: stop this request and free its KV. Idempotent."""

    request_id: bytes = w(S.REQUEST_ID)


@message(MsgType.SUBSCRIBED)
class Subscribed:
    """Broker -> client: the broker's XPUB has seen the subscription to ``request_id``."""

    request_id: bytes = w(S.REQUEST_ID)


@message(MsgType.STATS_REQUEST)
class StatsRequest:
    verbose: bool = w(S.Bool(), False)


@message(MsgType.STATS_REPLY)
class StatsReply:
    """Free-form map; bounded by MAX_STATS_BYTES of header."""

    stats: dict = w(S.AnyData(), default_factory=dict)


@message(MsgType.DISCONNECT)
class Disconnect:
    """Any peer: I am leaving (drain finished, shutdown); forget me without waiting for heartbeats."""

    node_id: str = w(S.NODE_ID)
    reason: str = w(S.TEXT, "")


# ---- broker <-> workers ---------------------------------------------------------------


@message(MsgType.READY)
class Ready:
    """Worker -> broker on connect (and again after a broker restart)."""

    node_id: str = w(S.NODE_ID)
    role: str = w(S.Str(16, P.ROLES))
    model: str = w(S.MODEL)
    capacity: int = w(S.Int(1, P.MAX_COUNT))
    kv_address: str | None = w(S.Opt(S.Address()), None)  # decode/hybrid: where KV handoffs go
    block_size: int = w(S.Int(1, P.MAX_BLOCK_SIZE), 16)
    total_blocks: int = w(S.COUNT, 0)
    device: str | None = w(S.Opt(S.Str(64)), None)  # where its engine runs: "cpu", "gpu", "gpu 1" (CUDA_VISIBLE_DEVICES)
    # Drawn once per process: a READY under a known identity with another one is a restart.
    incarnation: int | None = w(S.Opt(S.Int(0, (1 << 63) - 1)), None)


@message(MsgType.HEARTBEAT)
class Heartbeat:
    """Worker -> broker every heartbeat interval, with its load."""

    node_id: str = w(S.NODE_ID)
    running: int = w(S.COUNT, 0)
    waiting: int = w(S.COUNT, 0)
    free_blocks: int = w(S.COUNT, 0)
    total_blocks: int = w(S.COUNT, 0)
    # Recent full-block prefix hashes (newest first), for prefix-aware routing.
    prefix_hashes: list[int] = w(S.IntList(0, (1 << 64) - 1, P.MAX_PREFIX_HASHES), default_factory=list)
    requests: list[bytes] = w(S.List(S.REQUEST_ID, P.MAX_HELD_REQUESTS), default_factory=list)
    tokens_per_s: float = w(S.Float(0.0, 1e12), 0.0)
    draining: bool = w(S.Bool(), False)
    # KV handoffs since start (protocol v2): completed ones this worker sent, their KV
    # bytes and the seconds they took (send -> decode worker's "ingested" ack), and the
    # KV bytes this worker received. The broker turns them into transfer bandwidth.
    kv_handoffs: int = w(S.TOTAL, 0)
    kv_sent_bytes: int = w(S.TOTAL, 0)
    kv_sent_s: float = w(S.Float(0.0, 1e12), 0.0)
    kv_received_bytes: int = w(S.TOTAL, 0)
    # The engine's prefix-cache lookups and hits since start (the console's hit rate).
    prefix_queries: int = w(S.TOTAL, 0)
    prefix_hits: int = w(S.TOTAL, 0)
    # Speculative decoding since start: tokens drafted for verification, and accepted.
    spec_draft_tokens: int = w(S.TOTAL, 0)
    spec_accepted_tokens: int = w(S.TOTAL, 0)
    # Bytes the engine's KV store holds now (protocol v6): it grows up to its block budget,
    # so a worker's resident memory net of it shows a leak apart from a cache filling.
    kv_store_bytes: int = w(S.TOTAL, 0)
    # Freed memory the process keeps for reuse (v6): glibc's free heap (resident memory is
    # its high-water mark by design, tandem._malloc) and MLX's buffer cache; not in use.
    heap_free_bytes: int = w(S.TOTAL, 0)
    # Bytes of the decode batch's contiguous KV copy the runner keeps between steps (v7): it
    # grows to the largest batch x context the worker has decoded, then stays.
    kv_mirror_bytes: int = w(S.TOTAL, 0)


@message(MsgType.DISPATCH)
class Dispatch:
    """Broker -> worker. ``mode`` prefill: prefill, publish the first token, hand the KV to
    ``decode_node`` at ``decode_address``; hybrid: run to completion; decode: run to
    completion too (used when only decode workers remain)."""

    request_id: bytes = w(S.REQUEST_ID)
    mode: str = w(S.Str(16, P.DISPATCH_MODES))
    prompt: list[int] = w(S.PROMPT)
    sampling: SamplingParams = w(S.Sampling())
    priority: int = w(S.PRIORITY, 0)
    model: str = w(S.MODEL, "")
    decode_node: str | None = w(S.Opt(S.NODE_ID), None)
    decode_address: str | None = w(S.Opt(S.Address()), None)
    attempt: int = w(S.Int(0, P.MAX_ATTEMPTS), 0)


@message(MsgType.RESUME)
class Resume:
    """Broker -> worker: continue a request whose worker died. The worker prefills
    ``prompt + generated`` and publishes from sequence number ``next_seq`` on, so the
    client sees no token twice and none missing."""

    request_id: bytes = w(S.REQUEST_ID)
    prompt: list[int] = w(S.PROMPT)
    generated: list[int] = w(S.TOKEN_IDS)
    next_seq: int = w(S.SEQ)
    sampling: SamplingParams = w(S.Sampling())
    priority: int = w(S.PRIORITY, 0)
    model: str = w(S.MODEL, "")
    attempt: int = w(S.Int(0, P.MAX_ATTEMPTS), 0)


@message(MsgType.DONE)
class Done:
    """Worker -> broker: this worker is finished with the request. ``finish_reason`` None
    means a prefill worker handed it off to ``handed_to`` (a decode node id)."""

    request_id: bytes = w(S.REQUEST_ID)
    finish_reason: str | None = w(S.Opt(S.Str(16, P.FINISH_REASONS)), None)
    usage: Usage | None = w(S.Opt(S.UsageSpec()), None)
    handed_to: str | None = w(S.Opt(S.NODE_ID), None)


@message(MsgType.FAILED)
class Failed:
    """Worker -> broker: the request failed here; ``retryable`` lets the broker re-dispatch."""

    request_id: bytes = w(S.REQUEST_ID)
    error: str = w(S.TEXT)
    retryable: bool = w(S.Bool(), False)


# ---- prefill worker -> decode worker: KV handoff (inside sealed frames) ----------------


@message(MsgType.KV_HEADER)
class KVHeader:
    """Everything of a KVSnapshot except the arrays, plus how the arrays travel."""

    request_id: bytes = w(S.REQUEST_ID)
    model: str = w(S.MODEL)
    block_size: int = w(S.Int(1, P.MAX_BLOCK_SIZE))
    num_layers: int = w(S.Int(1, P.MAX_LAYERS))
    num_kv_heads: int = w(S.Int(1, P.MAX_KV_HEADS))
    head_dim: int = w(S.Int(1, P.MAX_HEAD_DIM))
    dtype: str = w(S.Str(16, P.KV_DTYPES))
    tokens: list[int] = w(S.IntList(0, P.MAX_TOKEN_ID, P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS, min_len=1))
    num_computed: int = w(S.Int(0, P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS))
    prompt_len: int = w(S.Int(1, P.MAX_PROMPT_TOKENS))
    sampling: SamplingParams = w(S.Sampling())
    num_generated: int = w(S.Int(0, P.MAX_NEW_TOKENS))
    num_cached_prompt_tokens: int = w(S.Int(0, P.MAX_PROMPT_TOKENS))
    num_blocks: int = w(S.Int(0, P.MAX_KV_BLOCKS))
    compression: str = w(S.Str(8, P.KV_COMPRESSIONS), "none")
    quantization: str = w(S.Str(8, P.KV_QUANTIZATIONS), "none")
    strategy: str = w(S.Str(16, P.KV_STRATEGIES), "full")
    stream_seq: int = w(S.SEQ, 0)  # the next token-stream sequence number the decode side publishes
    priority: int = w(S.PRIORITY, 0)
    attempt: int = w(S.Int(0, P.MAX_ATTEMPTS), 0)  # the dispatch attempt the decode side publishes under
    # False: more headers follow (progressive streaming during prefill); the transfer
    # completes only once a final header has arrived and every block with it.
    final: bool = w(S.Bool(), True)


@message(MsgType.KV_CHUNK)
class KVChunk:
    """Blocks [block_start, block_end) of layers [layer_start, layer_end). Payload frames,
    per layer in order: K, V, then K scales, V scales when quantized; each LZ4-compressed
    when the header says so. ``last`` marks the final chunk of this connection's share."""

    request_id: bytes = w(S.REQUEST_ID)
    index: int = w(S.Int(0, P.MAX_KV_BLOCKS * P.MAX_LAYERS))
    layer_start: int = w(S.Int(0, P.MAX_LAYERS))
    layer_end: int = w(S.Int(1, P.MAX_LAYERS))
    block_start: int = w(S.Int(0, P.MAX_KV_BLOCKS))
    block_end: int = w(S.Int(0, P.MAX_KV_BLOCKS))
    last: bool = w(S.Bool(), False)
    frames: list = field(default_factory=list)  # payload buffers, not in the msgpack header


@message(MsgType.KV_ACK)
class KVAck:
    """Decode -> prefill. ``complete`` False: blocks reserved, send the chunks; True: all
    KV ingested, the decode worker now owns the request."""

    request_id: bytes = w(S.REQUEST_ID)
    complete: bool = w(S.Bool(), False)


@message(MsgType.KV_REFUSE)
class KVRefuse:
    """Decode -> prefill: will not take this request (at capacity, bad header, ...)."""

    request_id: bytes = w(S.REQUEST_ID)
    reason: str = w(S.Str(32, P.REFUSE_REASONS))
    message: str = w(S.TEXT, "")
    retry_after_s: float = w(S.RETRY_AFTER, 0.0)


# ---- token stream -----------------------------------------------------------------------


@message(MsgType.TOKENS)
class TokenMessage:
    """Worker -> subscribers, topic = request id. ``seq`` counts messages per request from
    0 without gaps across prefill->decode and migrations; the message with a
    ``finish_reason`` (or ``error``) is the last."""

    request_id: bytes = field(default=b"")  # the topic frame, not in the msgpack header
    seq: int = w(S.SEQ, 0)
    tokens: list[int] = w(S.IntList(0, P.MAX_TOKEN_ID, P.MAX_TOKENS_PER_STREAM_MESSAGE), default_factory=list)
    logprobs: list[TokenLogprob] | None = w(S.Opt(S.Logprobs()), None)
    finish_reason: str | None = w(S.Opt(S.Str(16, P.FINISH_REASONS)), None)
    usage: Usage | None = w(S.Opt(S.UsageSpec()), None)
    error: str | None = w(S.Opt(S.TEXT), None)


@message(MsgType.TOKEN_BATCH)
class TokenBatch:
    """Many requests' stream messages in one (protocol v5): worker -> broker on
    P.STREAM_BATCH_TOPIC, every request's tokens of an engine step; broker -> client on
    the client's stream topic. Each entry is ``(attempt, TokenMessage)`` and is judged
    exactly as a TOKENS message of its own would be (sequence number, attempt, bounds);
    clients see attempt 0."""

    entries: list = w(S.List(S.StreamEntry(TokenMessage.unpack_fields, TokenMessage.pack_fields, len(TokenMessage.SPECS)), P.MAX_STREAM_ENTRIES),
                      default_factory=list)


Message = Any  # any registered message dataclass
