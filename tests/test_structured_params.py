"""StructuredOutputsParams: exactly one field set, each checked for form, a ValueError naming it."""
import pytest

from nanovllm import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, field", [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a+"}, "exactly one"),
    ({"json": "[1, 2"}, "StructuredOutputsParams.json"),
    ({"json": [1, 2]}, "StructuredOutputsParams.json"),
    ({"json": {"x": object()}}, "StructuredOutputsParams.json"),
    ({"regex": ""}, "StructuredOutputsParams.regex"),
    ({"regex": 5}, "StructuredOutputsParams.regex"),
    ({"grammar": ""}, "StructuredOutputsParams.grammar"),
    ({"choice": []}, "StructuredOutputsParams.choice"),
    ({"choice": ["a", 3]}, "StructuredOutputsParams.choice"),
    ({"choice": "ab"}, "StructuredOutputsParams.choice"),
    ({"json_object": "yes"}, "StructuredOutputsParams.json_object"),
])
def test_bad_structured_outputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_a_schema_text_nested_too_deeply_is_a_short_value_error():
    deep = '{"items": ' * 100_000 + "{}" + "}" * 100_000
    with pytest.raises(ValueError, match="StructuredOutputsParams.json: is nested too deeply") as info:
        StructuredOutputsParams(json=deep)
    assert len(str(info.value)) < 400  # not the whole text back


def nested_items(depth: int, as_text: bool) -> dict | str:
    """A schema of `depth` objects, each the `items` of the one around it (or its JSON text)."""
    if as_text:
        return '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_is_at_most_max_schema_depth_deep(as_text):
    from nanovllm.sampling_params import MAX_SCHEMA_DEPTH

    assert StructuredOutputsParams(json=nested_items(MAX_SCHEMA_DEPTH, as_text)).kind == "json"
    for depth in (MAX_SCHEMA_DEPTH + 1, 5000):  # 5000: deeper than json.dumps and json.loads recurse
        with pytest.raises(ValueError, match=rf"^StructuredOutputsParams\.json: is nested too deeply \(more than "
                                             rf"{MAX_SCHEMA_DEPTH} levels"):
            StructuredOutputsParams(json=nested_items(depth, as_text))


def test_a_schema_is_at_most_max_schema_chars_long():
    from nanovllm.sampling_params import MAX_SCHEMA_CHARS

    def schema(chars: int) -> dict:  # `chars` characters as compact JSON text
        return {"description": "x" * (chars - len('{"description":""}'))}

    assert len(StructuredOutputsParams(json=schema(MAX_SCHEMA_CHARS)).spec) == MAX_SCHEMA_CHARS
    with pytest.raises(ValueError, match=rf"^StructuredOutputsParams\.json: is too long \({MAX_SCHEMA_CHARS + 1} "):
        StructuredOutputsParams(json=schema(MAX_SCHEMA_CHARS + 1))


def test_structured_outputs_is_frozen_and_keyed_by_canonical_text():
    a = StructuredOutputsParams(json='{"b": 1,  "a": {"type": "string"}}')
    b = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    assert (a.kind, a.spec) == ("json", '{"b":1,"a":{"type":"string"}}')  # key order kept: it is the output's
    assert hash(a) == hash(b)
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(AttributeError):
        a.regex = "x"  # type: ignore[misc]


def test_sampling_params_takes_structured_outputs():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    assert params.edits_logits and not params.plain_temperature
    assert not SamplingParams().edits_logits
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}),
    StructuredOutputsParams(json='{"type": "string"}'),
    StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(choice=["x", "y z"]),
    StructuredOutputsParams(grammar='root ::= "a"'),
    StructuredOutputsParams(json_object=True),
])
def test_structured_outputs_cross_to_the_core_intact(spec):
    msgspec = pytest.importorskip("msgspec")
    from nanovllm.engine.messages import AddRequest, FrontendMessage, params_from_wire, params_to_wire

    p = SamplingParams(temperature=0.5, structured_outputs=spec)
    wire = msgspec.msgpack.encode(AddRequest("r", [1, 2], params_to_wire(p)))
    back = params_from_wire(msgspec.msgpack.Decoder(FrontendMessage).decode(wire).params)
    assert back == p and back.structured_outputs.spec == spec.spec


def test_response_format_and_structured_outputs_map_onto_the_params():
    pytest.importorskip("fastapi")
    from nanovllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}})
    assert chat.sampling_params(16, None, 384, {}).structured_outputs == StructuredOutputsParams(json=schema)
    done = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert done.sampling_params(16, None, 384, {}).structured_outputs == StructuredOutputsParams(json_object=True)
    vllm = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert vllm.sampling_params(16, None, 384, {}).structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    text = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert text.sampling_params(16, None, 384, {}).structured_outputs is None


@pytest.mark.parametrize("field, param", [("structured_outputs", "structured_outputs"),
                                          ("response_format", "response_format")])
@pytest.mark.parametrize("schema, why", [
    (nested_items(5000, as_text=False), "is nested too deeply"),  # deeper than a recursive walk of the request goes
    ({"description": "x" * 300_000}, "is too long"),
], ids=["deep", "long"])
def test_a_request_with_a_schema_out_of_bounds_is_a_400_naming_the_field(field, param, schema, why):
    pytest.importorskip("fastapi")
    from nanovllm.entrypoints.protocol import CompletionRequest, OpenAIError

    value = {"json": schema} if field == "structured_outputs" else {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    request = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(OpenAIError) as info:
        request.sampling_params(16, None, 384, {})
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"StructuredOutputsParams.json: {why}")
