"""A StructuredOutputsParams as an xgrammar Grammar, with the spec checked.

JSON schemas are compiled with fixed separators (`", "` and `": "`, no free whitespace), so a
model cannot spend its tokens on whitespace, and in xgrammar's strict mode (no properties or
items beyond those the schema names, unless it allows them). Keywords that xgrammar would
silently ignore are refused rather than not enforced (`UNSUPPORTED_KEYWORDS`).
"""
from __future__ import annotations

import json

import xgrammar as xgr

from nanovllm.sampling_params import StructuredOutputsParams

# JSON-schema keywords xgrammar accepts but does not enforce: a schema using them is refused.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "patternProperties", "propertyNames", "dependentSchemas",
    "dependentRequired", "dependencies", "unevaluatedProperties", "unevaluatedItems", "uniqueItems",
    "contains", "minContains", "maxContains", "multipleOf", "minProperties", "maxProperties",
})
# Keywords that only annotate a schema (they constrain nothing).
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly"})
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


def _unsupported_keyword(schema: object, path: str) -> str | None:
    """The first keyword of UNSUPPORTED_KEYWORDS in the schema tree, as a JSON pointer-like path."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            return f"{path}/{key}"
    # xgrammar enforces an allOf of one schema standing alone; with more, it allows any JSON
    # value, and beside other keywords it keeps the allOf's schema and drops the rest.
    if "allOf" in schema:
        parts, others = schema["allOf"], set(schema) - {"allOf", "$defs", "definitions"} - _ANNOTATIONS
        if not isinstance(parts, list) or len(parts) != 1 or others:
            return f"{path}/allOf"
    for key, how in _SUBSCHEMAS.items():
        sub = schema.get(key)
        if how == _ONE:
            children = [(key, sub)]
        elif how == _LIST and isinstance(sub, list):
            children = [(f"{key}/{i}", s) for i, s in enumerate(sub)]
        elif how == _DICT and isinstance(sub, dict):
            children = [(f"{key}/{name}", s) for name, s in sub.items()]
        else:
            children = []
        for where, child in children:
            found = _unsupported_keyword(child, f"{path}/{where}")
            if found:
                return found
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
        schema = json.loads(spec.spec)
        found = _unsupported_keyword(schema, "#")
        if found:
            raise ValueError(f"{field}: the JSON schema keyword at {found} is not supported")
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
