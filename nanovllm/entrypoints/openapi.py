"""The app's OpenAPI schema, made to describe the responses the server really sends.

FastAPI documents a 200 with an empty schema and a 422 for every route; this server answers
400 for invalid requests (OpenAI's shape), 401 for a wrong key, 404 for a model id it does not
serve (GET /v1/models/{model}), 408/413 from the request guard, 503 when the engine is down or
the server is full, and streams `text/event-stream` when asked. `document_responses(app)`
rewrites the generated schema accordingly, so that a schema-driven fuzzer (schemathesis,
tests/test_fuzz.py) can check every response against it.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nanovllm.entrypoints.protocol import ChatCompletionResponse, CompletionResponse, ModelCard, ModelList


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Invalid request (OpenAI's error body; `param` names the field)",
    "401": "Missing or wrong API key (/v1/* when the server has one)",
    "408": "The request body did not arrive in time",
    "413": "The request body is too large",
    "503": "The engine has failed or is shutting down, or the server is at its connection limit",
}
_OK = {
    "/v1/completions": (CompletionResponse, True),
    "/v1/chat/completions": (ChatCompletionResponse, True),
    "/v1/models": (ModelList, False),
    "/v1/models/{model}": (ModelCard, False),
}
_NOT_FOUND = {"/v1/models/{model}": "No served model has this id (`code: \"model_not_found\"`)"}


def _only(*values: Any) -> dict[str, Any]:
    return {"anyOf": [{"enum": list(values)}, {"type": "null"}]}


_NULL = {"type": "null"}
_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
# Values the server accepts, where the models' own schema says more: fields known to OpenAI but
# not supported here are accepted only at their neutral values (protocol.py refuses the rest
# with a 400 naming them), logit_bias keys are token ids, stop strings must not be empty, roles
# and content parts are limited. Tools, tool messages and chat_template_kwargs are described at
# their neutral values: what makes them valid (a tool message's tool_call_id, a tool_choice the
# server's flags allow, variables the template accepts) ties fields together beyond the schema.
_SAMPLING: dict[str, Any] = {  # both endpoints
    "logit_bias": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, _NULL]},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}, _NULL]},
}
_ACCEPTED: dict[str, dict[str, Any]] = {  # by schema component
    "CompletionRequest": {"suffix": _only(""), "best_of": _NULL},
    "ChatCompletionRequest": {"functions": _EMPTY_LIST, "function_call": _only("none"), "tools": _EMPTY_LIST,
                              "tool_choice": _only("none"), "chat_template_kwargs": _NULL},
    "ChatMessage": {"role": {"enum": ["system", "user", "assistant"]}, "function_call": _NULL, "tool_calls": _NULL,
                    "tool_call_id": _NULL},
    "ContentPart": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
}


# One server-sent event (before OpenAPI 3.2, a text/event-stream schema describes each event):
# `data` is a JSON chunk (the endpoint's response shape) or `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
    "required": ["data"],
}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(model=ref)}}}


def document_responses(app: Any, model_name: str) -> None:
    """Make `app.openapi()` describe the real responses (see the module docstring), and the
    `model` field of requests as what it is: the served name or nothing."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        _, defs = models_json_schema(
            [(m, "serialization") for m in (ErrorResponse, CompletionResponse, ChatCompletionResponse, ModelCard,
                                            ModelList)],
            ref_template=_REF,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        model = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                 "description": "the served model's name (optional)"}
        for component, fields in _ACCEPTED.items():
            properties = components.get(component, {}).get("properties", {})
            if component in ("CompletionRequest", "ChatCompletionRequest"):
                fields = {**_SAMPLING, "model": model, **fields}
            properties.update({k: v for k, v in fields.items() if k in properties})
        for path, operations in schema.get("paths", {}).items():
            for op in operations.values():
                responses = {}
                model, streams = _OK.get(path, (None, False))
                if model is not None:
                    content = _json(model.__name__)
                    if streams:
                        content["text/event-stream"] = {"schema": _SSE_EVENT}
                    responses["200"] = {"description": "Success" + (" (SSE when stream is true)" if streams else ""),
                                        "content": content}
                elif path == "/health":
                    responses["200"] = {"description": "The engine is running", "content": {"application/json": {
                        "schema": {"type": "object", "properties": {"status": {"type": "string"}},
                                   "required": ["status"]}}}}
                elif path == "/metrics":
                    responses["200"] = {"description": "Prometheus metrics",
                                        "content": {"text/plain": {"schema": {"type": "string"}}}}
                else:
                    responses["200"] = op.get("responses", {}).get("200", {"description": "Success"})
                errors = {**_ERRORS, "404": _NOT_FOUND[path]} if path in _NOT_FOUND else _ERRORS
                for code, description in sorted(errors.items()):
                    if code == "401" and not path.startswith("/v1/"):
                        continue
                    responses[code] = {"description": description, "content": _json("ErrorResponse")}
                op["responses"] = responses
        return schema

    app.openapi = openapi
