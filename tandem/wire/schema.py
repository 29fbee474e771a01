"""Field specs: how each message field is packed for msgpack and checked when unpacked.

A spec's ``pack`` turns a Python value into msgpack-able data (no checks: our own
values); ``unpack`` takes whatever msgpack produced from peer bytes and either
returns a value of the declared type within its bounds or raises :class:`WireError`.
List checks use ``min``/``max``/``all`` so long token lists cost C loops, not Python ones.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import TokenLogprob, Usage
from tandem.wire import protocol as P
from tandem.wire.errors import WireError


class Spec:
    def pack(self, value: Any) -> Any:
        return value

    def unpack(self, value: Any, name: str) -> Any:
        raise NotImplementedError


def _fail(name: str, what: str) -> WireError:
    return WireError(f"field {name!r}: {what}")


class Int(Spec):
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def unpack(self, value, name):
        if type(value) is not int:
            raise _fail(name, f"expected int, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise _fail(name, f"{value} outside [{self.lo}, {self.hi}]")
        return value


class Float(Spec):
    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi

    def pack(self, value):
        return float(value)

    def unpack(self, value, name):
        if type(value) not in (float, int):
            raise _fail(name, f"expected float, got {type(value).__name__}")
        value = float(value)
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise _fail(name, f"{value} outside [{self.lo}, {self.hi}]")
        return value


class Bool(Spec):
    def unpack(self, value, name):
        if type(value) is not bool:
            raise _fail(name, f"expected bool, got {type(value).__name__}")
        return value


class Str(Spec):
    def __init__(self, max_chars: int, choices: tuple[str, ...] | None = None, min_chars: int = 0):
        self.max_chars, self.choices, self.min_chars = max_chars, choices, min_chars

    def unpack(self, value, name):
        if type(value) is not str:
            raise _fail(name, f"expected str, got {type(value).__name__}")
        if not self.min_chars <= len(value) <= self.max_chars:
            raise _fail(name, f"length {len(value)} outside [{self.min_chars}, {self.max_chars}]")
        if self.choices is not None and value not in self.choices:
            raise _fail(name, f"{value!r} is not one of {', '.join(self.choices)}")
        return value


class Address(Str):
    def __init__(self):
        super().__init__(P.ADDRESS_MAX_CHARS, min_chars=1)

    def unpack(self, value, name):
        value = super().unpack(value, name)
        if not value.startswith(P.ADDRESS_SCHEMES):
            raise _fail(name, f"address {value!r} must start with one of {', '.join(P.ADDRESS_SCHEMES)}")
        return value


class Bytes(Spec):
    def __init__(self, exact: int | None = None, max_len: int = 1 << 16):
        self.exact, self.max_len = exact, max_len

    def pack(self, value):
        return bytes(value)

    def unpack(self, value, name):
        if type(value) is not bytes:
            raise _fail(name, f"expected bytes, got {type(value).__name__}")
        if self.exact is not None and len(value) != self.exact:
            raise _fail(name, f"expected exactly {self.exact} bytes, got {len(value)}")
        if len(value) > self.max_len:
            raise _fail(name, f"{len(value)} bytes exceeds {self.max_len}")
        return value


class Opt(Spec):
    """None or the inner spec."""

    def __init__(self, inner: Spec):
        self.inner = inner

    def pack(self, value):
        return None if value is None else self.inner.pack(value)

    def unpack(self, value, name):
        return None if value is None else self.inner.unpack(value, name)


class List(Spec):
    def __init__(self, inner: Spec, max_len: int, min_len: int = 0):
        self.inner, self.max_len, self.min_len = inner, max_len, min_len

    def pack(self, value):
        return [self.inner.pack(v) for v in value]

    def _check_len(self, value, name):
        if type(value) is not list:
            raise _fail(name, f"expected list, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _fail(name, f"length {len(value)} outside [{self.min_len}, {self.max_len}]")

    def unpack(self, value, name):
        self._check_len(value, name)
        return [self.inner.unpack(v, f"{name}[{i}]") for i, v in enumerate(value)]


class IntList(List):
    """A list of ints in [lo, hi], checked in C loops (token ids, hashes)."""

    def __init__(self, lo: int, hi: int, max_len: int, min_len: int = 0):
        super().__init__(Int(lo, hi), max_len, min_len)
        self.lo, self.hi = lo, hi

    def pack(self, value):
        return list(value)

    def unpack(self, value, name):
        self._check_len(value, name)
        if value:
            if not all(type(v) is int for v in value):
                raise _fail(name, "expected a list of ints")
            if min(value) < self.lo or max(value) > self.hi:
                raise _fail(name, f"values outside [{self.lo}, {self.hi}]")
        return value


REQUEST_ID = Bytes(exact=P.REQUEST_ID_BYTES)
NODE_ID = Str(P.NODE_ID_MAX_CHARS, min_chars=1)
MODEL = Str(P.MODEL_MAX_CHARS)
TEXT = Str(P.TEXT_MAX_CHARS)
TOKEN_IDS = IntList(0, P.MAX_TOKEN_ID, P.MAX_PROMPT_TOKENS)
PROMPT = IntList(0, P.MAX_TOKEN_ID, P.MAX_PROMPT_TOKENS, min_len=1)
COUNT = Int(0, P.MAX_COUNT)
SEQ = Int(0, P.MAX_SEQ)
PRIORITY = Int(-P.MAX_PRIORITY, P.MAX_PRIORITY)
RETRY_AFTER = Float(0.0, P.MAX_RETRY_AFTER_S)
_TOKEN = Int(0, P.MAX_TOKEN_ID)
_LOGPROB = Float(-1e30, 0.0)


class Sampling(Spec):
    """SamplingParams as a fixed-order array; logit_bias as [[token, bias], ...]."""

    _stop = IntList(0, P.MAX_TOKEN_ID, P.MAX_STOP_TOKEN_IDS)

    def pack(self, s: SamplingParams):
        return [
            float(s.temperature), float(s.top_p), int(s.top_k), float(s.min_p), s.seed,
            int(s.max_tokens), list(s.stop_token_ids),
            [[int(t), float(b)] for t, b in s.logit_bias.items()], s.logprobs, bool(s.ignore_eos),
        ]

    def unpack(self, value, name):
        if type(value) is not list or len(value) != 10:
            raise _fail(name, "expected a 10-element sampling array")
        bias = value[7]
        if type(bias) is not list or len(bias) > P.MAX_LOGIT_BIAS:
            raise _fail(name + ".logit_bias", f"expected a list of at most {P.MAX_LOGIT_BIAS} pairs")
        logit_bias = {}
        for pair in bias:
            if type(pair) is not list or len(pair) != 2:
                raise _fail(name + ".logit_bias", "expected [token, bias] pairs")
            logit_bias[_TOKEN.unpack(pair[0], name + ".logit_bias")] = Float(-100.0, 100.0).unpack(pair[1], name + ".logit_bias")
        return SamplingParams(
            temperature=Float(0.0, 100.0).unpack(value[0], name + ".temperature"),
            top_p=Float(0.0, 1.0).unpack(value[1], name + ".top_p"),
            top_k=Int(0, P.MAX_TOKEN_ID).unpack(value[2], name + ".top_k"),
            min_p=Float(0.0, 1.0).unpack(value[3], name + ".min_p"),
            seed=Opt(Int(0, (1 << 64) - 1)).unpack(value[4], name + ".seed"),
            max_tokens=Int(1, P.MAX_NEW_TOKENS).unpack(value[5], name + ".max_tokens"),
            stop_token_ids=self._stop.unpack(value[6], name + ".stop_token_ids"),
            logit_bias=logit_bias,
            logprobs=Opt(Int(0, P.MAX_LOGPROBS)).unpack(value[8], name + ".logprobs"),
            ignore_eos=Bool().unpack(value[9], name + ".ignore_eos"),
        )


class UsageSpec(Spec):
    def pack(self, u: Usage):
        return [int(u.prompt_tokens), int(u.completion_tokens), int(u.cached_prompt_tokens)]

    def unpack(self, value, name):
        if type(value) is not list or len(value) != 3:
            raise _fail(name, "expected [prompt_tokens, completion_tokens, cached_prompt_tokens]")
        n = Int(0, P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS)
        return Usage(*(n.unpack(v, name) for v in value))


class Logprobs(Spec):
    """One entry per token: [token, logprob, [[alt_token, alt_logprob], ...]]."""

    def pack(self, items: list[TokenLogprob]):
        return [[int(t.token), float(t.logprob), [[int(a), float(b)] for a, b in t.top]] for t in items]

    def unpack(self, value, name):
        if type(value) is not list or len(value) > P.MAX_TOKENS_PER_STREAM_MESSAGE:
            raise _fail(name, "expected a bounded list")
        out = []
        for item in value:
            if type(item) is not list or len(item) != 3 or type(item[2]) is not list or len(item[2]) > P.MAX_LOGPROBS:
                raise _fail(name, "expected [token, logprob, [[token, logprob], ...]] entries")
            top = []
            for alt in item[2]:
                if type(alt) is not list or len(alt) != 2:
                    raise _fail(name, "expected [token, logprob] alternatives")
                top.append((_TOKEN.unpack(alt[0], name), _LOGPROB.unpack(alt[1], name)))
            out.append(TokenLogprob(_TOKEN.unpack(item[0], name), _LOGPROB.unpack(item[1], name), top))
        return out


class AnyData(Spec):
    """Free-form stats: msgpack maps/lists/scalars; the frame-size bound limits it."""

    def unpack(self, value, name):
        if type(value) is not dict:
            raise _fail(name, "expected a map")
        return value
