"""Tool-call and reasoning parsers (nanovllm/entrypoints/tool_parsers.py, reasoning.py, tools.py).

Each parser is fed a whole text at once and the same text cut into deltas at every position
(two cuts, and one character at a time): the calls, content and reasoning must come out the
same. Expected values are written out by hand.
"""
from __future__ import annotations

import itertools
import json
import sys

import pytest
from jsonschema import Draft202012Validator

from nanovllm.entrypoints.protocol import ChatCompletionRequest, OpenAIError
from nanovllm.entrypoints.reasoning import ReasoningParser, prompt_opens_reasoning
from nanovllm.entrypoints.tool_parsers import (
    HermesToolParser,
    NamedCallParser,
    RequiredCallsParser,
    detect_parser,
    llama3_json_parser,
    merge_deltas,
    parse_whole,
    scan_call_object,
)
from nanovllm.entrypoints.tools import ChoiceParser, ParserConfig, ToolPlan, plan_tools, required_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def summary(parsed):
    return parsed.content, parsed.reasoning, [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(make, pieces):
    parser = make()
    return merge_deltas([parser.feed(p) for p in pieces] + [parser.finish()])


def assert_every_split_agrees(make, text):
    """The text whole, cut in two and three pieces everywhere, and one character at a time,
    parse to the same output; returns it."""
    whole = summary(parse_whole(make(), text))
    for a in range(len(text) + 1):
        assert summary(streamed(make, [text[:a], text[a:]])) == whole, (a, text)
        for b in range(a, len(text) + 1, 5):
            assert summary(streamed(make, [text[:a], text[a:b], text[b:]])) == whole, (a, b, text)
    assert summary(streamed(make, list(text))) == whole
    return whole


# ---- hermes --------------------------------------------------------------------------------
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 12}}\n'
          '</tool_call>\n<tool_call>\n{"arguments": {"tz": "UTC", "s": "a \\"}\\" b"}, "name": "get_time"}\n'
          '</tool_call>')


def test_hermes_calls_whole_and_split():
    assert assert_every_split_agrees(HermesToolParser, HERMES) == (
        "Let me check.", None,
        [("get_weather", '{"city": "Paris", "days": 12}'), ("get_time", '{"tz": "UTC", "s": "a \\"}\\" b"}')])


