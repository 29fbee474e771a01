"""One chat choice's generated text → the parts of an OpenAI assistant message:
``reasoning_content`` (text inside the model's thinking markers), ``content`` and
``tool_calls``, as the text streams in."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.http.markers import MarkerSplitter
from tandem.http.tools import HERMES, CallFormat, CallParser, ToolCall


@dataclass
class Parts:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class MessageShaper:
    """``reasoning``: (start, end) markers, or None; ``thinking``: the prompt already
    opened the reasoning block (templates that end the generation prompt with it);
    ``tools``: parse tool calls out of the content (None: don't), in ``call_format``
    (the model's own, else Hermes JSON); ``tool_list``: the request's tools, for parsers
    that type arguments by their schema."""

    def __init__(self, reasoning: tuple[str, str] | None, thinking: bool, tools: bool,
                 call_format: CallFormat | None = None, tool_list: list | None = None):
        self._think = MarkerSplitter(*reasoning, inside=thinking) if reasoning else None
        self._calls = CallParser(call_format or HERMES, tool_list) if tools else None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Parts:
        if self._think is None:
            return self._content(text, final=False)
        return self._split(self._think.feed(text), final=False)

    def finish(self) -> Parts:
        if self._think is None:
            return self._content("", final=True)
        return self._split(self._think.finish(), final=True)

    def take(self, text: str, final: bool) -> Parts:
        """``feed(text)``, and with ``final`` the held-back rest too, as one :class:`Parts`."""
        parts = self.feed(text)
        if final:
            rest = self.finish()
            parts.content += rest.content
            parts.reasoning += rest.reasoning
            parts.tool_calls += rest.tool_calls
        return parts

    def _split(self, events, final: bool) -> Parts:
        parts, outside = Parts(), ""
        for kind, text in events:
            if kind == "in":
                parts.reasoning += text
            elif kind == "out":
                outside += text
        rest = self._content(outside, final)
        parts.content, parts.tool_calls = rest.content, rest.tool_calls
        return parts

    def _content(self, text: str, final: bool) -> Parts:
        if self._calls is None:
            return Parts(content=text)
        content, calls = self._calls.feed(text) if text else ("", [])
        if final:
            more, late = self._calls.finish()
            content, calls = content + more, calls + late
        self.calls.extend(calls)
        return Parts(content=content, tool_calls=calls)
