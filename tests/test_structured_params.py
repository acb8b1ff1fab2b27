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
