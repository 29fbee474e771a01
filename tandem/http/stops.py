"""Stop strings matched across token boundaries and never emitted.

Text arrives in arbitrary pieces (a stop string may span several tokens), so the
matcher holds back the longest tail that could still grow into a stop string and
releases it once it cannot.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a match, ``stopped`` is True
        and nothing more is emitted."""
        if self.stopped or not text:
            return ""
        if not self._stops:
            return text
        self._pending += text
        # The stop that completes first wins (as if text arrived one character at a
        # time), so the result does not depend on how the text was split.
        hits = [(i + len(s), i) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            cut = min(hits)[1]
            out, self._pending = self._pending[:cut], ""
            self.stopped = True
            return out
        hold = self._partial_len()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out

    def flush(self) -> str:
        """The held tail, once generation ended without a match."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_len(self) -> int:
        # Longest suffix of the pending text that is a proper prefix of some stop string.
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best
