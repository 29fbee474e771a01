"""Twenty varied JSON schemas (nested objects, arrays, enums, required fields, $defs, anyOf).

Strings, numbers and arrays carry bounds: the tests' model has random weights, and an
unbounded integer or string from it can outlast any token budget (the grammar keeps it
valid, not short)."""

from __future__ import annotations

S = {"type": "string", "maxLength": 10}
INT = {"type": "integer", "minimum": -50, "maximum": 500}
NUM = {"type": "number", "minimum": 0, "maximum": 100}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = [
    obj({"name": S, "age": INT}),
    obj({"city": S, "country": {"enum": ["FR", "DE", "US", "JP"]}, "population": INT}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 4}}),
    obj({"ok": {"type": "boolean"}, "reason": S}),
    obj({"point": obj({"x": NUM, "y": NUM})}),
    obj({"user": obj({"id": INT, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}})}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "minItems": 1, "maxItems": 3}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer", "minimum": 0, "maximum": 9}}),
    obj({"title": S, "note": S}, required=["title"]),
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 5},
    obj({"value": {"anyOf": [INT, S]}}),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    obj({"status": {"const": "done"}, "code": INT}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "maxItems": 3}, "maxItems": 3}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    {"$defs": {"pet": obj({"kind": {"enum": ["cat", "dog"]}, "name": S})},
     **obj({"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}})},
    obj({"ratio": NUM, "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}}),
    obj({"event": obj({"kind": {"enum": ["start", "stop"]}, "at": {"type": "integer", "minimum": 0, "maximum": 86400}}),
         "meta": obj({"source": S})}),
    obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "confidence": NUM}),
]
assert len(SCHEMAS) == 20
