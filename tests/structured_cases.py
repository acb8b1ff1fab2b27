"""JSON schemas and regexes for the structured-output tests, chosen so that a random-weight
model's constrained output stays short (strings and arrays bounded, numbers bounded), and so
covering nested objects, arrays, enums, bounded numbers, required and optional fields, $ref,
anyOf / oneOf, const, null and booleans."""
from __future__ import annotations

S = {"type": "string", "maxLength": 4}
I = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[dict] = [
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    I,
    {"type": "integer", "minimum": -50, "maximum": -10},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "minimum": -2.5, "maximum": 2.5},
    S,
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"type": "string", "pattern": "^[a-c]{2}[0-9]$"},
    {"type": "string", "enum": ["a b", "c\"d", "e\\f"]},
    {"type": "array", "items": I, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
    {"type": "array", "prefixItems": [I, {"type": "boolean"}], "items": False},
    {"type": "array", "items": obj({"k": I}), "maxItems": 2},
    obj({"a": I}),
    obj({"a": S, "b": {"type": "boolean"}}),
    obj({"name": S, "age": I, "ok": {"type": "boolean"}}),
    obj({"x": {"type": "number", "minimum": 0, "maximum": 10}, "y": {"type": "number", "minimum": 0, "maximum": 10}}),
    obj({"color": {"enum": ["red", "green"]}, "size": {"enum": [1, 2, 3]}}),
    obj({"a": I, "b": I}, required=["a"]),
    obj({"a": I, "b": S}, required=[]),
    obj({"tags": {"type": "array", "items": S, "maxItems": 2}}),
    obj({"inner": obj({"v": I})}),
    obj({"inner": obj({"deeper": obj({"v": {"type": "boolean"}})})}),
    obj({"p": obj({"x": I, "y": I}), "q": obj({"x": I, "y": I})}),
    obj({"list": {"type": "array", "items": obj({"id": I, "on": {"type": "boolean"}}), "maxItems": 2}}),
    obj({"v": {"anyOf": [I, {"type": "boolean"}]}}),
    obj({"v": {"oneOf": [{"type": "null"}, {"enum": ["x", "y"]}]}}),
    obj({"v": {"anyOf": [obj({"kind": {"const": "a"}, "n": I}), obj({"kind": {"const": "b"}, "s": S})]}}),
    {"anyOf": [I, S]},
    {"oneOf": [obj({"a": I}), obj({"b": {"type": "boolean"}})]},
    obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"c": {"const": 42}, "d": {"const": True}}),
    obj({"n": {"type": "null"}, "b": {"type": "boolean"}}),
    {"$defs": {"point": obj({"x": I, "y": I})}, **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
    {"$defs": {"leaf": {"enum": [0, 1]}}, "type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3},
    {"definitions": {"name": S}, **obj({"first": {"$ref": "#/definitions/name"}})},
    # an allOf of one schema (older pydantic writes a described $ref so)
    {"$defs": {"point": obj({"x": I, "y": I})}, **obj({"p": {"allOf": [{"$ref": "#/$defs/point"}], "description": "a point"}})},
    {"$defs": {"item": obj({"id": I})}, **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}})},
    obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    obj({"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "count": I}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2}, "maxItems": 2}}),
    obj({"a": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 2}}),
    obj({"flag": {"type": "boolean"}, "opt": {"anyOf": [{"type": "null"}, I]}}, required=["flag"]),
    obj({"unicode": {"enum": ["héllo", "日本", "🙂"]}}),
    obj({"a": obj({"b": obj({"c": obj({"d": I})})})}),
]

REGEXES: list[str] = [
    r"\d{3}-\d{4}",
    r"(cat|dog)s?",
    r"[A-Z][a-z]{1,5}",
    r"0x[0-9a-f]{2,4}",
    r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)",
    r"\d{4}-\d{2}-\d{2}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"(yes|no|maybe)",
    r"[01]{8}",
    r"-?\d{1,3}(\.\d{1,2})?",
    r"(ab)+c",
    r"[^a-z\n]{2,4}",
]