@pytest.mark.parametrize("text, expected", [
    ("no calls here, a <tool> tag and a < b", ("no calls here, a <tool> tag and a < b", None, [])),
    # a block without a call in it is content, text and all
    ("x <tool_call>not json</tool_call> y", ("x <tool_call>not json</tool_call> y", None, [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', None, [])),
    # the output ends inside a block (max_tokens): the call as far as it got
    ('<tool_call>{"name": "f", "arguments": {"a": 1', (None, None, [("f", '{"a": 1')])),
    # brackets and quotes inside strings, an escaped backslash before a closing quote
    ('<tool_call>{"name": "f", "arguments": {"p": "C:\\\\", "q": [{"a": "]}"}, []]}}</tool_call>',
     (None, None, [("f", '{"p": "C:\\\\", "q": [{"a": "]}"}, []]}')])),
    # a call without arguments has {}
    ('<tool_call>{"name": "f"}</tool_call>', (None, None, [("f", "{}")])),
    # the close marker inside a string ends the block (the first close wins, as in vLLM)
    ('<tool_call>{"name": "f", "arguments": {"a": "</tool_call>"}}</tool_call>',
     ('"}}</tool_call>', None, [("f", '{"a": "')])),
])
def test_hermes_edge_cases(text, expected):
    assert assert_every_split_agrees(HermesToolParser, text) == expected


def test_a_malformed_arguments_value_streams_no_further_than_its_end():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    assert assert_every_split_agrees(HermesToolParser, text) == (None, None, [("get_weather", '{"city": Paris}')])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',
    'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>',
    'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut by max_tokens
    # nested deeper than Python's JSON parser goes (the depth is set at run time: see below)
    '<tool_call>{"name": "get_weather", "arguments": {"a": DEEP}}</tool_call>',
])
def test_unstreamed_auto_answer_with_a_call_that_is_not_json_is_content(text):
    """vLLM's rule for the unstreamed answer: a call whose arguments do not parse makes the
    whole answer content, without calls, and the finish reason is the engine's."""
    depth = sys.getrecursionlimit() + 100  # libraries may raise the limit (torch's compilers do)
    text = text.replace("DEEP", "[" * depth + "]" * depth)
    parser = ChoiceParser(ToolPlan("auto", [WEATHER]), ParserConfig("hermes", True))
    assert summary(parser.whole(text)) == (text, None, [])
    assert parser.finish_reason("stop") == "stop"
    reasoned = ChoiceParser(ToolPlan("auto", [WEATHER]), ParserConfig("hermes", True, "qwen3"))
    assert summary(reasoned.whole("<think>hm</think>\n\n" + text)) == (text, "hm", [])
    good = ChoiceParser(ToolPlan("auto", [WEATHER]), ParserConfig("hermes", True))
    assert summary(good.whole(HERMES))[2] == [
        ("get_weather", '{"city": "Paris", "days": 12}'), ("get_time", '{"tz": "UTC", "s": "a \\"}\\" b"}')]
    assert good.finish_reason("stop") == "tool_calls"


def test_hermes_stream_shape():
    """A call's first delta has its id, name and empty arguments; the rest only arguments."""
    ids = itertools.count()
    parser = HermesToolParser(new_id=lambda: f"call_{next(ids)}")
    steps = []
    pieces = ["<tool_call>", '{"name": "get_wea', 'ther", "argu', 'ments": {"city": ', '"Par', 'is"}}', "</tool_call>"]
    for piece in pieces:
        steps += parser.feed(piece).tool_calls
    steps += parser.finish().tool_calls
    assert [(s.index, s.id, s.name, s.arguments) for s in steps] == [
        (0, "call_0", "get_weather", ""), (0, None, None, '{"city": '), (0, None, None, '"Par'),
        (0, None, None, 'is"}')]


def test_default_ids_are_openai_shaped_and_unique():
    calls = parse_whole(HermesToolParser(), HERMES).tool_calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2


# ---- llama3_json, required, named ----------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     (None, None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])),
    ('  {"name": "get_time", "arguments": {"n": -1.5e3}}', (None, None, [("get_time", '{"n": -1.5e3}')])),
    ('{"a": 1} is JSON', ('{"a": 1} is JSON', None, [])),
    ("Hello {\"name\": \"f\"}", ('Hello {"name": "f"}', None, [])),
    ('{"name": "f", "parameters": {"a": 1}} and then text', ("and then text", None, [("f", '{"a": 1}')])),
    ('{"name": "f", "parameters": {"a": 1} oops', ("oops", None, [("f", '{"a": 1}')])),
    # no call began (cut off before the name was complete): the output is content as written
    ('<|python_tag|> {"name": "get_wea', ('<|python_tag|> {"name": "get_wea', None, [])),
])
def test_llama3_json(text, expected):
    assert assert_every_split_agrees(llama3_json_parser, text) == expected


@pytest.mark.parametrize("text", ['[', '[{"name": "', ' [\n  {"name": "get_wea', '[{"parameters": {}}]'])
def test_required_output_without_a_call_is_content_as_written(text):
    """Cut off by max_tokens before a call's name is complete: the model's text, opening
    bracket and all, is the content, streamed and whole alike."""
    assert assert_every_split_agrees(RequiredCallsParser, text) == (text, None, [])


def test_required_array_and_named():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    assert assert_every_split_agrees(RequiredCallsParser, text) == (
        None, None, [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])
    assert assert_every_split_agrees(lambda: NamedCallParser("get_weather"), '{"city": "Rome"}') == (
        None, None, [("get_weather", '{"city": "Rome"}')])


def test_scan_call_object_states():
    assert scan_call_object('{"name": "f", "x": 1', 0).state == "partial"
    done = scan_call_object('{"name": "f", "arguments": [1, 2]} tail', 0)
    assert (done.state, done.end, done.name) == ("complete", 34, "f")
    assert '{"name": "f", "arguments": [1, 2]} tail'[done.args_start:done.args_end] == "[1, 2]"
    bad = scan_call_object('{"name": "f" "x"', 0)
    assert (bad.state, bad.end) == ("invalid", 13)
    assert scan_call_object('{"args": 12', 0).args_end is None  # a number may go on


def test_detect_parser_from_template():
    assert detect_parser("...<tool_call>\n{{ tool_call }}</tool_call>") == "hermes"
    assert detect_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_parser(None) is None


