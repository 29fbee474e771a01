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

Policy (:meth:`Speculator.plan`), per row: its draft length follows its recent acceptance
rate ``a`` (a moving average over its verifications): the ``k`` in ``0..max_draft`` that
maximizes the expected tokens per step, ``(1 - a^(k+1)) / (1 - a)``, over the step's cost,
``1 + k * (verify_cost + drafter.cost)``; where that is ``k = 0`` the row stops drafting and
tries again after ``retry_steps`` steps (with one token), so a row whose text turns
repetitive later starts again. A batch drafts at most ``batch_tokens - rows`` tokens in
all: a wide batch is compute-bound already, and its steps get no cheaper per token from
more positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

from tandem.pipeline.drafters import Drafter, ModelDrafter, NgramDrafter, parameter_ratio
from tandem.pipeline.sequence import Row, Sequence
from tandem.pipeline.settings import SpeculativeSettings

log = logging.getLogger("tandem.engine")


@dataclass
class SpecState:
    """One sequence's drafting record."""

    rate: float = 0.6  # moving average of the share of drafted tokens accepted
    off_steps: int = 0  # steps since drafting stopped paying (0: drafting)


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class Speculator:
    def __init__(self, drafter: Drafter, *, max_draft: int = 4, batch_tokens: int = 16, verify_cost: float = 0.1,
                 retry_steps: int = 16, smoothing: float = 0.3):
        self.drafter = drafter
        self.max_draft = max_draft
        self.batch_tokens = batch_tokens
        self.verify_cost = verify_cost
        self.retry_steps = retry_steps
        self.smoothing = smoothing
        self.counters = SpecCounters()
        self._state: dict[int, SpecState] = {}

    # ---- policy ---------------------------------------------------------------------
    def draft_length(self, seq: Sequence) -> int:
        """How many tokens ``seq`` should draft now (before the batch's budget)."""
        if not self.eligible(seq):
            return 0
        st = self._state.setdefault(seq.serial, SpecState())
        if st.off_steps:
            st.off_steps += 1
            if st.off_steps <= self.retry_steps:
                return 0
            st.off_steps = 0
            return 1  # a probe: one token tells whether the text has turned predictable
        k = best_length(st.rate, self.max_draft, self.verify_cost + self.drafter.cost)
        if k == 0:
            st.off_steps = 1
        return k

    def eligible(self, seq: Sequence) -> bool:
        """Rows that may draft: every token read back (the drafter sees them all), not a
        prefill-role row, and no grammar (its mask at each drafted position would need
        the grammar advanced through the drafts first: those rows decode one token a step)."""
        return seq.pending == 0 and not seq.hold and seq.sampling.grammar is None and seq.can_generate

    def wants_tokens(self, seqs) -> bool:
        """Whether any of these sequences may draft next step (the engine then reads the
        step in flight back first: drafting needs the sequence's last token)."""
        return any(self._would_draft(s) for s in seqs)

    def _would_draft(self, seq: Sequence) -> bool:
        if seq.hold or seq.sampling.grammar is not None:
            return False
        st = self._state.get(seq.serial)
        return st is None or st.off_steps == 0 or st.off_steps >= self.retry_steps

    def plan(self, rows: list[Row], grow) -> None:
        """Give the decode rows their drafts. ``grow(seq, upto)``: whether ``seq`` could get
        blocks for positions below ``upto`` (without preempting anyone)."""
        budget = self.batch_tokens - len(rows)
        if budget <= 0:
            return
        for r in rows:
            seq = r.seq
            k = min(self.draft_length(seq), budget, seq.sampling.max_tokens - seq.num_generated - 1)
            if k <= 0:
                continue
            draft = self.drafter.propose(seq, k)[:k]
            while draft and not grow(seq, r.start + 1 + len(draft)):
                draft.pop()
            if draft:
                r.draft = draft
                r.n = 1 + len(draft)
                budget -= len(draft)
                if budget <= 0:
                    break

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
        return a


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields on average with ``k`` drafts each accepted with probability
    ``rate`` (until the first rejection), counting the target's own pick."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_length(rate: float, max_draft: int, cost: float) -> int:
    """The draft length in ``0..max_draft`` with the most tokens per unit of step cost."""
    return max(range(max_draft + 1), key=lambda k: (expected_tokens(rate, k) / (1.0 + k * cost), -k))


def make_speculator(settings: SpeculativeSettings, target, log=log.info) -> Speculator | None:
    """The speculator ``[speculative]`` asks for beside ``target``; None for mode off.
    A draft model must share the target's vocabulary. Raises ValueError (a bad mode, a
    vocabulary that differs) or ModelError (no model at the path)."""
    path = settings.draft_path()
    if settings.mode == "off":
        return None
    if settings.ngram_min > settings.ngram_max:
        raise ValueError(f"speculative.ngram_min={settings.ngram_min} is above speculative.ngram_max={settings.ngram_max}")
    if path is None:
        drafter: Drafter = NgramDrafter(settings.ngram_min, settings.ngram_max)
    else:
        import mlx.core as mx

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
    return Speculator(drafter, max_draft=settings.max_draft, batch_tokens=settings.batch_tokens,
                      verify_cost=settings.verify_cost, retry_steps=settings.retry_steps)
