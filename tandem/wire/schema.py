"""Field specs: how each message field is packed for msgpack and checked when unpacked.

A spec's ``pack`` turns a Python value into msgpack-able data (no checks: our own
values); ``unpack`` takes whatever msgpack produced from peer bytes and either
returns a value of the declared type within its bounds or raises :class:`WireError`.
List checks use C loops (``min``/``max``/``map``), not Python ones.

Each spec also writes its check as Python source (:meth:`Spec.gen`), and
:func:`compile_unpacker` / :func:`compile_packer` turn a message's field list into one
straight-line function: the same checks as ``unpack`` without a call, a loop over
specs or an error-name string per field. The broker decodes every message it receives
that way (tests hold the two paths to the same verdict on fuzzed input).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from tandem.kvtypes import SamplingParams, TokenLogprob, Usage
from tandem.wire import protocol as P
from tandem.wire.errors import WireError


class _Src:
    """Source being generated: lines at an indent, fresh local names, constants."""

    def __init__(self):
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self._n = 0

    def var(self) -> str:
        self._n += 1
        return f"v{self._n}"

    def const(self, value) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = value
        return name

    def put(self, ind: int, line: str) -> None:
        self.lines.append("    " * ind + line)

    def fail(self, ind: int, name: str, what: str) -> None:
        """``name``: source of an expression giving the field name; ``what``: of the text."""
        self.put(ind, f"raise _fail({name}, {what})")


class Spec:
    def pack(self, value: Any) -> Any:
        return value

    def pack_src(self, src: str) -> str:
        """Source of an expression packing the value of expression ``src``."""
        return src

    def unpack(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def gen(self, g: _Src, src: str, name: str, ind: int) -> str:
        """Emit the checks of variable ``src``; return the variable holding the result.
        ``name`` is source of an expression naming the field (evaluated only on failure)."""
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

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not int:")
        g.fail(ind + 1, name, f'f"expected int, got {{type({src}).__name__}}"')
        g.put(ind, f"if not {self.lo!r} <= {src} <= {self.hi!r}:")
        g.fail(ind + 1, name, f'f"{{{src}}} outside [{self.lo}, {self.hi}]"')
        return src


class Float(Spec):
    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi

    def pack(self, value):
        return float(value)

    def pack_src(self, src):
        return f"float({src})"

    def unpack(self, value, name):
        if type(value) not in (float, int):
            raise _fail(name, f"expected float, got {type(value).__name__}")
        value = float(value)
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise _fail(name, f"{value} outside [{self.lo}, {self.hi}]")
        return value

    def gen(self, g, src, name, ind):
        out = g.var()
        g.put(ind, f"if type({src}) is float:")
        g.put(ind + 1, f"{out} = {src}")
        g.put(ind, f"elif type({src}) is int:")
        g.put(ind + 1, f"{out} = float({src})")
        g.put(ind, "else:")
        g.fail(ind + 1, name, f'f"expected float, got {{type({src}).__name__}}"')
        g.put(ind, f"if not ({self.lo!r} <= {out} <= {self.hi!r} and _isfinite({out})):")
        g.fail(ind + 1, name, f'f"{{{out}}} outside [{self.lo}, {self.hi}]"')
        return out


class Bool(Spec):
    def unpack(self, value, name):
        if type(value) is not bool:
            raise _fail(name, f"expected bool, got {type(value).__name__}")
        return value

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not bool:")
        g.fail(ind + 1, name, f'f"expected bool, got {{type({src}).__name__}}"')
        return src


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

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not str:")
        g.fail(ind + 1, name, f'f"expected str, got {{type({src}).__name__}}"')
        if self.choices is not None:
            # Every choice is within the length bounds: membership alone decides.
            assert all(self.min_chars <= len(c) <= self.max_chars for c in self.choices)
            g.put(ind, f"if {src} not in {g.const(frozenset(self.choices))}:")
            g.fail(ind + 1, name, f'f"{{{src}!r:.{self.max_chars + 2}}} is not one of {", ".join(self.choices)}"')
            return src
        g.put(ind, f"if not {self.min_chars} <= len({src}) <= {self.max_chars}:")
        g.fail(ind + 1, name, f'f"length {{len({src})}} outside [{self.min_chars}, {self.max_chars}]"')
        return src


class Address(Str):
    def __init__(self):
        super().__init__(P.ADDRESS_MAX_CHARS, min_chars=1)

    def unpack(self, value, name):
        value = super().unpack(value, name)
        if not value.startswith(P.ADDRESS_SCHEMES):
            raise _fail(name, f"address {value!r} must start with one of {', '.join(P.ADDRESS_SCHEMES)}")
        return value

    def gen(self, g, src, name, ind):
        super().gen(g, src, name, ind)
        g.put(ind, f"if not {src}.startswith({P.ADDRESS_SCHEMES!r}):")
        g.fail(ind + 1, name, f'f"address {{{src}!r}} must start with one of {", ".join(P.ADDRESS_SCHEMES)}"')
        return src


class Bytes(Spec):
    def __init__(self, exact: int | None = None, max_len: int = 1 << 16):
        self.exact, self.max_len = exact, max_len

    def pack(self, value):
        return bytes(value)

    def pack_src(self, src):
        return f"bytes({src})"

    def unpack(self, value, name):
        if type(value) is not bytes:
            raise _fail(name, f"expected bytes, got {type(value).__name__}")
        if self.exact is not None and len(value) != self.exact:
            raise _fail(name, f"expected exactly {self.exact} bytes, got {len(value)}")
        if len(value) > self.max_len:
            raise _fail(name, f"{len(value)} bytes exceeds {self.max_len}")
        return value

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not bytes:")
        g.fail(ind + 1, name, f'f"expected bytes, got {{type({src}).__name__}}"')
        if self.exact is not None:
            g.put(ind, f"if len({src}) != {self.exact}:")
            g.fail(ind + 1, name, f'f"expected exactly {self.exact} bytes, got {{len({src})}}"')
        if self.exact is None or self.exact > self.max_len:
            g.put(ind, f"if len({src}) > {self.max_len}:")
            g.fail(ind + 1, name, f'f"{{len({src})}} bytes exceeds {self.max_len}"')
        return src


class Opt(Spec):
    """None or the inner spec."""

    def __init__(self, inner: Spec):
        self.inner = inner

    def pack(self, value):
        return None if value is None else self.inner.pack(value)

    def pack_src(self, src):
        inner = self.inner.pack_src(src)
        return src if inner == src else f"(None if {src} is None else {inner})"

    def unpack(self, value, name):
        return None if value is None else self.inner.unpack(value, name)

    def gen(self, g, src, name, ind):
        out = g.var()
        g.put(ind, f"{out} = None")
        g.put(ind, f"if {src} is not None:")
        g.put(ind + 1, f"{out} = {self.inner.gen(g, src, name, ind + 1)}")
        return out


_PACK_VARS = itertools.count()


class List(Spec):
    def __init__(self, inner: Spec, max_len: int, min_len: int = 0):
        self.inner, self.max_len, self.min_len = inner, max_len, min_len

    def pack(self, value):
        return [self.inner.pack(v) for v in value]

    def pack_src(self, src):
        v = f"x{next(_PACK_VARS)}"
        inner = self.inner.pack_src(v)
        return f"list({src})" if inner == v else f"[{inner} for {v} in {src}]"

    def _check_len(self, value, name):
        if type(value) is not list:
            raise _fail(name, f"expected list, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _fail(name, f"length {len(value)} outside [{self.min_len}, {self.max_len}]")

    def _gen_len(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not list:")
        g.fail(ind + 1, name, f'f"expected list, got {{type({src}).__name__}}"')
        g.put(ind, f"if not {self.min_len} <= len({src}) <= {self.max_len}:")
        g.fail(ind + 1, name, f'f"length {{len({src})}} outside [{self.min_len}, {self.max_len}]"')

    def unpack(self, value, name):
        self._check_len(value, name)
        return [self.inner.unpack(v, f"{name}[{i}]") for i, v in enumerate(value)]

    def gen(self, g, src, name, ind):
        self._gen_len(g, src, name, ind)
        out, i, item = g.var(), g.var(), g.var()
        g.put(ind, f"{out} = []")
        g.put(ind, f"for {i}, {item} in enumerate({src}):")
        result = self.inner.gen(g, item, f'f"{{{name}}}[{{{i}}}]"', ind + 1)
        g.put(ind + 1, f"{out}.append({result})")
        return out


_INT_ONLY = frozenset((int,))


class IntList(List):
    """A list of ints in [lo, hi], checked in C loops (token ids, hashes)."""

    def __init__(self, lo: int, hi: int, max_len: int, min_len: int = 0):
        super().__init__(Int(lo, hi), max_len, min_len)
        self.lo, self.hi = lo, hi

    def pack(self, value):
        return list(value)

    def pack_src(self, src):
        return f"list({src})"

    def unpack(self, value, name):
        self._check_len(value, name)
        if value:
            # type() is exact: bools (an int subclass) are refused.
            if not _INT_ONLY.issuperset(map(type, value)):
                raise _fail(name, "expected a list of ints")
            if min(value) < self.lo or max(value) > self.hi:
                raise _fail(name, f"values outside [{self.lo}, {self.hi}]")
        return value

    def gen(self, g, src, name, ind):
        self._gen_len(g, src, name, ind)
        g.put(ind, f"if {src}:")
        g.put(ind + 1, f"if not _INT_ONLY.issuperset(map(type, {src})):")
        g.fail(ind + 2, name, '"expected a list of ints"')
        g.put(ind + 1, f"if min({src}) < {self.lo} or max({src}) > {self.hi}:")
        g.fail(ind + 2, name, f'"values outside [{self.lo}, {self.hi}]"')
        return src


REQUEST_ID = Bytes(exact=P.REQUEST_ID_BYTES)
NODE_ID = Str(P.NODE_ID_MAX_CHARS, min_chars=1)
MODEL = Str(P.MODEL_MAX_CHARS)
TEXT = Str(P.TEXT_MAX_CHARS)
TOKEN_IDS = IntList(0, P.MAX_TOKEN_ID, P.MAX_PROMPT_TOKENS)
PROMPT = IntList(0, P.MAX_TOKEN_ID, P.MAX_PROMPT_TOKENS, min_len=1)
COUNT = Int(0, P.MAX_COUNT)
TOTAL = Int(0, P.MAX_TOTAL)  # running totals (bytes moved since start): must not overflow in a long run
SEQ = Int(0, P.MAX_SEQ)
PRIORITY = Int(-P.MAX_PRIORITY, P.MAX_PRIORITY)
RETRY_AFTER = Float(0.0, P.MAX_RETRY_AFTER_S)
_TOKEN = Int(0, P.MAX_TOKEN_ID)
_LOGPROB = Float(-1e30, 0.0)
_BIAS = Float(-100.0, 100.0)


class Sampling(Spec):
    """SamplingParams as a fixed-order array; logit_bias as [[token, bias], ...]."""

    # (field, spec) in wire order; logit_bias (index 7) is checked on its own.
    FIELDS = (
        ("temperature", Float(0.0, 100.0)),
        ("top_p", Float(0.0, 1.0)),
        ("top_k", Int(0, P.MAX_TOKEN_ID)),
        ("min_p", Float(0.0, 1.0)),
        ("seed", Opt(Int(0, (1 << 64) - 1))),
        ("max_tokens", Int(1, P.MAX_NEW_TOKENS)),
        ("stop_token_ids", IntList(0, P.MAX_TOKEN_ID, P.MAX_STOP_TOKEN_IDS)),
        ("logit_bias", None),
        ("logprobs", Opt(Int(0, P.MAX_LOGPROBS))),
        ("ignore_eos", Bool()),
        # Tokens of this request's seeded stream drawn before it reached this worker
        # (a migrated request resumes its stream there). Protocol v2.
        ("seed_offset", Int(0, P.MAX_NEW_TOKENS)),
        # Penalties and the grammar (llguidance JSON text). Protocol v4.
        ("presence_penalty", Float(-2.0, 2.0)),
        ("frequency_penalty", Float(-2.0, 2.0)),
        ("repetition_penalty", Float(P.MIN_REPETITION_PENALTY, P.MAX_REPETITION_PENALTY)),
        ("grammar", Opt(Str(P.MAX_GRAMMAR_CHARS, min_chars=1))),
    )
    N = len(FIELDS)

    def pack(self, s: SamplingParams):
        return [
            float(s.temperature), float(s.top_p), int(s.top_k), float(s.min_p), s.seed,
            int(s.max_tokens), list(s.stop_token_ids),
            [[int(t), float(b)] for t, b in s.logit_bias.items()], s.logprobs, bool(s.ignore_eos),
            int(s.seed_offset), float(s.presence_penalty), float(s.frequency_penalty),
            float(s.repetition_penalty), s.grammar,
        ]

    def pack_src(self, src):
        return f"_pack_sampling({src})"

    def unpack(self, value, name):
        if type(value) is not list or len(value) != self.N:
            raise _fail(name, f"expected a {self.N}-element sampling array")
        bias = value[7]
        if type(bias) is not list or len(bias) > P.MAX_LOGIT_BIAS:
            raise _fail(name + ".logit_bias", f"expected a list of at most {P.MAX_LOGIT_BIAS} pairs")
        logit_bias = {}
        for pair in bias:
            if type(pair) is not list or len(pair) != 2:
                raise _fail(name + ".logit_bias", "expected [token, bias] pairs")
            logit_bias[_TOKEN.unpack(pair[0], name + ".logit_bias")] = _BIAS.unpack(pair[1], name + ".logit_bias")
        kw = {f: (logit_bias if spec is None else spec.unpack(v, f"{name}.{f}")) for (f, spec), v in zip(self.FIELDS, value)}
        return SamplingParams(**kw)

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not list or len({src}) != {self.N}:")
        g.fail(ind + 1, name, f'"expected a {self.N}-element sampling array"')
        items = [g.var() for _ in self.FIELDS]
        g.put(ind, f"{', '.join(items)} = {src}")
        results = []
        for (field, spec), item in zip(self.FIELDS, items):
            fname = f'{name} + ".{field}"'
            if spec is not None:
                results.append(spec.gen(g, item, fname, ind))
                continue
            bias, pair, tok, b = g.var(), g.var(), g.var(), g.var()
            g.put(ind, f"if type({item}) is not list or len({item}) > {P.MAX_LOGIT_BIAS}:")
            g.fail(ind + 1, fname, f'"expected a list of at most {P.MAX_LOGIT_BIAS} pairs"')
            g.put(ind, f"{bias} = {{}}")
            g.put(ind, f"for {pair} in {item}:")
            g.put(ind + 1, f"if type({pair}) is not list or len({pair}) != 2:")
            g.fail(ind + 2, fname, '"expected [token, bias] pairs"')
            g.put(ind + 1, f"{tok}, {b} = {pair}")
            t = _TOKEN.gen(g, tok, fname, ind + 1)
            g.put(ind + 1, f"{bias}[{t}] = {_BIAS.gen(g, b, fname, ind + 1)}")
            results.append(bias)
        out = g.var()
        g.put(ind, f"{out} = _SamplingParams({', '.join(results)})")
        return out


def _pack_sampling(s: SamplingParams) -> list:
    return _SAMPLING.pack(s)


class UsageSpec(Spec):
    _n = Int(0, P.MAX_PROMPT_TOKENS + P.MAX_NEW_TOKENS)

    def pack(self, u: Usage):
        return [int(u.prompt_tokens), int(u.completion_tokens), int(u.cached_prompt_tokens)]

    def pack_src(self, src):
        return f"[int({src}.prompt_tokens), int({src}.completion_tokens), int({src}.cached_prompt_tokens)]"

    def unpack(self, value, name):
        if type(value) is not list or len(value) != 3:
            raise _fail(name, "expected [prompt_tokens, completion_tokens, cached_prompt_tokens]")
        return Usage(*(self._n.unpack(v, name) for v in value))

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not list or len({src}) != 3:")
        g.fail(ind + 1, name, '"expected [prompt_tokens, completion_tokens, cached_prompt_tokens]"')
        parts = [g.var() for _ in range(3)]
        g.put(ind, f"{', '.join(parts)} = {src}")
        for p in parts:
            self._n.gen(g, p, name, ind)
        out = g.var()
        g.put(ind, f"{out} = _Usage({', '.join(parts)})")
        return out


class Logprobs(Spec):
    """One entry per token: [token, logprob, [[alt_token, alt_logprob], ...]]."""

    def pack(self, items: list[TokenLogprob]):
        return [[int(t.token), float(t.logprob), [[int(a), float(b)] for a, b in t.top]] for t in items]

    def pack_src(self, src):
        return f"_pack_logprobs({src})"

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

    def gen(self, g, src, name, ind):
        # Rare on the broker's path (logprobs requested): the generic checks, one call.
        return f"{g.const(self)}.unpack({src}, {name})"


_LOGPROBS = Logprobs()


def _pack_logprobs(items) -> list:
    return _LOGPROBS.pack(items)


class StreamEntry(Spec):
    """One request's share of a TOKEN_BATCH: ``[request_id, attempt, *TokenMessage fields]``,
    unpacked to ``(attempt, TokenMessage)`` by ``unpack_tokens`` (the message's own compiled
    unpacker, so an entry is held to exactly a TOKENS message's checks)."""

    _ID = Bytes(P.REQUEST_ID_BYTES)
    _ATTEMPT = Int(0, P.MAX_ATTEMPTS)

    def __init__(self, unpack_tokens, pack_tokens, n_fields: int):
        self.unpack_tokens, self.pack_tokens, self.n = unpack_tokens, pack_tokens, 2 + n_fields
        _GLOBALS["_stream_entry"] = self  # (one instance: TokenBatch's) for compiled packers

    def pack_src(self, src):
        return f"_stream_entry.pack({src})"

    def pack(self, value):
        attempt, msg = value
        return [bytes(msg.request_id), int(attempt), *self.pack_tokens(msg)]

    def unpack(self, value, name):
        if type(value) is not list or len(value) != self.n:
            raise _fail(name, f"expected a {self.n}-element stream entry")
        rid = self._ID.unpack(value[0], name)
        attempt = self._ATTEMPT.unpack(value[1], name)
        msg = self.unpack_tokens(value[2:])
        msg.request_id = rid
        if msg.logprobs is not None and len(msg.logprobs) != len(msg.tokens):
            raise _fail(name, "logprobs must have one entry per token")
        return attempt, msg

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not list or len({src}) != {self.n}:")
        g.fail(ind + 1, name, f'"expected a {self.n}-element stream entry"')
        rid, attempt, msg = g.var(), g.var(), g.var()
        g.put(ind, f"{rid} = {src}[0]")
        self._ID.gen(g, rid, name, ind)
        g.put(ind, f"{attempt} = {src}[1]")
        self._ATTEMPT.gen(g, attempt, name, ind)
        g.put(ind, f"{msg} = {g.const(self.unpack_tokens)}({src}[2:])")
        g.put(ind, f"{msg}.request_id = {rid}")
        g.put(ind, f"if {msg}.logprobs is not None and len({msg}.logprobs) != len({msg}.tokens):")
        g.fail(ind + 1, name, '"logprobs must have one entry per token"')
        return f"({attempt}, {msg})"


class AnyData(Spec):
    """Free-form stats: msgpack maps/lists/scalars; the frame-size bound limits it."""

    def unpack(self, value, name):
        if type(value) is not dict:
            raise _fail(name, "expected a map")
        return value

    def gen(self, g, src, name, ind):
        g.put(ind, f"if type({src}) is not dict:")
        g.fail(ind + 1, name, '"expected a map"')
        return src


_SAMPLING = Sampling()
_GLOBALS = dict(_fail=_fail, _isfinite=math.isfinite, _INT_ONLY=_INT_ONLY, _SamplingParams=SamplingParams,
                _Usage=Usage, _pack_sampling=_pack_sampling, _pack_logprobs=_pack_logprobs, WireError=WireError)


def _build(g: _Src, fn: str) -> Any:
    scope = dict(_GLOBALS, **g.consts)
    exec(compile("\n".join(g.lines), f"<wire {fn}>", "exec"), scope)  # noqa: S102 - our own generated source
    return scope[fn]


def compile_unpacker(cls_name: str, specs, make, *, keywords: bool = False) -> Any:
    """``unpack(body) -> message`` for a decoded msgpack array: every field's check in
    line, then ``make(*values)`` in field order (``make(field=value, ...)`` with
    ``keywords``). Raises WireError like ``Spec.unpack``."""
    g = _Src()
    n = len(specs)
    g.put(0, "def unpack(body):")
    g.put(1, f"if type(body) is not list or len(body) != {n}:")
    g.put(2, f'raise WireError("{cls_name}: expected an array of {n} fields")')
    items = [g.var() for _ in specs]
    if n:
        g.put(1, f"{', '.join(items)}{',' if n == 1 else ''} = body")
    results = [spec.gen(g, item, repr(f"{cls_name}.{field}"), 1) for (field, spec), item in zip(specs, items)]
    args = [f"{field}={r}" for (field, _), r in zip(specs, results)] if keywords else results
    g.put(1, f"return _make({', '.join(args)})")
    g.consts["_make"] = make
    return _build(g, "unpack")


def compile_packer(specs) -> Any:
    """``pack(msg) -> list``: the msgpack array of a message, as ``Spec.pack`` builds it."""
    g = _Src()
    g.put(0, "def pack(m):")
    g.put(1, f"return [{', '.join(spec.pack_src(f'm.{field}') for field, spec in specs)}]")
    return _build(g, "pack")
