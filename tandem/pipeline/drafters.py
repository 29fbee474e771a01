"""Who proposes the tokens a decode step verifies: prompt lookup or a smaller model.

A drafter proposes up to ``k`` tokens that may follow a sequence's tokens; the engine
verifies them in the target's own step (see :mod:`tandem.pipeline.speculation`), so a
drafter's proposals change how fast tokens come, never which tokens come. Every proposal
is a point guess (no distribution travels with it): the verification's rejection rule
then needs only the target's own pick at each position.

- :class:`NgramDrafter` (prompt lookup): the tokens that followed the latest earlier
  occurrence of the sequence's last n tokens. No model, no state beyond the tokens, so it
  costs nothing to run and nothing to migrate. It pays where the output copies its input
  (rewriting, correcting or quoting a passage, editing code) and proposes nothing, or
  little that is accepted, in free generation.
- :class:`ModelDrafter`: a smaller model with the target's tokenizer, greedy, one dense
  mlx-lm cache per sequence, rolled back to the tokens the target accepted.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from tandem.pipeline.sequence import Sequence


class Drafter(Protocol):
    cost: float
    """What drafting one token costs, as a fraction of a target decode step."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``seq.tokens`` (all read back)."""
        ...

    def drop(self, serial: int) -> None:
        """Forget what is kept for the sequence with this ``serial`` (it has finished)."""
        ...


class NgramDrafter:
    """Prompt lookup: match the last ``n`` tokens (``max_n`` down to ``min_n``) against the
    sequence's earlier tokens and propose what followed the latest match."""

    cost = 0.0

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return lookup(seq.tokens, k, self.min_n, self.max_n)

    def drop(self, serial: int) -> None:
        pass


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up to ``k`` tokens after the latest earlier occurrence of ``tokens``' last n
    tokens, for the largest n in ``max_n .. min_n`` that occurs; [] when none does.

    The search is ``bytes.rfind`` over the tokens as int32 (a match must start on a token
    boundary): every decode row of a step runs it, and a Python scan of a few hundred
    tokens per n cost milliseconds a step at 16 rows."""
    T = len(tokens)
    if T < 2:
        return []
    data = np.asarray(tokens, np.int32).tobytes()
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        pattern = data[(T - n) * 4 :]
        end = (T - 1) * 4  # the occurrence must end before the suffix itself does
        while True:
            i = data.rfind(pattern, 0, end)
            if i < 0:
                break
            if i % 4 == 0:
                start = i // 4 + n
                return tokens[start : start + k]
            end = i + len(pattern) - 1  # a match off the token grid: look before it
    return []


class ModelDrafter:
    """Greedy drafts from ``model`` (same vocabulary as the target), one mlx-lm cache per
    sequence. Before each proposal the cache is trimmed to the longest prefix of the tokens
    it holds that the sequence still has (what the target accepted), then fed the rest."""

    def __init__(self, model, cost: float):
        self.model = model
        self.cost = cost
        self._state: dict[int, tuple[list, list[int]]] = {}  # serial -> (cache, tokens it holds)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        cache, held = self._state.get(seq.serial, (None, []))
        tokens = seq.tokens
        if cache is None:
            cache = make_prompt_cache(self.model)
        common = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is fed again for its logits
        if len(held) > common:
            if not all(c.is_trimmable() for c in cache):
                cache, common = make_prompt_cache(self.model), 0
            else:
                for c in cache:
                    c.trim(len(held) - common)
        held = list(tokens)
        feed = mx.array([tokens[common:]])
        out: list[int] = []
        for j in range(k):
            logits = self.model(feed, cache=cache)[0, -1]
            tok = int(mx.argmax(logits))
            out.append(tok)
            if j + 1 < k:
                held.append(tok)
                feed = mx.array([[tok]])
        self._state[seq.serial] = (cache, held)
        return out

    def drop(self, serial: int) -> None:
        self._state.pop(serial, None)


def parameter_ratio(draft, target) -> float:
    """The draft model's parameters over the target's: what a draft token costs next to a
    target step, where a decode step reads every weight once."""
    from mlx.utils import tree_flatten

    def size(m) -> int:
        return sum(v.size for _, v in tree_flatten(m.parameters()))

    return size(draft) / max(1, size(target))
