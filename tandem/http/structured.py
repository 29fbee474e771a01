"""``response_format`` → an llguidance grammar the workers enforce token by token.

JSON is compiled without flexible whitespace (``", "`` and ``": "`` separators):
a small model given free whitespace can spend its whole token budget on newlines
inside an object, and the output stays readable. ``strict: true`` compiles the schema
exactly (a keyword llguidance cannot enforce is a 400); without it, such keywords are
ignored (llguidance's lenient mode) and the rest is still enforced.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.http.errors import bad_request
from tandem.pipeline import grammar as grammar_mod
from tandem.wire.protocol import MAX_GRAMMAR_CHARS

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 256 * 1024


def schema_grammar(schema: dict | bool, *, strict: bool = True) -> str:
    """The llguidance grammar text of a JSON schema (checked against a tokenizer later)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not strict})


def check_grammar(grammar: str, tokenizer, param: str) -> None:
    """A 400 naming ``param`` unless the grammar compiles for this tokenizer."""
    try:
        grammar_mod.check_grammar(grammar, tokenizer)
    except grammar_mod.GrammarError as exc:
        raise bad_request(f"{param} cannot be enforced: {exc}", param) from None


def response_format_grammar(fmt: Any) -> str | None:
    """The grammar of an OpenAI ``response_format``; None for plain text."""
    if fmt is None:
        return None
    where = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", where, "invalid_type")
    kind = fmt["type"]
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"'response_format' has unknown field(s) {sorted(extra)}", where)
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}", f"{where}.type")
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'", where, "invalid_type")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise bad_request(f"{where} has unknown field(s) {sorted(unknown)}", where)
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad_request(f"{where}.name must be a string of 1 to 64 characters", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict", "invalid_type")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{where}.schema must be a JSON schema object", f"{where}.schema", "invalid_type")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise bad_request(f"{where}.schema is larger than {MAX_SCHEMA_CHARS} characters", f"{where}.schema")
    try:
        grammar = schema_grammar(schema, strict=bool(strict))
    except Exception as exc:
        raise bad_request(f"{where}.schema is not a valid JSON schema: {exc}", f"{where}.schema") from None
    return bounded(grammar, f"{where}.schema")


def bounded(grammar: str, param: str) -> str:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{param} compiles to a grammar of {len(grammar)} characters; the limit is {MAX_GRAMMAR_CHARS}", param)
    return grammar