# ---- reasoning -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, opens, text, expected", [
    ("qwen3", False, "<think>\nLet me think.\n</think>\n\nParis.", ("Paris.", "\nLet me think.\n", [])),
    ("qwen3", False, "Paris. <think> stays", ("Paris. <think> stays", None, [])),
    ("qwen3", False, "<think>still thinking", (None, "still thinking", [])),
    ("qwen3", True, "thought</think>answer", ("answer", "thought", [])),
    ("deepseek_r1", False, "thought</think>answer", ("answer", "thought", [])),
    ("deepseek_r1", False, "<think>thought</think>answer", ("answer", "thought", [])),
    ("deepseek_r1", False, "all thought", (None, "all thought", [])),
])
def test_reasoning_whole_and_split(name, opens, text, expected):
    assert assert_every_split_agrees(lambda: ReasoningParser(name, opens), text) == expected


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningParser("o1")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ParserConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ParserConfig(reasoning_parser="o1")
    with pytest.raises(ValueError, match="no known tool-call format"):
        ParserConfig(enable_auto_tool_choice=True).for_template("{{ messages }}")
    assert ParserConfig(enable_auto_tool_choice=True).for_template("<tool_call>").tool_call_parser == "hermes"


# ---- request plans and the choice parser ---------------------------------------------------
def request(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


AUTO = ParserConfig("hermes", True)


def test_required_schema_accepts_calls_and_refuses_others():
    schema = required_schema([WEATHER, TIME])
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
    ]}}
    validator = Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time",
                                                                                         "parameters": {}}])
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"days": 2}}])  # city is required
    assert not validator.is_valid([{"name": "send_mail", "parameters": {}}])
    assert required_schema([TIME], parallel=False)["maxItems"] == 1


def test_required_schema_keeps_each_tools_references_resolvable():
    """A tool's parameters sit inside the array of calls, so its local references are rebased:
    pydantic's "#/$defs/Name" (two tools may each define their own Address), a recursive "#",
    and zod's "#/properties/..."."""
    def address(kind: str) -> dict:
        return {"type": "object", "properties": {"city": {"type": kind}}, "required": ["city"]}

    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "$defs": {"Address": address("string")}}}}
    bill = {"type": "function", "function": {"name": "bill", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "$defs": {"Address": address("integer")}}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    same = {"type": "function", "function": {"name": "same", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}}}
    schema = required_schema([ship, bill, tree, same])
    validator = Draft202012Validator(schema)
    assert validator.is_valid([{"name": "ship", "parameters": {"to": {"city": "Oslo"}}},
                               {"name": "bill", "parameters": {"to": {"city": 7}}},
                               {"name": "tree", "parameters": {"kids": [{"kids": []}]}},
                               {"name": "same", "parameters": {"a": "x", "b": "y"}}])
    assert not validator.is_valid([{"name": "ship", "parameters": {"to": {"city": 7}}}])
    assert not validator.is_valid([{"name": "bill", "parameters": {"to": {"city": "Oslo"}}}])
    assert not validator.is_valid([{"name": "tree", "parameters": {"kids": [{"kids": [5]}]}}])
    assert not validator.is_valid([{"name": "same", "parameters": {"a": "x", "b": 3}}])
    assert ship["function"]["parameters"]["properties"]["to"] == {"$ref": "#/$defs/Address"}  # the request's own is kept
    plan = plan_tools(request(tools=[ship, bill], tool_choice="required"), ParserConfig())
    assert plan.structured_outputs.json == required_schema([ship, bill])



def test_required_schema_rebases_references_but_not_data_that_looks_like_one():
    """Only a schema's own "$ref" is rebased: a const, enum, default or examples value is data
    and keeps its text (the call's arguments must equal it), and a property named "default"
    is a schema whose reference still resolves."""
    data = {"$ref": "#/defs/a"}
    parameters = {"type": "object", "required": ["link"], "$defs": {"Name": {"type": "string"}}, "properties": {
        "link": {"const": data},
        "kind": {"enum": [data, {"$ref": "#"}], "default": data, "examples": [data]},
        "default": {"$ref": "#/$defs/Name"}}}
    link = {"type": "function", "function": {"name": "link", "parameters": parameters}}
    schema = required_schema([link])
    kept = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert kept["properties"]["link"] == {"const": data}
    assert kept["properties"]["kind"] == parameters["properties"]["kind"]
    validator = Draft202012Validator(schema)
    assert validator.is_valid([{"name": "link", "parameters": {"link": data, "kind": {"$ref": "#"}, "default": "x"}}])
    assert not validator.is_valid([{"name": "link", "parameters": {
        "link": {"$ref": "#/items/anyOf/0/properties/parameters/defs/a"}}}])
    assert not validator.is_valid([{"name": "link", "parameters": {"link": data, "default": 3}}])

