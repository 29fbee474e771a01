"""Speculative decoding inside the continuous batch: how many tokens each row drafts, and
what its verification accepts.

A decode row that drafts ``k`` tokens feeds its last token and the ``k`` drafts in one
forward (``Row.draft``; the runner returns the logits of all ``k + 1`` positions), in the
same step as every other row of the batch. The engine picks a token at each position
exactly as it would without speculation (the sampler, the request's seeded key for that
token's index, its penalties over the tokens before that position) and accepts the
drafts up to the first one that differs from the pick; the pick there (or after the last
draft, when all match) is the step's last token. Drafts are point proposals (q = one
token), for which the rejection-sampling rule (accept x with probability min(1, p(x)/q(x))
= p(x), else draw from p without x) is exactly this coupling: the pick equals x with
probability p(x), and otherwise is distributed as p restricted to the other tokens. So the
output's distribution is the target's at any temperature, and with the same seed the
output is the one a run without speculation yields, token for token; a migrated request
continues exactly with nothing more than the tokens and the seed.

After verification a row keeps the KV of its last token and its accepted drafts; the
rejected positions' entries sit past the sequence's computed length, where the next steps
overwrite them and nothing reads them. Full blocks enter the prefix cache only up to the
computed length, so only accepted tokens are ever registered.

Policy (:meth:`Speculator.plan`): what a step of ``P`` positions (rows plus drafted tokens)
costs is measured (:class:`StepTimes`: a table over ``P`` that every decode step updates);
a row whose drafts are accepted at rate ``a`` (a moving average over its verifications)
gains ``a^(k+1)`` expected tokens from its (k+1)-th draft. Draft tokens are taken best gain
first, as many as give the step the most tokens per second: so a lone sequence, whose step
is cheap next to its tokens, drafts whenever ``a`` is high enough to pay for the dearer
step, and a wide batch, compute-bound already, drafts only where many sure tokens fill a
tile of positions, or not at all. A row whose rate fell below what its first draft costs
(``v``, in one-row steps) has its rate raised just above it (``2 v``, at most halfway to 1)
after ``retry_steps`` steps without drafting, so a lone sequence whose text turns
repetitive later starts again (with one token). With a drafter that costs nothing (prompt
lookup) a row that does not draft still learns its rate from a proposal it does not verify.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from tandem.pipeline.drafters import Drafter, ModelDrafter, NgramDrafter, parameter_ratio
from tandem.pipeline.sequence import Row, Sequence
from tandem.pipeline.settings import SpeculativeSettings

log = logging.getLogger("tandem.engine")


@dataclass
class SpecState:
    """One sequence's drafting record."""

    rate: float = 0.6  # moving average of the share of drafted tokens accepted
    idle: int = 0  # steps since it last drafted
    shadow: tuple[int, int] | None = None  # (index in its tokens, the token a free drafter proposed there)


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class StepTimes:
    """What a decode step of ``P`` positions (its rows plus their drafted tokens) takes,
    measured: a moving average per ``P`` over the steps the engine times (launch to
    read-back), every decode step counted, drafting or not, so the widths a server passes
    through fill the table for free. Between measured sizes it interpolates; past the
    largest it goes on at the slope of the two largest (or, with one measured, ``prior`` of
    it per position: optimistic, so drafting there is tried and then known).

    Per position, because a drafted position costs what a row does at the same ``P``; a
    table, not a line, because the cost jumps with ``P``: on the CPU one position runs
    kernels of its own and the products take positions 8 to a tile, so the first position
    past a tile costs several of the ones that follow. A fixed cost, and lines fitted to the
    steps, both mispriced wide batches, which drafted and lost (docs/engine.md).
    :meth:`forget` drops what was measured (a worker's warm-up steps pay first-use costs).
    ``measured=False`` keeps ``1 + prior (P - 1)`` one-row steps (tests of the policy)."""

    def __init__(self, prior: float = 0.1, *, smoothing: float = 0.2, measured: bool = True):
        self.prior, self.smoothing, self.measured = prior, smoothing, measured
        self.forget()

    def forget(self) -> None:
        self._t: dict[int, float] = {}
        self._keys: list[int] = []

    def observe(self, positions: int, seconds: float) -> None:
        if not self.measured or positions < 1 or seconds <= 0:
            return
        old = self._t.get(positions)
        if old is None:
            self._t[positions] = seconds
            self._keys = sorted(self._t)
        else:
            self._t[positions] = old + self.smoothing * (seconds - old)

    def at(self, positions: int) -> float:
        """Seconds for a step of ``positions`` (one-row steps before any was measured)."""
        t, keys = self._t, self._keys
        if not keys:
            return 1.0 + self.prior * (positions - 1)
        if positions in t:
            return t[positions]
        hi = next((k for k in keys if k > positions), None)
        lo = next((k for k in reversed(keys) if k < positions), None)
        if lo is None:  # below every size measured: in proportion
            return t[hi] * positions / hi
        if hi is not None:
            return t[lo] + (t[hi] - t[lo]) * (positions - lo) / (hi - lo)
        if len(keys) > 1:
            k1, k2 = keys[-2], keys[-1]
            slope = max((t[k2] - t[k1]) / (k2 - k1), 0.0)
        else:
            slope = self.prior * t[lo]
        return t[lo] + slope * (positions - lo)


