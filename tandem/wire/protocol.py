"""Protocol constants: the one place that fixes message type codes, the version and every size bound.

docs/protocol.md is the specification; keep the two in step. A change that alters
what a peer sends or accepts bumps :data:`PROTOCOL_VERSION` (peers of different
versions refuse each other with a clear error instead of misreading frames).
"""

from __future__ import annotations

from enum import IntEnum

PROTOCOL_VERSION = 7

# Every header frame starts with these 4 bytes: magic, version, message type.
MAGIC = b"TD"
PREFIX_LEN = 4

REQUEST_ID_BYTES = 16  # fixed: SUB matches topics by prefix, so ids must not prefix each other
STREAM_PING_TOPIC = b"\x00" * REQUEST_ID_BYTES + b"\xff"  # worker -> broker: "my PUB reaches you", payload = node id
# Worker -> broker: a TOKEN_BATCH, every request's tokens of one engine step in one message.
# Each entry names its request and the dispatch attempt: entries of an attempt the broker
# has already given up on (a worker it declared dead but which is still talking) are
# dropped instead of corrupting the stream. Protocol v5.
STREAM_BATCH_TOPIC = b"\x00" * REQUEST_ID_BYTES + b"\xfe"
# A client process's own stream topic: it subscribes once, names it in each SUBMIT, and the
# broker sends that client's tokens there as TOKEN_BATCHes. One byte longer than a request
# id, so neither kind of topic is a prefix of the other kind. Protocol v5.
CLIENT_STREAM_BYTES = REQUEST_ID_BYTES + 1
NODE_ID_MAX_CHARS = 64
MODEL_MAX_CHARS = 256
ADDRESS_MAX_CHARS = 256
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")
TEXT_MAX_CHARS = 1024  # reasons, error messages

# Size bounds. Decoders refuse anything above these before allocating for it.
MAX_PROMPT_TOKENS = 131_072
MAX_NEW_TOKENS = 131_072
MAX_TOKEN_ID = (1 << 24) - 1  # larger than any real vocabulary
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20  # top-N alternatives per token
MAX_GRAMMAR_CHARS = 1 << 20  # a request's grammar (llguidance JSON: a schema or Lark text inside)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_TOKENS_PER_STREAM_MESSAGE = 4096
MAX_STREAM_ENTRIES = 4096  # requests in one TOKEN_BATCH (the header size bound applies too)
MAX_PREFIX_HASHES = 256  # heartbeat's bounded list of recent full-block hashes
MAX_HELD_REQUESTS = 4096  # request ids a heartbeat may list
MAX_PRIORITY = 1000  # priority in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_ATTEMPTS = 64
MAX_RETRY_AFTER_S = 3600.0
MAX_SEQ = (1 << 32) - 1
MAX_COUNT = (1 << 40)  # block counts, capacities, queue depths: generous but finite
MAX_TOTAL = (1 << 63) - 1  # running totals in heartbeats (e.g. KV bytes sent since start)

MAX_HEADER_BYTES = 4 << 20  # the msgpack frame; a maximal prompt is ~0.7 MB
MAX_FRAME_BYTES = 512 << 20  # one payload frame (a layer's K or V of a chunk)
MAX_FRAMES = 1 + 4 * 256 + 1  # header + (K, V, K scales, V scales) x 256 layers + spare
MAX_STATS_BYTES = 1 << 20

# KV geometry bounds (KV header).
MAX_LAYERS = 256
MAX_KV_HEADS = 256
MAX_HEAD_DIM = 1024
MAX_BLOCK_SIZE = 1024
MAX_KV_BLOCKS = 1 << 20
KV_DTYPES = ("float16", "bfloat16", "float32")
KV_COMPRESSIONS = ("none", "lz4")
KV_QUANTIZATIONS = ("none", "int8", "int4")
KV_STRATEGIES = ("full", "streamed", "layer_parallel")

ROLES = ("prefill", "decode", "hybrid")
DISPATCH_MODES = ("prefill", "decode", "hybrid")
FINISH_REASONS = ("stop", "length", "abort", "error")

# Reasons for Refused / KVRefuse. Free text travels in ``message``; code is for machines.
REFUSE_REASONS = (
    "busy",  # queue full
    "no_worker",  # no worker of a needed role is available
    "invalid",  # the request itself is bad (too long, unknown model, ...)
    "at_capacity",  # decode worker cannot take more KV now
    "draining",  # shutting down
    "unauthorized",
)


class MsgType(IntEnum):
    """One byte in every header frame. Gaps group the message families."""

    # client/edge <-> broker frontend
    SUBMIT = 1
    ACCEPTED = 2
    REFUSED = 3
    ABORT = 4
    SUBSCRIBED = 5
    STATS_REQUEST = 6
    STATS_REPLY = 7
    DISCONNECT = 8
    # broker <-> workers
    READY = 16
    HEARTBEAT = 17
    DISPATCH = 18
    RESUME = 19
    DONE = 20
    FAILED = 21
    # prefill worker -> decode worker (inside sealed frames)
    KV_HEADER = 32
    KV_CHUNK = 33
    KV_ACK = 34
    KV_REFUSE = 35
    # token stream (PUB/XSUB/XPUB/SUB)
    TOKENS = 48
    TOKEN_BATCH = 49  # protocol v5
    # cluster handshake and sealed frames (tandem/wire/handshake.py, sealed.py)
    HELLO = 64
    CHALLENGE = 65
    PROOF = 66
    SEALED = 67
    HANDSHAKE_ERROR = 68


def header_prefix(msg_type: int) -> bytes:
    return MAGIC + bytes((PROTOCOL_VERSION, msg_type))
