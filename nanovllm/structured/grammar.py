"""A StructuredOutputsParams as an xgrammar Grammar, with the spec checked.

JSON schemas are compiled with fixed separators (`", "` and `": "`, no free whitespace), so a
model cannot spend its tokens on whitespace, and in xgrammar's strict mode (no properties or
items beyond those the schema names, unless it allows them). Keywords that xgrammar would
silently ignore are refused rather than not enforced (`UNSUPPORTED_KEYWORDS`), and so is anything
else it would hold differently from JSON Schema (`_node_problem`), in every subschema and every
place a local `$ref` points at.
"""
from __future__ import annotations

import json
import math
import re
from re import _parser as re_parser  # the regex parser of re itself: a pattern's shortest and longest match
from urllib.parse import unquote

import xgrammar as xgr

from nanovllm.sampling_params import StructuredOutputsParams, metaschema_problem

# JSON-schema keywords xgrammar accepts but does not enforce: a schema using them is refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "patternProperties", "propertyNames", "dependentSchemas",
    "dependentRequired", "dependencies", "unevaluatedProperties", "unevaluatedItems", "uniqueItems",
    "contains", "minContains", "maxContains", "multipleOf", "minProperties", "maxProperties",
})
# Keywords that only annotate a schema (they constrain nothing).
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly"})
# The keywords xgrammar enforces (the others it refuses, or they only annotate).
_CONSTRAINTS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "additionalItems", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf",
})
# Where a schema holds subschemas: keyword -> how (one schema, a list of them, a dict of them).
_ONE, _LIST, _DICT = "one", "list", "dict"
_SUBSCHEMAS = {
    "items": _ONE, "additionalProperties": _ONE, "additionalItems": _ONE,
    "prefixItems": _LIST, "anyOf": _LIST, "oneOf": _LIST, "allOf": _LIST,
    "properties": _DICT, "$defs": _DICT, "definitions": _DICT,
}
# Any JSON object: `{"type": "object"}` with any properties (json_object, response_format json_object).
JSON_OBJECT_SCHEMA = {"type": "object", "additionalProperties": True}
# The character classes xgrammar (0.2.x) writes for a JSON string's characters, and what they
# become. Both admit the surrogate code points U+D800-U+DFFF, whose 3-byte encodings are not
# UTF-8 (a model could write them, and they decode to replacement characters, which breaks a
# maxLength); the length-bounded one (minLength / maxLength) admits raw control characters too,
# which JSON does not.
_STRING_CHARS = {
    r"[^\0-\x1f\"\\\r\n]": r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]",
    r"[^\"\\\r\n]": r"[^\0-\x1f\"\\\uD800-\uDFFF]",
}


def _resolve(root: dict, ref: str) -> object:
    """The value a local $ref ("#" or a JSON pointer "#/a/b", percent- and ~-escaped) points at,
    None where it points at nothing (xgrammar refuses such a schema itself)."""
    node: object = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _followed(node: object, root: dict) -> object:
    """node, or what its chain of local $refs ends at (None for a cycle or a dangling one)."""
    for _ in range(64):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
            return node
        node = _resolve(root, node["$ref"])
    return None


# Keywords about one type that xgrammar applies only where the node has that type, given or
# inferred: an object from properties or additionalProperties, an array from items or
# prefixItems. A node with none of them (and no value of its own: enum, const, $ref, anyOf,
# oneOf, allOf) allows any JSON value, ignoring them.
_TYPED_KEYWORDS = {
    "pattern": "string", "format": "string", "minLength": "string", "maxLength": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "minItems": "array", "maxItems": "array",
}
_OBJECT_KEYWORDS, _ARRAY_KEYWORDS = ("properties", "additionalProperties"), ("items", "prefixItems")
_VALUE_KEYWORDS = ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")


