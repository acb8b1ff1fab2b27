"""Tool calling and reasoning for /v1/chat/completions: what a request asks for, and the parser
each of its choices' text goes through.

`ParserConfig` holds the server's flags (vLLM's): `--tool-call-parser`, `--enable-auto-tool-choice`
and `--reasoning-parser`. `plan_tools` turns a request's `tools` and `tool_choice` into a
`ToolPlan`:
- `none`: the tools reach the template (the model sees them), the output is not parsed;
- `auto` (the default when tools are given; needs --enable-auto-tool-choice): the server's
  tool parser finds calls in the output;
- `required`: the output is constrained (structured outputs, a JSON schema) to a JSON array of
  one or more {"name": one of the tools, "parameters": that tool's arguments} objects, read
  back as the calls (vLLM's way);
- a named function: the output is constrained to that function's parameters schema and is
  the call's arguments.

`ChoiceParser` runs one choice's text through the reasoning parser (when the server has one
and the output is not constrained), then the tool parser (keeping the first call only with
`parallel_tool_calls: false`); `finish_reason` says "tool_calls"
when an `auto` or `required` output that stopped on its own made calls (a named call keeps
"stop", as with OpenAI and vLLM). A stream gets each call as the parser finds it; the
unstreamed answer (`ChoiceParser.whole`) follows vLLM's rule for `auto`: if a call's arguments
are not JSON (a malformed call, or one cut short by max_tokens), the answer is all content and
has no calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanovllm.chat import check_tools
from nanovllm.entrypoints.protocol import ChatCompletionRequest, bad_request
from nanovllm.entrypoints.reasoning import PARSERS as REASONING_PARSERS
from nanovllm.entrypoints.reasoning import ReasoningParser
from nanovllm.entrypoints.tool_parsers import (
    PARSERS as TOOL_PARSERS,
    NamedCallParser,
    ParsedDelta,
    ParsedOutput,
    RequiredCallsParser,
    ToolParser,
    detect_parser,
    merge_deltas,
)
from nanovllm.sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ParserConfig:
    """The server's tool and reasoning flags (vLLM's names and values)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)} "
                             f"(got {self.tool_call_parser!r})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} "
                             f"(got {self.reasoning_parser!r})")

    def for_template(self, chat_template: str | None) -> "ParserConfig":
        """With --enable-auto-tool-choice and no --tool-call-parser: the parser the chat
        template's tool format calls for; ValueError if it shows none."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is not None:
            return self
        detected = detect_parser(chat_template)
        if detected is None:
            raise ValueError("--enable-auto-tool-choice: the chat template shows no known tool-call format; "
                             f"pass --tool-call-parser ({', '.join(TOOL_PARSERS)})")
        return ParserConfig(detected, True, self.reasoning_parser)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # for the chat template
    function: str | None = None  # the named function
    structured_outputs: StructuredOutputsParams | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps an "auto" output's first call only


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more calls, each {"name", "parameters"}
    matching one tool (vLLM's schema); with parallel_tool_calls false, exactly one. A tool's
    parameters sit inside that array's schema, so their local references ("#", "#/$defs/Name",
    "#/properties/...", as pydantic and zod write them) are rewritten to point where they now
    are."""
    def one(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        function = tool["function"]
        parameters = _rebase_refs(function.get("parameters") or EMPTY_PARAMETERS,
                                  f"#/items/anyOf/{i}/properties/parameters")
        return {
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": parameters,
            },
            "required": ["name", "parameters"],
        }

    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": [one(i, t) for i, t in enumerate(tools)]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Keywords whose value is JSON data (kept as written), and those whose value maps names to schemas.
DATA_KEYWORDS = ("const", "enum", "default", "examples")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")


