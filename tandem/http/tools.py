"""OpenAI function calling: ``tools``/``tool_choice`` in, ``tool_calls`` out.

Calls are written in the Hermes format most open chat models are trained on (Qwen,
Hermes, SmolLM3, ...)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template takes ``tools`` gets them (and past calls and tool results)
through its template; for any other template the tool list and this format are written
into the system message and past calls and results into the conversation as text, the
way the model would have produced and received them. ``tool_choice`` ``required`` and a
named function are enforced with a grammar (one call, or several when
``parallel_tool_calls``), so even a model that never learnt the format produces calls
whose arguments validate against the function's parameters. With ``auto`` the model
decides and the edge parses what it wrote; a block that does not parse stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.http.errors import bad_request, unsupported
from tandem.http.markers import MarkerSplitter
from tandem.http.structured import JSON_OPTIONS, bounded

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class Tools:
    functions: list[dict]  # {"name", "description", "parameters"}
    choice: str  # "auto" | "none" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    def grammar(self) -> str | None:
        """The grammar that forces calls (``required``, a named function), else None."""
        if self.choice not in ("required", "named"):
            return None
        import llguidance

        fns = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
        call = f'"{CALL_START}\\n" %json {json.dumps(schema)} "\\n{CALL_END}"'
        repeat = ' ("\\n" call)*' if self.parallel else ""
        return bounded(llguidance.LLMatcher.grammar_from_lark(f"start: call{repeat}\ncall: {call}\n"), "tools")

    def system_text(self) -> str:
        """The tool list and the call format, for a template that does not take ``tools``."""
        lines = [json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.functions]
        return ("You can call functions. Their signatures, as JSON schemas, are inside <tools></tools>:\n<tools>\n"
                + "\n".join(lines) + "\n</tools>\nTo call functions, answer with one block per call:\n"
                f"{CALL_START}\n" + '{"name": <function name>, "arguments": <arguments object>}' + f"\n{CALL_END}")


def parse_tools(body: dict) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise unsupported(legacy, "the legacy functions API is not served; send 'tools' and 'tool_choice'")
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls", "invalid_type")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise bad_request("'tools' must be a list of at most 128 tools", "tools", "invalid_type")
    functions = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where, "invalid_type")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters", "invalid_type")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_type")
        if any(f["name"] == name for f in functions):
            raise bad_request(f"{where}: function name {name!r} appears twice", f"{where}.function.name")
        functions.append({"name": name, **({"description": desc} if desc else {}), "parameters": params})
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice", "invalid_type")
        if not any(f["name"] == named for f in functions):
            raise bad_request(f"tool_choice names {named!r}, which is not in 'tools'", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "none", "required"):
        raise bad_request("'tool_choice' must be none, auto, required or a named function", "tool_choice")
    return Tools(functions, choice, named, True if parallel is None else parallel)


def template_messages(messages: list[dict], tools: Tools | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages (and the ``tools`` argument) for the chat template. ``native``: the
    template takes ``tools`` and tool messages itself."""
    offered = tools is not None and tools.choice != "none"
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
            out.append(m)
        return out, ([{"type": "function", "function": f} for f in tools.functions] if offered else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{CALL_START}\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                              + f"\n{CALL_END}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if offered:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tools.system_text()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out, None


def parse_message_tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` → [{"id", "name", "arguments" (a dict)}]."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id", ""), str):
            raise bad_request(f"{w} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", w, "invalid_type")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise bad_request(f"{w}.function.arguments is not valid JSON", f"{w}.function.arguments") from None
        out.append({"id": c.get("id") or new_call_id(), "name": fn["name"], "arguments": args})
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def body(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFormat:
    """A model family's tool-call markers and the parser of what lies between them
    (mlx-lm's ``tool_parsers``: ``parse(text, tools)`` gives a call dict or a list)."""

    start: str
    end: str
    parse: Any = None  # None: the Hermes JSON body

    def calls(self, block: str, tools: list | None) -> list[ToolCall] | None:
        if self.parse is None:
            call = _call(block)
            return None if call is None else [call]
        try:
            parsed = self.parse(block, tools)
        except Exception:
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for c in parsed:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            args = c.get("arguments", {})
            out.append(ToolCall(new_call_id(), c["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return out


HERMES = CallFormat(CALL_START, CALL_END)


@dataclass
class CallParser:
    """One choice's text → content and completed tool calls, as it streams."""

    format: CallFormat = HERMES
    tools: list | None = None  # the request's tools, for parsers that type arguments by them
    calls: list[ToolCall] = field(default_factory=list)
    _block: str = ""

    def __post_init__(self):
        self.splitter = MarkerSplitter(self.format.start, self.format.end)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._take(self.splitter.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._take(self.splitter.finish())
        if self._block:  # an unclosed block: it was text after all
            content += self.format.start + self._block
            self._block = ""
        return content, calls

    def _take(self, events) -> tuple[str, list[ToolCall]]:
        content, new = "", []
        for kind, text in events:
            if kind == "out":
                if not (text.isspace() and (self.calls or new)):  # separators between calls are not content
                    content += text
            elif kind == "in":
                self._block += text
            else:
                calls = self.format.calls(self._block, self.tools)
                if calls is None:
                    content += self.format.start + self._block + self.format.end
                else:
                    new.extend(calls)
                self._block = ""
        self.calls.extend(new)
        return content, new


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))
