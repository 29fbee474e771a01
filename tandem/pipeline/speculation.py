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
(``v``, in one-row steps) has its rate raised just above what a draft must gain after
``retry_steps`` steps without drafting, so a lone sequence whose text turns
repetitive later starts again (with one token).
"""

from __future__ import annotations

import bisect
import heapq
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

from tandem.pipeline.drafters import Drafter, ModelDrafter, NgramDrafter, parameter_ratio
from tandem.pipeline.sequence import Row, Sequence
from tandem.pipeline.settings import SpeculativeSettings

log = logging.getLogger("tandem.engine")


@dataclass
class SpecState:
    """One sequence's drafting record."""

    rate: float = 0.6  # moving average of the share of drafted tokens accepted
    idle: int = 0  # steps since it last drafted


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class _Sizes:
    """Seconds per step size: each size the median of its recent steps (``median``, sizes
    in ``seen``); a size seen ``SURE`` times is sure (:meth:`sure`, sizes in ``keys``)."""

    SURE = 3
    KEEP = 9

    def __init__(self):
        self._obs: dict[int, deque] = {}
        self.median: dict[int, float] = {}
        self.seen: list[int] = []  # sorted sizes of median
        self.keys: list[int] = []  # sorted sure sizes

    def observe(self, positions: int, seconds: float) -> None:
        obs = self._obs.setdefault(positions, deque(maxlen=self.KEEP))
        obs.append(seconds)
        if positions not in self.median:
            bisect.insort(self.seen, positions)
        self.median[positions] = statistics.median(obs)
        if len(obs) == self.SURE:  # (later steps only move its median)
            bisect.insort(self.keys, positions)

    def sure(self, positions: int) -> float | None:
        """The median of a size seen ``SURE`` times, else None."""
        obs = self._obs.get(positions)
        return self.median[positions] if obs is not None and len(obs) >= self.SURE else None

    def nearest(self, positions: int) -> int | None:
        """The sure size nearest ``positions`` (None when there is none)."""
        if not self.keys:
            return None
        i = bisect.bisect(self.keys, positions)
        return min(self.keys[max(i - 1, 0): i + 1], key=lambda k: (abs(k - positions), k))


class StepTimes:
    """What a decode step of ``P`` positions (its rows plus their drafted tokens) takes,
    measured over the steps the engine times (launch to read-back). Plain steps (no
    drafts), which every decode step without drafts measures, so the widths a server passes
    through fill the table for free: each size the median of its recent steps; between
    sizes interpolated; past the largest extended at the mean slope of those measured (or,
    with one measured, at ``prior`` of it per position: optimistic, so drafting there is
    tried and then known). A verifying step of ``P`` positions: its own median once seen
    ``SURE`` times; until then a plain step of ``P`` plus what verifying added at the
    nearest size measured (nothing before any: tried, then known), or its own steps if
    they were cheaper (one slow step must not price a size out for good).

    Per position, because on the CPU a drafted position costs what a row does at the same
    ``P``; a table, not a line, because the cost jumps with ``P``: one position runs kernels
    of its own and the products take positions 8 to a tile, so the first position past a
    tile costs several of the ones after it. A verifying step's extra (the one-row kernels
    left, attention in two passes, or on a GPU another path altogether) carried over from
    where it was measured, because extrapolating the verifying steps a lone sequence
    measured to the widths of a busy server priced them far too low: 16- and 32-row
    batches drafted and lost. A fixed cost, and lines fitted to the steps, did the same
    (docs/engine.md). :meth:`forget` drops what was measured (a worker's warm-up steps pay
    first-use costs). ``measured=False`` keeps ``1 + prior (P - 1)`` one-row steps for both
    (tests of the policy)."""

    def __init__(self, prior: float = 0.1, *, measured: bool = True):
        self.prior, self.measured = prior, measured
        self.forget()

    def forget(self) -> None:
        self._plain, self._verify = _Sizes(), _Sizes()

    @property
    def plain_known(self) -> bool:
        """Whether a plain step was measured: drafting is weighed against one (a process's
        first decode step, and each after :meth:`forget`, does not draft)."""
        return not self.measured or bool(self._plain.seen)

    def observe(self, positions: int, seconds: float, verifying: bool = False) -> None:
        if not self.measured or positions < 1 or seconds <= 0:
            return
        (self._verify if verifying else self._plain).observe(positions, seconds)

    def _plain_at(self, positions: int) -> float:
        t, keys = self._plain.median, self._plain.seen
        if not keys:
            return 1.0 + self.prior * (positions - 1)
        if positions in t:
            return t[positions]
        i = bisect.bisect(keys, positions)
        if i == 0:  # below every size measured: in proportion
            return t[keys[0]] * positions / keys[0]
        lo = keys[i - 1]
        if i < len(keys):
            hi = keys[i]
            return t[lo] + (t[hi] - t[lo]) * (positions - lo) / (hi - lo)
        slope = max((t[lo] - t[keys[0]]) / (lo - keys[0]), 0.0) if i >= 2 else self.prior * t[lo]
        return t[lo] + slope * (positions - lo)

    def at(self, positions: int, verifying: bool = False) -> float:
        """Seconds for a step of ``positions`` (one-row steps before any was measured)."""
        plain = self._plain_at(positions)
        if not verifying:
            return plain
        own = self._verify.sure(positions)
        if own is not None:
            return own
        near = self._verify.nearest(positions)
        est = plain + (max(self._verify.median[near] - self._plain_at(near), 0.0) if near is not None else 0.0)
        tried = self._verify.median.get(positions)
        return min(tried, est) if tried is not None else est