def _rebase_refs(schema: Any, root: str) -> Any:
    """A copy of schema whose local "$ref"s ("#" and "#/...") point below `root` instead. Only
    schemas' own "$ref"s move: data (a `const`, `enum`, `default` or `examples` value) is
    kept as written, while a property named "default" (or "const", ...) is still a schema."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, root)
    return out


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A named tool_choice: the function's parameters schema (its arguments are the output)."""
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def plan_tools(body: ChatCompletionRequest, config: ParserConfig) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for a malformed tool, a tool_choice that
    names an unknown function, or one the server is not set up for."""
    try:
        tools = check_tools(body.tool_dicts())
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param="tools") from None
    choice = body.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: the request defines none", param="tool_choice")
        return ToolPlan("none", None)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                              '(and --tool-call-parser); send tool_choice "required", "none" or a named function',
                              param="tool_choice")
        return ToolPlan("auto", tools, parallel=body.parallel_tool_calls)
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls)
        return ToolPlan("required", tools, structured_outputs=_structured(
            schema, 'tools: tool_choice "required" wraps each function\'s parameters in the schema of a list of calls, '
                    'and that schema'))
    name = choice.function.name
    index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
    if index is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
    return ToolPlan("named", tools, function=name,
                    structured_outputs=_structured(named_schema(tools[index]), f"tools[{index}].function.parameters:"))


def _structured(schema: dict[str, Any], what: str) -> StructuredOutputsParams:
    """The output constraint of a tool choice; a 400 about the tools (`what` says which part)
    where the schema is refused: the client sent the tools, not a structured_outputs field."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        reason = str(exc).removeprefix("StructuredOutputsParams.json:")
        raise bad_request(f"{what}{reason}", param="tools") from None


class ChoiceParser:
    """One choice's text -> reasoning, content and tool-call deltas. constrained: the output is
    under a grammar from its first token (response_format, structured_outputs): it holds no
    reasoning, so the reasoning parser is skipped, as for "required" and named tool choices."""

    def __init__(self, plan: ToolPlan, config: ParserConfig, prompt_opens_reasoning: bool = False,
                 constrained: bool = False) -> None:
        self.plan = plan
        self.reasoning: ReasoningParser | None = None
        if config.reasoning_parser is not None and not constrained and plan.mode not in ("required", "named"):
            self.reasoning = ReasoningParser(config.reasoning_parser, prompt_opens_reasoning)
        self.tools: ToolParser | None = None
        self._answer = ""  # the text after any reasoning, as the model wrote it
        self._calls_dropped = False  # `whole` found a malformed call and made the answer content
        if plan.mode == "auto":
            self.tools = TOOL_PARSERS[config.tool_call_parser]()  # type: ignore[index]
        elif plan.mode == "required":
            self.tools = RequiredCallsParser()
        elif plan.mode == "named":
            self.tools = NamedCallParser(plan.function)  # type: ignore[arg-type]

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning is None:
            return self._content(text)
        step = self.reasoning.feed(text)
        return ParsedDelta(reasoning=step.reasoning).extend(self._content(step.content))

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.reasoning is not None:
            step = self.reasoning.finish()
            out.reasoning = step.reasoning
            out.extend(self._content(step.content))
        if self.tools is not None:
            out.extend(self._first_call_only(self.tools.finish()))
        return out

    def whole(self, text: str) -> ParsedOutput:
        """The unstreamed answer to the whole `text`: what feeding it and finishing give, except
        that an "auto" output with a call whose arguments are not JSON is all content (the
        text after any reasoning, as written) and has no calls (vLLM's rule)."""
        parsed = merge_deltas([self.feed(text), self.finish()])
        if self.plan.mode == "auto" and not all(_is_json(call.arguments) for call in parsed.tool_calls):
            self._calls_dropped = True
            return ParsedOutput(self._answer or None, parsed.reasoning, [])
        return parsed

    def _content(self, text: str) -> ParsedDelta:
        self._answer += text
        if self.tools is None:
            return ParsedDelta(content=text)
        return self._first_call_only(self.tools.feed(text)) if text else ParsedDelta()

    def _first_call_only(self, delta: ParsedDelta) -> ParsedDelta:
        """With parallel_tool_calls false, the steps of calls after the first are dropped
        (vLLM's rule for "auto"; "required" is constrained to one call)."""
        if not self.plan.parallel:
            delta.tool_calls = [step for step in delta.tool_calls if step.index == 0]
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        called = self.tools is not None and self.tools.called and not self._calls_dropped
        if engine_reason == "stop" and called and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # nested deeper than Python's parser goes: not usable as JSON
        return False
    return True