class Speculator:
    def __init__(self, drafter: Drafter, *, max_draft: int = 4, retry_steps: int = 16, smoothing: float = 0.3,
                 times: StepTimes | None = None):
        self.drafter = drafter
        self.max_draft = max_draft
        self.retry_steps = retry_steps
        self.smoothing = smoothing
        self.times = times if times is not None else StepTimes()
        self._draft_s: float | None = None  # moving average of a proposed token's seconds
        self.counters = SpecCounters()
        self._state: dict[int, SpecState] = {}

    # ---- policy ---------------------------------------------------------------------
    @property
    def position_cost(self) -> float:
        """What a lone sequence's first drafted token adds to its step, in one-row steps:
        the second position and the drafter's work for it, both measured."""
        one = self.times.at(1)
        return (self.times.at(2) - one + self.drafting_s()) / one

    def drafting_s(self) -> float:
        """What proposing one token costs the engine thread (measured; before that, a model
        drafter's share of the target's parameters, of a one-row step)."""
        return self._draft_s if self._draft_s is not None else self.drafter.cost * self.times.at(1)

    def observe(self, rows: list[Row], seconds: float) -> None:
        """The engine timed a decode step of these rows (launch to read-back)."""
        self.times.observe(sum(r.n for r in rows), seconds)

    def eligible(self, seq: Sequence) -> bool:
        """Rows that may draft: every token read back (the drafter sees them all), not a
        prefill-role row, and no grammar (its mask at each drafted position would need
        the grammar advanced through the drafts first: those rows decode one token a step)."""
        return seq.pending == 0 and not seq.hold and seq.sampling.grammar is None and seq.can_generate

    def wants_tokens(self, seqs) -> bool:
        """Whether any of these sequences may draft next step (the engine then reads the
        step in flight back first: drafting needs the sequence's last token)."""
        v = self.position_cost
        for seq in seqs:
            if seq.hold or seq.sampling.grammar is not None:
                continue
            st = self._state.get(seq.serial)
            if st is None or st.rate > v or st.idle >= self.retry_steps:
                return True
        return False

    def lengths(self, rows: list[Row]) -> list[int]:
        """Each row's draft length this step (see the module's policy)."""
        v = self.position_cost
        caps, rates = [0] * len(rows), [0.0] * len(rows)
        for i, r in enumerate(rows):
            seq = r.seq
            if not self.eligible(seq):
                continue
            st = self._state.setdefault(seq.serial, SpecState())
            st.idle += 1
            caps[i] = min(self.max_draft, seq.sampling.max_tokens - seq.num_generated - 1)
            if st.idle > self.retry_steps:
                # Just above what pays alone, so it drafts one token, and only alone.
                st.rate = max(st.rate, min(2 * v, (1 + v) / 2, 1.0))
                st.idle = 0
                caps[i] = min(caps[i], 1)
            rates[i] = st.rate
        # Draft tokens in order of gain, best first; the step takes the prefix of them that
        # gives the most tokens per second: steps cost in jumps (a tile of positions), so the
        # best may be none, or several tokens where one alone would not pay.
        order, ks = [], [0] * len(rows)
        while True:
            best, gain = -1, 0.0
            for i in range(len(rows)):
                if ks[i] < caps[i] and rates[i] ** (ks[i] + 1) > gain:
                    best, gain = i, rates[i] ** (ks[i] + 1)
            if best < 0:
                break
            ks[best] += 1
            order.append((best, gain))
        B, drafting = len(rows), self.drafting_s()
        tokens, best_n, best_rate = float(B), 0, B / self.times.at(B)
        for n, (_, gain) in enumerate(order, 1):
            tokens += gain
            rate = tokens / (self.times.at(B + n) + drafting * n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        ks = [0] * B
        for i, _ in order[:best_n]:
            ks[i] += 1
        return ks

    def plan(self, rows: list[Row], grow) -> None:
        """Give the decode rows their drafts. ``grow(seq, upto)``: whether ``seq`` could get
        blocks for positions below ``upto`` (without preempting anyone).

        A drafter that costs nothing (prompt lookup) also proposes a token for each row that
        does not draft, and the row's rate learns whether the target then picked it: a row
        of a wide batch, which drafts only once its rate is high, would otherwise never learn
        that its text turned repetitive."""
        free = self.drafter.cost == 0
        if free:
            for r in rows:
                st = self._state.get(r.seq.serial)
                if st is not None and st.shadow is not None:
                    at, tok = st.shadow
                    if len(r.seq.tokens) > at:
                        st.rate += self.smoothing * (float(r.seq.tokens[at] == tok) - st.rate)
                    st.shadow = None
        for r, k in zip(rows, self.lengths(rows)):
            if k <= 0:
                if free and self.eligible(r.seq):
                    guess = self.drafter.propose(r.seq, 1)
                    if guess:
                        self._state[r.seq.serial].shadow = (len(r.seq.tokens), guess[0])
                continue
            t = time.perf_counter()
            draft = self.drafter.propose(r.seq, k)[:k]
            if draft and self.times.measured:
                each = (time.perf_counter() - t) / len(draft)
                self._draft_s = each if self._draft_s is None else self._draft_s + 0.2 * (each - self._draft_s)
            while draft and not grow(r.seq, r.start + 1 + len(draft)):
                draft.pop()
            if draft:
                r.draft = draft
                r.n = 1 + len(draft)

    def drop(self, seq: Sequence) -> None:
        """``seq`` has finished: forget its record and the drafter's state for it."""
        self._state.pop(seq.serial, None)
        self.drafter.drop(seq.serial)

    # ---- verification ----------------------------------------------------------------
    def accept(self, seq: Sequence, draft: list[int], picks: list[int]) -> int:
        """How many of ``draft`` the target's ``picks`` (one per position, ``len(draft) + 1``)
        accept; records it."""
        a = 0
        while a < len(draft) and draft[a] == picks[a]:
            a += 1
        c = self.counters
        c.drafted += len(draft)
        c.accepted += a
        c.verify_steps += 1
        st = self._state.setdefault(seq.serial, SpecState())
        st.rate += self.smoothing * (a / len(draft) - st.rate)
        st.idle = 0
        return a


def make_speculator(settings: SpeculativeSettings, target, log=log.info) -> Speculator | None:
    """The speculator ``[speculative]`` asks for beside ``target``; None for mode off (and
    for auto off the CPU). A draft model must share the target's vocabulary. Raises
    ValueError (a bad mode, a vocabulary that differs) or ModelError (no model at the path)."""
    import mlx.core as mx

    path = settings.draft_path()
    if settings.resolved(on_cpu=mx.default_device() == mx.cpu) == "off":
        return None
    if settings.ngram_min > settings.ngram_max:
        raise ValueError(f"speculative.ngram_min={settings.ngram_min} is above speculative.ngram_max={settings.ngram_max}")
    if path is None:
        drafter: Drafter = NgramDrafter(settings.ngram_min, settings.ngram_max)
        log(f"speculative decoding: prompt lookup (last {settings.ngram_max}..{settings.ngram_min} tokens)"
            + (" (auto: on the CPU)" if settings.mode == "auto" else ""))
    else:
        from tandem.pipeline.loader import load_model
        from tandem.pipeline.model_store import resolve_model

        draft = load_model(resolve_model(path, log=log)).model
        probe = mx.array([[0]])
        v_draft, v_target = draft(probe).shape[-1], target(probe).shape[-1]
        if v_draft != v_target:
            raise ValueError(f"the draft model {path} has a vocabulary of {v_draft} tokens, the target {v_target}: "
                             "it needs the target's tokenizer")
        drafter = ModelDrafter(draft, parameter_ratio(draft, target))
        log(f"speculative decoding: draft model {path} ({drafter.cost:.2f} of the target's parameters)")
    return Speculator(drafter, max_draft=settings.max_draft, retry_steps=settings.retry_steps)