class Speculator:
    # What drafting must gain by the measured costs before a step drafts: what the table
    # does not see (a verifying size tried once or twice, the host's work per position)
    # made wide batches that drafted for a predicted few percent lose several.
    MARGIN = 0.1

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
        return (self.times.at(2, verifying=True) - one + self.drafting_s()) / one

    def drafting_s(self) -> float:
        """What proposing one token costs the engine thread (measured; before that, a model
        drafter's share of the target's parameters, of a one-row step)."""
        return self._draft_s if self._draft_s is not None else self.drafter.cost * self.times.at(1)

    def observe(self, rows: list[Row], seconds: float) -> None:
        """The engine timed a decode step of these rows (launch to read-back)."""
        self.times.observe(sum(r.n for r in rows), seconds, verifying=any(r.draft for r in rows))

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
        states: list[SpecState | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            seq = r.seq
            if not self.eligible(seq):
                continue
            st = states[i] = self._state.setdefault(seq.serial, SpecState())
            st.idle += 1
            caps[i] = min(self.max_draft, seq.sampling.max_tokens - seq.num_generated - 1)
            rates[i] = st.rate
            if st.idle > self.retry_steps:
                # Just above what pays alone (its cost and the margin), so it drafts one
                # token, and only alone. For this step only: a batch that does not take the
                # retry leaves the row at its measured rate. (Kept past the step, the raised
                # rates of 16 rows that had started together made the next step draft 4
                # tokens a row, priced as sure; half were accepted, and the rows that had
                # kept in step fell apart.)
                rates[i] = max(st.rate, min(2 * v + self.MARGIN * (1 + v), 1.0))
                st.idle = 0
                caps[i] = min(caps[i], 1)
        if not self.times.plain_known:
            return [0] * len(rows)
        # Draft tokens in order of gain, best first; the step takes the prefix of them that
        # gives the most tokens per second: steps cost in jumps (a tile of positions), so the
        # best may be none, or several tokens where one alone would not pay.
        order, ks = [], [0] * len(rows)
        heap = [(-rates[i], i) for i in range(len(rows)) if caps[i] > 0 and rates[i] > 0]
        heapq.heapify(heap)
        while heap:  # (a row's gains fall with each token: the next best is its next or another's)
            gain, i = heapq.heappop(heap)
            ks[i] += 1
            order.append((i, -gain))
            if ks[i] < caps[i]:
                heapq.heappush(heap, (gain * rates[i], i))
        B, drafting = len(rows), self.drafting_s()
        tokens, best_n = float(B), 0
        best_rate = B / self.times.at(B) * (1.0 + self.MARGIN)
        for n, (_, gain) in enumerate(order, 1):
            tokens += gain
            rate = tokens / (self.times.at(B + n, verifying=True) + drafting * n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        ks = [0] * B
        for i, _ in order[:best_n]:
            ks[i] += 1
            states[i].rate = rates[i]  # a retry taken: its verification moves the raised rate
        return ks

    def plan(self, rows: list[Row], grow) -> None:
        """Give the decode rows their drafts. ``grow(seq, upto)``: whether ``seq`` could get
        blocks for positions below ``upto`` (without preempting anyone)."""
        for r, k in zip(rows, self.lengths(rows)):
            if k <= 0:
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