def _types(node: object, root: dict) -> set[str] | None:
    """The JSON types xgrammar lets `node` (a $ref followed) take where they are plain from its
    keywords (its type, or what properties / items imply, or its const or enum values); None
    where they are not."""
    node = _followed(node, root)
    if not isinstance(node, dict):
        return None
    kinds = node.get("type")
    if isinstance(kinds, str):
        return {kinds}
    if isinstance(kinds, list) and kinds:
        return set(kinds)
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list) and values:
        names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
                 type(None): "null"}
        return {names[type(v)] for v in values if type(v) in names} or None
    if any(k in node for k in _OBJECT_KEYWORDS):
        return {"object"}
    if any(k in node for k in _ARRAY_KEYWORDS):
        return {"array"}
    return None


def _within(types: set[str], allowed: set[str]) -> bool:
    """Whether every value of `types` is a value of `allowed` (an integer is a number)."""
    return all(t in allowed or (t == "integer" and "number" in allowed) for t in types)


# The lengths of the strings xgrammar writes for a format (those it holds; unlisted ones it
# writes as any string, or, as uri-reference, may write empty).
_FORMAT_LENGTHS = {"date": (10, 10), "uuid": (36, 36), "email": (1, math.inf), "time": (1, math.inf),
                   "date-time": (1, math.inf), "uri": (1, math.inf), "ipv4": (7, 15), "ipv6": (1, math.inf),
                   "hostname": (1, math.inf), "duration": (1, math.inf)}


def _implied_length(node: dict) -> tuple[float, float] | None:
    """The shortest and longest string the node's pattern (which xgrammar matches whole) or
    format allows, in characters, where they are known; None where they are not."""
    if "pattern" in node:
        try:
            shortest, longest = re_parser.parse(node["pattern"]).getwidth()
        except (re.error, TypeError, ValueError, OverflowError, RecursionError):
            return None
        return shortest, (math.inf if longest >= 2**31 else longest)
    return _FORMAT_LENGTHS.get(node.get("format"))


