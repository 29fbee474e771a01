"""Generators of hostile wire input: mutated valid frames and structurally plausible garbage."""

from __future__ import annotations

import random

import msgpack

from tandem.wire import codec, protocol as P
from tandem.wire.messages import REGISTRY
from tests.wire.samples import STREAM, all_messages, token_batches, token_messages

VALID = [codec.encode(m) for m in all_messages()]
VALID_TOKENS = [codec.encode_tokens(m) for m in token_messages()]
VALID_BATCHES = [[STREAM, codec.pack_header(b)] for b in token_batches()]

_INTERESTING_INTS = [0, 1, -1, 2**7, 2**8, 2**15, 2**16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, P.MAX_TOKEN_ID + 1]
_INTERESTING_FLOATS = [0.0, -0.0, 1.5, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e-308]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(_INTERESTING_INTS) if rng.random() < 0.5 else rng.randrange(-1000, 100000)
    if kind == 3:
        return rng.choice(_INTERESTING_FLOATS)
    if kind == 4:
        return "".join(rng.choice("abcé\u2603\0 ") for _ in range(rng.randrange(20)))
    if kind == 5:
        return rng.randbytes(rng.choice([0, 1, 15, 16, 17, 32, 100]))
    if kind == 6:
        return rng.choice(["stop", "prefill", "decode", "hybrid", "busy", "tcp://127.0.0.1:1", "lz4", "int8", "full"])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(12))]
    if kind == 8:
        return [rng.randrange(0, 5000) for _ in range(rng.randrange(40))]
    return {random_value(rng, 3) if rng.random() < 0.3 else "k": random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def structured(rng: random.Random) -> list:
    """A valid message with a few fields replaced by random values (deep validator coverage)."""
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in rng.choice(VALID + VALID_BATCHES)]
    topic = frames[:-1] if len(frames[0]) == len(STREAM) else []  # a batch: [topic, header]
    frames = frames[len(topic):]
    head = frames[0]
    body = msgpack.unpackb(head[P.PREFIX_LEN:])
    if topic and body[0] and rng.random() < 0.7:  # inside one entry of a batch
        entry = rng.choice(body[0])
        entry[rng.randrange(len(entry))] = random_value(rng)
        return [*topic, head[: P.PREFIX_LEN] + msgpack.packb(body, use_bin_type=True)]
    for _ in range(rng.randrange(1, 3)):
        if body and rng.random() < 0.9:
            body[rng.randrange(len(body))] = random_value(rng)
        elif rng.random() < 0.5:
            body.append(random_value(rng))
        elif body:
            body.pop()
    if rng.random() < 0.2:
        head = P.header_prefix(rng.choice(list(REGISTRY))) + head[P.PREFIX_LEN:]
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # the generator made something msgpack cannot hold
        packed = b"\xc1"
    return [*topic, head[: P.PREFIX_LEN] + packed, *frames[1:]]


def mutated(rng: random.Random, source: list | None = None) -> list:
    """A valid message with bytes flipped, inserted, deleted, or frames dropped/duplicated."""
    frames = [bytearray(bytes(f)) for f in (source or rng.choice(VALID + VALID_TOKENS + VALID_BATCHES))]
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        f = frames[rng.randrange(len(frames))] if frames else None
        if op == 0 and f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif op == 1 and f:
            f[rng.randrange(len(f))] = rng.choice([0x00, 0xC1, 0xDD, 0xDF, 0xC6, 0xFF, 0x7F, 0x90])
        elif op == 2 and f is not None:
            pos = rng.randrange(len(f) + 1)
            f[pos:pos] = rng.randbytes(rng.randrange(1, 8))
        elif op == 3 and f:
            del f[rng.randrange(len(f)) :]
        elif op == 4 and frames:
            frames.pop(rng.randrange(len(frames)))
        else:
            frames.append(bytearray(rng.randbytes(rng.randrange(30))))
    return [bytes(f) for f in frames]


def garbage(rng: random.Random) -> list:
    frames = [rng.randbytes(rng.randrange(64)) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.5:
        frames[0] = P.header_prefix(rng.choice(list(REGISTRY))) + frames[0]
    return frames
