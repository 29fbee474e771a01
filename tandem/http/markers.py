"""Split streamed text at a pair of markers (``<think>``/``</think>``, ``<tool_call>``/
``</tool_call>``) without ever emitting part of a marker.

Text arrives in arbitrary pieces; a piece ending in what could begin a marker is held
back until the next piece settles it. Used for reasoning content and tool calls.
"""

from __future__ import annotations


class MarkerSplitter:
    """``feed`` returns events: ``("out", text)`` outside the markers, ``("in", text)``
    inside, ``("close", None)`` when an inside block ends."""

    def __init__(self, start: str, end: str, inside: bool = False):
        if not start or not end:
            raise ValueError("markers must not be empty")
        self.start, self.end = start, end
        self.inside = inside
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str | None]]:
        self._buf += text
        events: list[tuple[str, str | None]] = []
        while True:
            marker = self.end if self.inside else self.start
            kind = "in" if self.inside else "out"
            i = self._buf.find(marker)
            if i < 0:
                keep = _partial_suffix(self._buf, marker)
                if len(self._buf) > keep:
                    events.append((kind, self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                return events
            if i:
                events.append((kind, self._buf[:i]))
            self._buf = self._buf[i + len(marker):]
            if self.inside:
                events.append(("close", None))
            self.inside = not self.inside

    def finish(self) -> list[tuple[str, str | None]]:
        """The held-back tail: an unfinished marker is text after all."""
        out = [("in" if self.inside else "out", self._buf)] if self._buf else []
        self._buf = ""
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
