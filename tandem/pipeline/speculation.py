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

Policy (:meth:`Speculator.plan`): a decode step of ``B`` rows with ``d`` drafted tokens is
modelled as costing ``1 + r (B - 1) + v d`` one-row decode steps, ``r`` and ``v`` measured
(:class:`StepCost`: a least-squares line through the engine's recent steps, drafting time
included); a row whose drafts are accepted at rate ``a`` (a moving average over its
verifications) gains ``a^(k+1)`` expected tokens from its (k+1)-th draft. Draft tokens go,
best gain first, to the rows whose next one raises the step's tokens per unit of cost: so a
lone sequence drafts whenever ``a`` is above ``v``, and a wide batch, whose step costs many
rows already, drafts only its surest rows, few tokens each, or none. The costs are measured
because no constant holds across backends and batch widths: on the CPU a drafted position
costs a fifth of a one-row step at one row and as much as a whole row in a compute-bound
batch of sixteen, and a runner that verifies through its prefill path pays several steps.
A row whose rate fell below ``v`` has its rate raised to just above it (``2 v``, at most
halfway to 1) after ``retry_steps`` steps without drafting, so a lone sequence whose text
turns repetitive later starts again (with one token), while a wide batch stays off.
"""

from __future__ import annotations

import logging
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


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class StepCost:
    """What a decode step costs, learnt from the steps the engine times: seconds =
    ``c0 + c1 (positions - 1)``, a step's positions being its rows plus their drafted
    tokens (a drafted position costs what a row's does: both go through the same products
    and attend over the same context). Least squares over recent steps (weights halving
    every ``halflife`` steps), with a gentle pull of ``c1`` towards ``prior x c0``: where the
    recent steps do not tell the two apart (a steady width, no drafting: only their sum is
    known) the prior splits them, and it is optimistic (0.1), so a sequence that has not
    drafted lately tries, its drafts get measured, and a dearer position ends drafting.
    :meth:`forget` drops what was learnt (a worker's warm-up steps pay first-use costs).
    ``measured=False`` keeps the prior (tests of the policy)."""

    RIDGE = 2.0  # the prior's weight, against some 90 steps' (the decayed sum of weights)

    def __init__(self, position: float = 0.1, *, halflife: float = 64.0, measured: bool = True):
        self.prior = position
        self.measured = measured
        self._decay = 0.5 ** (1.0 / halflife)
        self.forget()

    def forget(self) -> None:
        self.theta = np.array([1.0, self.prior])  # (c0, c1); in one-row steps until a step is timed
        self._a = np.zeros((2, 2))  # decayed sums of x x^T and x y, x = (1, positions - 1)
        self._b = np.zeros(2)

    @property
    def position(self) -> float:
        """One more position, in one-row steps."""
        return self.theta[1] / self.theta[0]

    def step(self, positions: int) -> float:
        """A step's modelled cost (seconds once measured)."""
        return self.theta[0] + self.theta[1] * (positions - 1)

    def observe(self, positions: int, seconds: float) -> None:
        if not self.measured or positions < 1 or seconds <= 0:
            return
        x = np.array([1.0, positions - 1.0])
        self._a *= self._decay
        self._b *= self._decay
        self._a += np.outer(x, x)
        self._b += x * seconds
        pull = np.array([-self.prior, 1.0])  # (c1 - prior c0), squared, weighted RIDGE
        c0, c1 = np.linalg.solve(self._a + self.RIDGE * np.outer(pull, pull), self._b)
        floor = 0.05 * self._b[0] / self._a[0, 0]  # (a step costs something, whatever the noise)
        self.theta = np.array([max(c0, floor), max(c1, 0.0)])


class Speculator:
    def __init__(self, drafter: Drafter, *, max_draft: int = 4, retry_steps: int = 16, smoothing: float = 0.3,
                 cost: StepCost | None = None):
        self.drafter = drafter
        self.max_draft = max_draft
        self.retry_steps = retry_steps
        self.smoothing = smoothing
        self.cost = cost if cost is not None else StepCost()
        self.counters = SpecCounters()
        self._state: dict[int, SpecState] = {}

    # ---- policy ---------------------------------------------------------------------
    @property
    def position_cost(self) -> float:
        """What one drafted token adds to a step, in one-row decode steps: a position
        (measured) and the drafter's own work for it (a model drafter's share of the
        target's parameters)."""
        return self.cost.position + self.drafter.cost

    def observe(self, rows: list[Row], seconds: float) -> None:
        """The engine timed a decode step of these rows (launch to read-back)."""
        self.cost.observe(sum(r.n for r in rows), seconds)

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
        ks = [0] * len(rows)
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
        per_draft = v * self.cost.step(1)  # in the unit of cost.step()
        tokens, cost = float(len(rows)), self.cost.step(len(rows))
        while True:
            best, gain = -1, 0.0
            for i in range(len(rows)):
                if ks[i] < caps[i] and rates[i] ** (ks[i] + 1) > gain:
                    best, gain = i, rates[i] ** (ks[i] + 1)
            if best < 0 or gain * cost <= tokens * per_draft:
                return ks
            ks[best] += 1
            tokens += gain
            cost += per_draft

    def plan(self, rows: list[Row], grow) -> None:
        """Give the decode rows their drafts. ``grow(seq, upto)``: whether ``seq`` could get
        blocks for positions below ``upto`` (without preempting anyone)."""
        for r, k in zip(rows, self.lengths(rows)):
            if k <= 0:
                continue
            draft = self.drafter.propose(r.seq, k)[:k]
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