def _values(schema: object) -> set[str] | None:
    """The values a const or enum allows, as canonical JSON text (1.0 as 1), or None."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list):
        return None
    return {json.dumps(int(v) if isinstance(v, float) and v.is_integer() else v, sort_keys=True) for v in values}


def _declared_types(schema: dict) -> set[str] | None:
    """The types a schema allows by its own type, or by its const or enum values (numbers
    widened: an integer is a number); None where it names none (then, in JSON Schema, it
    allows every type its other keywords do not speak of)."""
    kinds = _types({k: v for k, v in schema.items() if k not in _OBJECT_KEYWORDS + _ARRAY_KEYWORDS}, {})
    if kinds is None:
        return None
    return kinds | {"integer", "number"} if kinds & {"integer", "number"} else kinds


def _exclusive(a: dict, b: dict, root: dict) -> bool:
    """Whether no value the grammar writes for one of these schemas matches the other (JSON
    Schema's meaning): their values (const, enum) or declared types do not meet, or, objects
    both, one requires a property the other cannot write (it names only its own properties
    unless additionalProperties opens it), or refuses one the other requires beyond its own
    (additionalProperties false), or a property both require allows values in one that the
    other's does not (as pydantic writes a discriminated union's tag: a const or an enum)."""
    a_values, b_values = _values(a), _values(b)
    if a_values is not None and b_values is not None:
        return not a_values & b_values
    a_types, b_types = _declared_types(a), _declared_types(b)
    if a_types is None or b_types is None:
        return False
    if not a_types & b_types:
        return True
    if a_types != {"object"} or b_types != {"object"}:
        return False
    properties = [x.get("properties", {}) for x in (a, b)]
    required = [x.get("required", []) for x in (a, b)]
    if not all(isinstance(p, dict) for p in properties) or not all(isinstance(r, list) for r in required):
        return False

    def never_writes_a_match(w: int, o: int) -> bool:
        writer_closed = (a, b)[w].get("additionalProperties", False) is False
        if writer_closed and not set(required[o]) <= set(properties[w]):
            return True
        if (a, b)[o].get("additionalProperties") is False and not set(required[w]) <= set(properties[o]):
            return True
        for name in set(required[w]) & set(required[o]):
            tags = [_values(_followed(properties[x].get(name), root)) for x in (w, o)]
            if tags[0] is not None and tags[1] is not None and not tags[0] & tags[1]:
                return True
        return False

    return never_writes_a_match(0, 1) and never_writes_a_match(1, 0)


def _exclusive_branches(branches: list[object], root: dict) -> bool:
    """Whether no value the grammar writes for one of these schemas ($refs followed) matches
    another (_exclusive, pair by pair)."""
    resolved = [_followed(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in resolved):
        return False
    return all(_exclusive(a, b, root) for i, a in enumerate(resolved) for b in resolved[i + 1:])


def _node_problem(node: dict, path: str, root: dict) -> str | None:
    """Why xgrammar would not enforce this schema node as JSON Schema means it; None if it would."""
    for key in node:
        if key in UNSUPPORTED_KEYWORDS:
            return f"the JSON schema keyword at {path}/{key} is not supported"
    # xgrammar enforces an allOf of one schema standing alone; with more, it allows any JSON
    # value, and beside other keywords it keeps the allOf's schema and drops the rest.
    if "allOf" in node:
        parts, others = node["allOf"], set(node) - {"allOf", "$defs", "definitions"} - _ANNOTATIONS
        if not isinstance(parts, list) or len(parts) != 1 or others:
            return f"the JSON schema keyword at {path}/allOf is not supported"
    for key in ("anyOf", "oneOf", "type"):  # xgrammar takes an empty anyOf for "" and an empty type for any value
        if node.get(key) == []:
            return f"{path}/{key} is empty: no value matches it"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"{path}/$ref {ref!r}: only references within the schema (\"#\" or \"#/...\") are supported"
    # Beside a $ref, xgrammar keeps the referenced schema and drops every other keyword (a type
    # that the referenced schema keeps to anyway may stand beside it).
    others = sorted(set(node) & _CONSTRAINTS) if "$ref" in node else []
    if others == ["type"]:
        target, allowed = _types({"$ref": node["$ref"]}, root), _types({"type": node["type"]}, root)
        if target is not None and allowed is not None and _within(target, allowed):
            others = []
    if others:
        return (f"{path}/$ref beside {', '.join(others)} is not supported: put them in the referenced schema, "
                "or combine the two with anyOf")
    # Beside an anyOf or a oneOf, xgrammar keeps it alone (a const or enum, checked below, goes
    # first); a type beside it holds only where each of its schemas has a type within that one.
    unions = [key for key in ("anyOf", "oneOf") if isinstance(node.get(key), list) and node[key]]
    if unions and not ("const" in node or "enum" in node):
        key = unions[0]
        others = sorted(set(node) & _CONSTRAINTS - {key, "type"})
        if others:
            return (f"{path}/{key} beside {', '.join(others)} is not supported (the grammar would keep the {key} "
                    f"alone): move them into each of its schemas")
        allowed = _types(node, root) if "type" in node else None
        for i, branch in enumerate(node[key] if allowed is not None else []):
            kinds = _types(branch, root)
            if kinds is None or not _within(kinds, allowed):
                return (f"{path}/type beside {key} is not supported where {path}/{key}/{i} does not give a type "
                        f"among {sorted(allowed)} (the grammar would keep the {key} alone)")
    # xgrammar holds a oneOf as an anyOf: a value two of its schemas match would be written.
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1:
        if not _exclusive_branches(node["oneOf"], root):
            return (f"{path}/oneOf is enforced as anyOf, and its schemas are not plainly exclusive (distinct values "
                    "or types; objects told apart by the properties they require, or by a required property's "
                    "const or enum): a value two of them match could be written; use anyOf, or make them exclusive")
    # Keywords of one type on a node that has no type (given or implied) constrain nothing there.
    if not any(k in node for k in ("type",) + _VALUE_KEYWORDS + _OBJECT_KEYWORDS + _ARRAY_KEYWORDS):
        for key, kind in _TYPED_KEYWORDS.items():
            if key in node:
                return f"{path}/{key} without a type is not enforced: give the type it applies to ({kind!r})"
    # xgrammar keeps one of pattern, format and the length bounds of a string, dropping the rest;
    # bounds that every string the pattern or format allows keeps anyway may stay.
    string_rules = [key for key in ("pattern", "format") if key in node] + (
        ["minLength/maxLength"] if "minLength" in node or "maxLength" in node else [])
    kinds = node.get("type")
    if len(string_rules) > 1 and (kinds is None or kinds == "string" or (isinstance(kinds, list) and "string" in kinds)):
        implied = _implied_length(node) if len(string_rules) == 2 and string_rules[-1] == "minLength/maxLength" else None
        if implied is None or not (node.get("minLength", 0) <= implied[0]
                                   and node.get("maxLength", math.inf) >= implied[1]):
            return (f"{path}: {' and '.join(string_rules)} together are not supported (the grammar would enforce "
                    "one of them): keep one (a pattern can hold the length)")
    # xgrammar never writes a required property that `properties` does not define.
    kinds = node.get("type", "object")
    if isinstance(node.get("required"), list) and "object" in (kinds if isinstance(kinds, list) else [kinds]):
        properties = node.get("properties")
        for name in node["required"]:
            if isinstance(name, str) and not (isinstance(properties, dict) and name in properties):
                return (f"{path}/required names {name!r}, which {path}/properties does not define: "
                    "such a property is never written")
    # xgrammar writes a const or enum value as it is, whatever the keywords beside it say.
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
    if values and set(rest) - _ANNOTATIONS:
        from jsonschema import Draft202012Validator
        from referencing.exceptions import Unresolvable

        which = "const" if "const" in node else "enum"
        validator = Draft202012Validator(root).evolve(schema=rest)
        for value in values:
            try:
                if not validator.is_valid(value):
                    return f"{path}/{which} value {value!r} does not match the rest of its schema"
            except (re.error, Unresolvable) as exc:
                return f"{path}/{which} cannot be checked against the rest of its schema ({exc})"
    return None


def _schema_problem(schema: dict) -> str | None:
    """The first place, as a JSON pointer, where xgrammar would not enforce `schema` as JSON
    Schema means it (_node_problem), with why; None if there is none. Walks every subschema
    and the target of every local $ref, wherever in the document it is."""
    seen: set[int] = set()
    todo: list[tuple[object, str]] = [(schema, "#")]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        problem = _node_problem(node, path, schema)
        if problem:
            return problem
        children = []
        for key, how in _SUBSCHEMAS.items():
            sub = node.get(key)
            if how == _ONE:
                children.append((sub, f"{path}/{key}"))
            elif how == _LIST and isinstance(sub, list):
                children += [(s, f"{path}/{key}/{i}") for i, s in enumerate(sub)]
            elif how == _DICT and isinstance(sub, dict):
                children += [(s, f"{path}/{key}/{name}") for name, s in sub.items()]
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            children.append((_resolve(schema, ref), ref))
        todo += reversed(children)  # depth first, in the schema's order
    return None


def _gbnf_string(text: str) -> str:
    """A GBNF string literal for text (JSON's escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar for `spec`; ValueError naming the field (`structured_outputs.json`, ...)
    when the schema, regex or grammar is invalid or uses what xgrammar cannot enforce."""
    kind = spec.kind
    field = f"structured_outputs.{kind}"
    if kind == "json":
        invalid = metaschema_problem(spec.spec)
        if invalid is not None:
            raise ValueError(f"{field}: is not a valid JSON schema: {invalid}")
        problem = _schema_problem(json.loads(spec.spec))
        if problem:
            raise ValueError(f"{field}: {problem}")
    try:
        if kind in ("json", "json_object"):
            schema = spec.spec if kind == "json" else json.dumps(JSON_OBJECT_SCHEMA)
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
            text = fixed = str(grammar)
            for loose, strict in _STRING_CHARS.items():
                fixed = fixed.replace(loose, strict)
            return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_gbnf_string(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar's messages start with a C++ source location: keep only what follows it.
        message = str(exc).strip().split(": ", 1)[-1] if "] /" in str(exc) else str(exc).strip()
        raise ValueError(f"{field}: {message}") from None