def test_plans():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), ParserConfig())
    assert plan.mode == "required" and plan.structured_outputs.json == required_schema([WEATHER, TIME])
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}),
                       ParserConfig())
    assert (named.mode, named.function) == ("named", "get_weather")
    assert named.structured_outputs.json == WEATHER["function"]["parameters"]
    assert plan_tools(request(tools=[WEATHER]), AUTO).mode == "auto"  # OpenAI's default with tools
    none = plan_tools(request(tools=[WEATHER], tool_choice="none"), ParserConfig())
    assert none.mode == "none" and none.tools[0]["function"]["name"] == "get_weather"
    assert plan_tools(request(), ParserConfig()) == ToolPlan("none", None)


@pytest.mark.parametrize("fields, param, words", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "send_mail"}}), "tool_choice",
     "send_mail"),
    (dict(tools=[WEATHER]), "tool_choice", "--enable-auto-tool-choice"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools", "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]), "tools",
     "tools[0].function.parameters is not a valid JSON schema"),
    (dict(tools=[TIME, TIME], tool_choice="none"), "tools", "defined twice"),
])
def test_bad_tool_requests_name_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as info:
        plan_tools(request(**fields), ParserConfig())
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_a_tool_schema_sent_again_is_not_checked_again(monkeypatch):
    """Agents send the same tools every turn: a parameters schema is checked against the
    metaschema once (milliseconds each), and a bad one is refused every time."""
    checks = []
    real = Draft202012Validator.check_schema
    monkeypatch.setattr(Draft202012Validator, "check_schema",
                        classmethod(lambda cls, schema, **kw: (checks.append(schema), real(schema, **kw))[1]))
    good = {"type": "object", "properties": {"query": {"type": "string", "description": "seen once"}}}
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}}
    for turn in range(3):
        tools = [{"type": "function", "function": {"name": f"search_{turn}", "parameters": json.loads(json.dumps(good))}}]
        assert plan_tools(request(tools=tools, tool_choice="none"), ParserConfig()).tools[0]["function"]["parameters"] == good
        with pytest.raises(OpenAIError) as info:
            plan_tools(request(tools=[{"type": "function", "function": {"name": "f", "parameters": bad}}]), ParserConfig())
        assert info.value.param == "tools" and "tools[0].function.parameters is not a valid JSON schema" in info.value.message
    assert checks.count(good) == 1 and checks.count(bad) == 1


def test_choice_parser_reasoning_then_tools():
    text = ('<think>Need weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>')
    config = ParserConfig("hermes", True, "qwen3")
    plan = ToolPlan("auto", [WEATHER])
    assert assert_every_split_agrees(lambda: ChoiceParser(plan, config), text) == (
        None, "Need weather.", [("get_weather", '{"city": "Oslo"}')])
    parser = ChoiceParser(plan, config)
    merge_deltas([parser.feed(text), parser.finish()])
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    plain = ChoiceParser(plan, config)
    merge_deltas([plain.feed("<think>x</think>No tools needed."), plain.finish()])
    assert plain.finish_reason("stop") == "stop"
    # a named call keeps "stop"; a constrained output skips the reasoning parser
    named = ChoiceParser(ToolPlan("named", [WEATHER], "get_weather"), ParserConfig(reasoning_parser="deepseek_r1"))
    assert summary(merge_deltas([named.feed('{"city": "Oslo"}'), named.finish()])) == (
        None, None, [("get_weather", '{"city": "Oslo"}')])
    assert named.finish_reason("stop") == "stop"
    # so does an output under response_format / structured_outputs: all of it is the answer
    for parser_name in ("deepseek_r1", "qwen3"):
        json_answer = ChoiceParser(ToolPlan("none", []), ParserConfig(reasoning_parser=parser_name), True, True)
        assert summary(merge_deltas([json_answer.feed('{"a": 1}'), json_answer.finish()])) == ('{"a": 1}', None, [])


def test_arguments_stream_as_valid_json_once_complete():
    parsed = parse_whole(HermesToolParser(), HERMES)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"city": "Paris", "days": 12},
                                                                     {"tz": "UTC", "s": 'a "}" b'}]
