"""Structured output end to end on the tiny random Qwen3: every output that ends on its own
("stop") parses and validates against its JSON schema (jsonschema) or fully matches its regex,
greedy and sampled, batched with unconstrained requests that stay untouched; the same greedy
tokens with chunked prefill, async scheduling and forced preemption; the same greedy tokens as
Hugging Face transformers masked by the grammar; clear errors; a request waits for its grammar
while others run."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

pytest.importorskip("xgrammar", reason="xgrammar is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from structured_cases import REGEXES, SCHEMAS  # noqa: E402

SPECS = [StructuredOutputsParams(json=s) for s in SCHEMAS] + [StructuredOutputsParams(regex=r) for r in REGEXES]
PROMPT = "Paris is the capital of France. Answer in JSON:"
PLAIN_PROMPTS = ["The quick brown fox", "def main():", "Large language models"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    return LLM(str(qwen3_tiny), device="cpu", max_model_len=512)


def check(spec: StructuredOutputsParams, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), (spec.regex, text)
    elif spec.kind == "choice":
        assert text in spec.choice
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)


def run_mixed(llm: LLM, temperature: float, specs=SPECS, prompt=PROMPT):
    """The constrained requests batched with unconstrained ones; (constrained outputs, plain outputs)."""
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS, structured_outputs=s)
              for i, s in enumerate(specs)]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([prompt] * len(specs) + PLAIN_PROMPTS, params + [plain] * len(PLAIN_PROMPTS), use_tqdm=False)
    return [o.outputs[0] for o in outs[: len(specs)]], [o.outputs[0] for o in outs[len(specs):]]


def assert_valid(specs, outputs) -> None:
    stopped = [(s, c) for s, c in zip(specs, outputs) if c.finish_reason == "stop"]
    # A random model's output can run out of tokens inside a value ("length"); most end.
    assert len(stopped) >= 0.9 * len(specs), [c.text for c in outputs if c.finish_reason != "stop"]
    for spec, c in stopped:
        check(spec, c.text)


@pytest.fixture(scope="module")
def greedy_mixed(llm):
    return run_mixed(llm, 0.0)


def test_greedy_outputs_follow_their_schemas_and_plain_rows_are_untouched(llm, greedy_mixed):
    constrained, plain = greedy_mixed
    assert len(SPECS) >= 60
    assert_valid(SPECS, constrained)
    alone = llm.generate(PLAIN_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in plain] == [o.outputs[0].token_ids for o in alone]


def test_sampled_outputs_follow_their_schemas(llm):
    constrained, _ = run_mixed(llm, 1.0)
    assert_valid(SPECS, constrained)


def test_chunked_prefill_async_scheduling_and_preemption_give_the_same_tokens(qwen3_tiny, greedy_mixed):
    """16-token steps chunk the prompt; a pool of 48 blocks of 4 tokens cannot hold the batch,
    so sequences are preempted and recomputed; the matcher must follow all of it."""
    small = LLM(str(qwen3_tiny), device="cpu", max_model_len=512, max_num_batched_tokens=16, kvcache_block_size=4,
                num_kvcache_blocks=48, async_scheduling=True)
    try:
        constrained, plain = run_mixed(small, 0.0)
        engine = small.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.grammars.matchers and not engine.grammars.waiting
    finally:
        small.engine.shutdown()
    assert [c.token_ids for c in constrained] == [c.token_ids for c in greedy_mixed[0]]
    assert [c.token_ids for c in plain] == [c.token_ids for c in greedy_mixed[1]]


PREEMPTING = dict(max_num_batched_tokens=16, kvcache_block_size=4, num_kvcache_blocks=20)


@pytest.mark.parametrize("wide_masks_to_unmask, engine_args", [(None, {}), (0, {}), (0, PREEMPTING)])
def test_greedy_rows_checked_after_sampling_equal_masking_first(qwen3_tiny, llm, monkeypatch, wide_masks_to_unmask,
                                                                 engine_args):
    """With async scheduling, greedy constrained rows sample without their masks (outside the
    grammar's narrow stretches; with 0, everywhere) and the grammar checks their tokens
    afterwards (Grammars.check); a refused token is dropped and its sequence rolled back and
    sampled again under the mask. The tokens
    must be those of masking first (the synchronous engine), for those rows (also with n=2, a
    min_tokens ban with and without a logit_bias) and for rows that cannot be checked afterwards in the same
    batches (logprobs, a seeded temperature, a penalty), under chunked prefill and preemption
    too, and the path must really refuse and accept tokens."""
    from nanovllm.engine import grammars
    from nanovllm.engine.grammars import Grammars

    if wide_masks_to_unmask is not None:
        monkeypatch.setattr(grammars, "WIDE_MASKS_TO_UNMASK", wide_masks_to_unmask)

    specs = SPECS[:24]
    kinds = [dict(temperature=0), dict(temperature=0, logprobs=2), dict(temperature=0.8, seed=3),
             dict(temperature=0, presence_penalty=0.5), dict(temperature=0, n=2),
             dict(temperature=0, min_tokens=2, logit_bias={5: 2.0}), dict(temperature=0, min_tokens=3)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=s, **kinds[i % len(kinds)])
              for i, s in enumerate(specs)]
    prompts = [PROMPT] * len(specs) + PLAIN_PROMPTS
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PLAIN_PROMPTS)
    expected = llm.generate(prompts, params, use_tqdm=False)
    counts = {"checked": 0, "refused": 0}
    check = Grammars.check

    def counting_check(self, rows, tokens):
        refused = check(self, rows, tokens)
        counts["checked"] += len(rows)
        counts["refused"] += len(refused)
        return refused

    monkeypatch.setattr(Grammars, "check", counting_check)
    checked = LLM(str(qwen3_tiny), device="cpu", max_model_len=512, async_scheduling=True, **engine_args)
    try:
        outs = checked.generate(prompts, params, use_tqdm=False)
        engine = checked.engine
        assert not engine.grammars.matchers and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.scheduler.num_preemptions > 0 or not engine_args
    finally:
        checked.engine.shutdown()
    if wide_masks_to_unmask == 0:
        assert 0 < counts["refused"] < counts["checked"], counts
    else:
        assert counts["checked"] > 0, counts
    for want, got in zip(expected, outs):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
    assert_valid(specs, [o.outputs[0] for o in outs[: len(specs)]])


def test_aborting_a_request_whose_tokens_await_their_check_harms_nothing(qwen3_tiny, monkeypatch):
    """A request aborted while its last tokens were sampled without their masks (async
    scheduling, every checkable row unmasked): the other requests finish valid and equal to
    their own run, no matcher or KV block is left."""
    from nanovllm.engine import grammars

    monkeypatch.setattr(grammars, "WIDE_MASKS_TO_UNMASK", 0)
    llm = LLM(str(qwen3_tiny), device="cpu", max_model_len=512, async_scheduling=True)
    try:
        engine = llm.engine
        specs = SPECS[:6]
        for i, spec in enumerate(specs):
            engine.add_request(str(i), PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                              structured_outputs=spec))
        finished = {}

        def unchecked_seq_ids():
            step = engine._in_flight
            rows = [item for item in step.sched.seqs if item.sample] if step is not None else []
            return {rows[i].seq_id for i in step.unchecked} if step is not None else set()

        for _ in range(MAX_TOKENS // 2):  # until request 0's token in flight awaits its check
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            if engine.requests["0"].seqs[0].seq_id in unchecked_seq_ids():
                break
        assert engine.requests["0"].seqs[0].seq_id in unchecked_seq_ids() and "0" not in finished
        engine.abort_request("0")
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert sorted(finished) == [str(i) for i in range(1, len(specs))]
        alone = llm.generate([PROMPT] * (len(specs) - 1), [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                          structured_outputs=s) for s in specs[1:]],
                             use_tqdm=False)
        for i, out in enumerate(alone, start=1):
            assert finished[str(i)].outputs[0].token_ids == out.outputs[0].token_ids
        assert_valid(specs[1:], [finished[str(i)].outputs[0] for i in range(1, len(specs))])
        assert not engine.grammars.matchers and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.engine.shutdown()


def test_choice_grammar_json_object_and_n(llm):
    specs = [StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
             StructuredOutputsParams(grammar='root ::= "(" [1-9] " + " [1-9] ")"'),
             StructuredOutputsParams(json_object=True)]
    outs = llm.generate([PROMPT] * 3, [SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS,
                                                      structured_outputs=s) for s in specs], use_tqdm=False)
    for spec, out in zip(specs, outs):
        assert len(out.outputs) == 4
        for c in out.outputs:
            if c.finish_reason == "stop" or spec.kind != "json_object":
                assert c.finish_reason == "stop"
                check(spec, c.text)
    assert all(re.fullmatch(r"\([1-9] \+ [1-9]\)", c.text) for c in outs[1].outputs)


def test_greedy_matches_transformers_under_the_same_grammar(llm, qwen3_tiny):
    """Reference: the HF model, its last logits masked to the tokens the grammar's matcher
    allows (read bit by bit), argmax, until the grammar allows only EOS."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_tiny), dtype=torch.float32).eval()
    tokenizer = llm.engine.tokenizer
    eos = llm.engine.eos_token_ids
    vocab = llm.engine.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos))
    specs = [SPECS[32], StructuredOutputsParams(regex=r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)")]
    outs = llm.generate([PROMPT] * len(specs), [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=s)
                                                for s in specs], use_tqdm=False)
    for spec, out in zip(specs, outs):
        compiled = compiler.compile_json_schema(spec.spec, any_whitespace=False) if spec.kind == "json" \
            else compiler.compile_regex(spec.regex)
        matcher = xgr.GrammarMatcher(compiled)
        ids = tokenizer.encode(PROMPT)
        expected = []
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for _ in range(MAX_TOKENS):
            matcher.fill_next_token_bitmask(bitmask)
            words = bitmask[0].tolist()
            allowed = [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]
            if matcher.is_completed() and set(allowed) <= set(eos):
                break
            with torch.no_grad():
                logits = model(torch.tensor([ids + expected])).logits[0, -1]
            token = max(allowed, key=lambda t: (logits[t].item(), -t))
            if token in eos:
                break
            assert matcher.accept_token(token)
            expected.append(token)
        assert out.outputs[0].token_ids == expected, spec.spec
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar"),
    (StructuredOutputsParams(json={"type": "strng"}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"$ref": "#/$defs/nothing"}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "object", "patternProperties": {"^a": {}}}), "structured_outputs.json"),
    # allOf of two schemas (xgrammar would allow any JSON value), or beside other keywords (it
    # would keep only the allOf's schema)
    (StructuredOutputsParams(json={"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                             {"type": "object", "properties": {"b": {"type": "string"}}}]}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"],
                                   "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"x": {"allOf": [{"type": "integer"},
                                                                                    {"minimum": 3}]}}}),
     "structured_outputs.json"),
])
def test_bad_grammar_is_a_value_error_naming_the_field_and_harms_nothing(llm, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([PROMPT, "hello"], [SamplingParams(max_tokens=4),
                                         SamplingParams(max_tokens=4, structured_outputs=spec)], use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.grammars.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


I = {"type": "integer", "minimum": 0, "maximum": 9}
S = {"type": "string", "maxLength": 4}


@pytest.mark.parametrize("schema, where, wrong", [
    # keywords xgrammar does not enforce, behind a $ref to a place that is not a subschema keyword
    ({"$ref": "#/my/L", "my": {"L": {"type": "array", "items": I, "uniqueItems": True}}}, "#/my/L/uniqueItems",
     "[1, 1]"),
    ({"$ref": "#/x", "x": {"enum": ["a", "b"], "not": {"const": "a"}}}, "#/x/not", '"a"'),
    ({"$ref": "#/$defs/p", "$defs": {"p": {"$ref": "#/x/0"}}, "x": [{"type": "array", "items": I, "uniqueItems": True}]},
     "#/x/0/uniqueItems", "[1, 1]"),
    # keywords beside a $ref (xgrammar keeps the referenced schema alone)
    ({"$ref": "#/$defs/a", "maximum": 3, "$defs": {"a": {"type": "integer"}}}, "#/$ref", "9"),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/s", "maxLength": 1}}, "required": ["p"],
      "$defs": {"s": {"type": "string"}}}, "#/properties/p/$ref", '{"p": "ab"}'),
    # a required property that properties does not define is never written
    ({"type": "object", "properties": {"a": I}, "required": ["a", "b"]}, "#/required", '{"a": 1}'),
    ({"type": "object", "properties": {"a": I}, "required": ["b"], "additionalProperties": True}, "#/required",
     '{"a": 1}'),
    ({"type": "object", "properties": {"a": I, "b": I}, "anyOf": [{"required": ["a"]}]}, "#/anyOf", "{}"),
    # empty anyOf / oneOf / type
    ({"anyOf": []}, "#/anyOf", ""),
    ({"oneOf": []}, "#/oneOf", ""),
    ({"type": []}, "#/type", "[]"),
    # a reference out of the document
    ({"$ref": "https://example.com/schema.json"}, "#/$ref", "1"),
    ({"$ref": "#anchor", "$defs": {"a": {"$anchor": "anchor", "type": "integer"}}}, "#/$ref", '"x"'),
    # keywords xgrammar drops beside others: a string's pattern, format and length bounds (it
    # keeps one), anything beside an anyOf (it keeps the anyOf), a type its schemas do not keep to
    ({"type": "string", "pattern": "^[A-Z]+$", "maxLength": 4}, "#: pattern and minLength/maxLength", '"ABCDEFG"'),
    ({"type": "string", "format": "date", "maxLength": 3}, "#: format and minLength/maxLength", '"2020-08-04"'),
    ({"type": "string", "format": "email", "pattern": "^x+@x+[.]com$"}, "#: pattern and format", '"a@b.co"'),
    ({"type": "integer", "minimum": 0, "maximum": 9, "anyOf": [{"type": "integer"}, S]}, "#/anyOf beside maximum, minimum",
     "20"),
    ({"type": "string", "anyOf": [I]}, "#/type beside anyOf", "5"),
    # keywords of one type on a node with no type: xgrammar allows any value there
    ({"minimum": 5, "maximum": 6}, "#/minimum without a type", "123"),
    ({"type": "object", "properties": {"a": {"pattern": "^a$"}}, "required": ["a"]}, "#/properties/a/pattern",
     '{"a": "b"}'),
    ({"minItems": 2}, "#/minItems without a type", "[1]"),
    # a oneOf whose schemas are not plainly exclusive (xgrammar holds it as an anyOf)
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "#/oneOf", "1"),
    ({"oneOf": [{"type": "object", "properties": {"a": I}}, {"type": "object", "properties": {"b": I}}]}, "#/oneOf",
     "{}"),
    ({"oneOf": [{"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": True},
                {"type": "object", "properties": {"b": S}, "required": ["b"], "additionalProperties": True}]},
     "#/oneOf", '{"a": "x", "b": "y"}'),
    ({"oneOf": [{"type": "string"}, {"properties": {"path": S}, "required": ["path"]}]}, "#/oneOf", '"x"'),
    # not a JSON schema at all (the metaschema's check)
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}, "required": ["a"]},
     "#/properties/a/maxLength", '{"a": "x"}'),
    # const / enum values the rest of their schema does not allow
    ({"type": "integer", "const": "a"}, "#/const", '"a"'),
    ({"type": "integer", "minimum": 5, "const": 3}, "#/const", "3"),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 1, "enum": ["d", "abc"]}}},
     "#/properties/s/enum", '{"s": "abc"}'),
])
def test_schemas_xgrammar_would_enforce_wrongly_are_refused_naming_the_place(schema, where, wrong):
    """Each schema is refused, naming where in it the problem is; xgrammar's own grammar for it
    takes `wrong`, which is not a valid instance."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from nanovllm.structured.grammar import build_grammar

    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*" + re.escape(where)):
        build_grammar(StructuredOutputsParams(json=schema))
    unchecked = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert _is_grammar_accept_string(unchecked, wrong)
    with pytest.raises((ValueError, jsonschema.SchemaError, jsonschema.ValidationError,
                        jsonschema.exceptions._RefResolutionError)):
        jsonschema.validate(json.loads(wrong), schema)


@pytest.mark.parametrize("schema, right, wrong", [
    ({"type": "object", "properties": {"a": I, "b": I}, "required": ["a", "b"]}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"type": "string", "required": ["x"]}, '"x"', "1"),  # required means nothing to a string
    ({"type": "integer", "enum": [1, 2]}, "2", "3"),
    ({"type": ["integer", "null"], "const": None}, "null", "1"),
    ({"$ref": "#/$defs/a~1b%20c", "$defs": {"a/b c": {"$ref": "#/x"}}, "x": I}, "5", "10"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, '{"next": {"next": {}}}', '{"next": 1}'),
    # annotations beside a $ref (as pydantic writes a field's description and default)
    ({"$ref": "#/$defs/a", "description": "d", "default": 1, "$defs": {"a": I}}, "5", "10"),
    # a oneOf of exclusive schemas: distinct types; objects a const tells apart (pydantic's
    # discriminated union), or the properties they require
    ({"oneOf": [I, S]}, '"a"', "true"),
    ({"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "$defs": {
        "Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"}, "lives": I},
                "required": ["kind"]},
        "Dog": {"type": "object", "properties": {"kind": {"const": "dog", "type": "string"}, "lives": I},
                "required": ["kind"]}}}, '{"kind": "dog", "lives": 1}', '{"kind": "cow"}'),
    ({"oneOf": [{"type": "object", "properties": {"a": I}, "required": ["a"]},
                {"type": "object", "properties": {"b": I}, "required": ["b"]}]}, '{"b": 2}', "{}"),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}, "name": S}, "required": ["kind", "name"]},
                {"type": "object", "properties": {"kind": {"enum": ["lizard", "reptile"], "type": "string"}, "name": S},
                 "required": ["kind", "name"]}]}, '{"kind": "reptile", "name": "x"}', '{"kind": "dog", "name": "x"}'),
    ({"type": "string", "oneOf": [{"const": "s", "title": "Small"}, {"const": "m", "title": "Medium"}]}, '"s"', '"c"'),
    # a string's length bounds that its pattern or format keeps anyway
    ({"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]{3}$"}, '"ABC"', '"AB"'),
    ({"type": "string", "format": "date", "maxLength": 10}, '"2020-01-02"', '"x"'),
    ({"type": "string", "format": "email", "minLength": 1}, '"a@b.co"', '""'),
    # a type beside a $ref whose schema keeps to it
    ({"type": "object", "$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": I},
                                                             "required": ["a"]}}}, '{"a": 1}', '{"a": 10}'),
    # a type beside an anyOf whose schemas keep to it (as tool_choice "required" writes), or
    # annotations (pydantic's Optional field)
    ({"type": "object", "anyOf": [{"properties": {"a": I}, "required": ["a"]},
                                  {"properties": {"b": S}, "required": ["b"]}]}, '{"a": 1}', '{"c": 1}'),
    ({"anyOf": [I, {"type": "null"}], "default": None, "title": "X"}, "null", '"a"'),
    # keywords of another type than the node's mean nothing there
    ({"type": ["integer", "string"], "minimum": 5}, '"x"', "3"),
    ({"type": "integer", "minimum": 1, "maxLength": 2}, "100", "0"),
])
def test_schemas_close_to_the_refused_ones_build_and_hold(schema, right, wrong):
    from xgrammar.testing import _is_grammar_accept_string

    from nanovllm.structured.grammar import build_grammar

    grammar = build_grammar(StructuredOutputsParams(json=schema))
    assert _is_grammar_accept_string(grammar, right) and not _is_grammar_accept_string(grammar, wrong)
    jsonschema.validate(json.loads(right), schema)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_allows_no_token_ends_its_sample_with_error_and_harms_nothing(llm, temperature):
    """xgrammar compiles grammars that match nothing; where such a grammar allows no token at
    all, its sample ends with finish reason "error" and without the token sampled under the
    empty mask (nor that token's logprobs); the batch's other requests run on unharmed."""
    dead = [StructuredOutputsParams(grammar="root ::= root"),
            StructuredOutputsParams(json={"type": "string", "pattern": "[^\\s\\S]"})]
    params = [SamplingParams(temperature=temperature, seed=1, max_tokens=8, logprobs=2, structured_outputs=s)
              for s in dead]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT, "hello"], params + [plain], use_tqdm=False)
    first, second, other = (o.outputs[0] for o in outs)
    assert (first.finish_reason, first.token_ids, first.logprobs) == ("error", [], [])
    assert (second.finish_reason, second.text, len(second.logprobs)) == ("error", '"', 1)
    assert other.finish_reason == "length" and len(other.token_ids) == 6
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.grammars.matchers
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_waits_for_its_grammar_while_others_run(llm, monkeypatch):
    from nanovllm.structured.compiler import GrammarCompiler

    release = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow_compile(self, grammar):
        release.wait(30)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    engine = llm.engine
    spec = StructuredOutputsParams(regex=r"slow[0-9]{2}")  # not compiled yet: not cached
    engine.add_request("constrained", PROMPT, SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec))
    engine.add_request("aborted", PROMPT, SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(
        regex=r"other[0-9]")))
    engine.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "constrained" in engine.grammars.waiting
    assert engine.requests["constrained"].seqs[0].completion_token_ids == []
    # With nothing else to run, a step waits for the grammars (up to 0.05 s): it counts as a
    # step, and its wait does not count in the engine's busy seconds (nanovllm_engine_step_seconds).
    steps, busy, start = engine.num_steps, engine.step_seconds, time.perf_counter()
    for _ in range(3):
        assert engine.step() == []
    waited = time.perf_counter() - start
    assert engine.num_steps == steps + 3 and waited >= 0.1 and engine.step_seconds - busy < waited / 2
    aborted = engine.abort_request("aborted")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    release.set()
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    out = finished["constrained"].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"slow[0-9]{2}", out.text)
    # The same spec again: the compile cache answers at once, no new compile.
    assert engine.grammars.submit("again", spec).done()
    engine.grammars.waiting.pop("again")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_grammars_checked_in_the_pool_add_at_once_and_end_a_bad_spec_later(llm, monkeypatch):
    """With check_in_pool (the engine core's setting), adding a request whose grammar is slow to
    build returns at once and other requests run meanwhile; a spec whose build fails ends its
    request ("abort") instead of raising, and that failure is cached: the same spec again is
    a ValueError at once."""
    import nanovllm.structured.compiler as compiler

    build = compiler.build_grammar

    def slow_build(spec):
        time.sleep(1.5)
        return build(spec)

    monkeypatch.setattr(compiler, "build_grammar", slow_build)
    engine = llm.engine
    monkeypatch.setattr(engine.grammars, "check_in_pool", True)
    start = time.perf_counter()
    engine.add_request("slow", PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
        StructuredOutputsParams(regex=r"pool[0-9]{2}"))))
    bad = StructuredOutputsParams(grammar="root ::= missing")
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=8, structured_outputs=bad))
    assert time.perf_counter() - start < 1.0
    engine.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert time.perf_counter() - start < 1.5 and "slow" in engine.grammars.waiting
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch(r"pool[0-9]{2}", finished["slow"].outputs[0].text)
    assert finished["bad"].outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        engine.add_request("bad again", PROMPT, SamplingParams(max_tokens=8, structured_outputs=bad))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failed_compile_ends_its_request_with_an_output_when_a_cached_one_is_added(llm, monkeypatch):
    """A's grammar fails to compile while B, whose grammar is cached, is added: A still ends with
    a final "abort" output from a step (none is lost), and B runs."""
    from concurrent.futures import Future

    engine = llm.engine
    cached = StructuredOutputsParams(choice=["yes", "no"])
    engine.add_request("warm", PROMPT, SamplingParams(max_tokens=4, structured_outputs=cached))
    while engine.has_unfinished_requests():
        engine.step()
    compiler = engine.grammars._compiler
    failing = Future()
    submit = compiler.submit
    monkeypatch.setattr(compiler, "submit", lambda spec, **kw: failing if spec.kind == "regex" else submit(spec, **kw))
    engine.add_request("A", PROMPT, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="x+")))
    failing.set_exception(RuntimeError("compile failed"))
    engine.add_request("B", PROMPT, SamplingParams(max_tokens=4, structured_outputs=cached))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["A"].outputs[0].finish_reason == "abort"
    assert finished["B"].outputs[0].text in ("yes", "no")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def enum_schema(tag: str, values: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"enum": [f"{tag}{i}" for i in range(values)]})


def test_the_compile_cache_holds_grammars_within_its_byte_budget(tokenizer_dir):
    """Grammars of large enums take megabytes each: the cache drops the least recently used
    ones while their tables together pass its byte budget (not only past CACHE_SIZE), so a
    client sending such schemas, each within the size limit, cannot grow the engine's memory
    without bound. The newest stays, however large."""
    from transformers import AutoTokenizer

    from nanovllm.structured.compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    args = (tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    small, big, bigger = enum_schema("s", 10), enum_schema("b", 2000), enum_schema("c", 4000)
    sizing = GrammarCompiler(*args)
    size = {name: sizing.submit(spec).result().memory_size_bytes for name, spec in
            (("small", small), ("big", big), ("bigger", bigger))}
    sizing.shutdown()
    assert size["small"] < size["big"] < size["bigger"]
    compiler = GrammarCompiler(*args, cache_bytes=size["small"] + size["big"])
    first_small, first_big = compiler.submit(small), compiler.submit(big)
    first_small.result(), first_big.result()
    assert compiler.submit(small) is first_small and compiler.submit(big) is first_big  # both fit: cached
    compiler.submit(bigger).result()
    assert compiler.cached_bytes == size["bigger"]  # over the budget alone, but the newest: kept
    assert compiler.submit(bigger).done()
    again = compiler.submit(small)  # dropped: compiled again
    assert again is not first_small and again.result().memory_size_bytes == size["small"]
    assert compiler.cached_bytes <= size["small"] + size["big"]
    compiler.shutdown()


def test_a_slow_compile_holds_up_no_other(tokenizer_dir, monkeypatch):
    """A grammar that takes long to build (a pattern's long repeat can take seconds) runs
    beside the others, even on a machine of few cores: a request with another grammar gets
    its own while the slow one is still building."""
    from transformers import AutoTokenizer

    from nanovllm.structured import compiler as compiler_module

    slow_started, release = threading.Event(), threading.Event()
    build = compiler_module.build_grammar

    def build_slowly(spec):
        if spec.regex.startswith("slow"):
            slow_started.set()
            release.wait(30)
        return build(spec)

    monkeypatch.setattr(compiler_module, "build_grammar", build_slowly)
    monkeypatch.setattr(compiler_module.os, "cpu_count", lambda: 2)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = compiler_module.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    slows = [compiler.submit(StructuredOutputsParams(regex="slow"), check_in_pool=True)]
    assert slow_started.wait(30)
    slows += [compiler.submit(StructuredOutputsParams(regex=f"slow|{i}"), check_in_pool=True) for i in range(3)]
    try:
        fast = compiler.submit(StructuredOutputsParams(regex="fast"), check_in_pool=True)
        assert fast.result(timeout=30) is not None and not slows[0].done()
    finally:
        release.set()
    assert all(f.result(timeout=30) is not None for f in slows)
    compiler.shutdown()


def test_each_refusal_doubles_the_wide_masks_a_sequence_needs_before_it_samples_unmasked(tokenizer_dir):
    """Grammars' rationing of unmasked samples, which the engine's roll-backs make costly: a
    new sequence is masked until WIDE_MASKS_TO_UNMASK wide masks in a row; after its k-th
    refusal it is masked for 2**k times as many (up to MAX_WIDE_MASKS_TO_UNMASK)."""
    from transformers import AutoTokenizer

    from nanovllm.engine import grammars
    from nanovllm.engine.grammars import Grammars
    from nanovllm.step import ScheduledSeq, SchedulerOutput

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    g = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = StructuredOutputsParams(regex="[^x]*!")  # wide masks: every token without an x (and not done)
    g.submit("r", spec).result()
    (_, compiled), = g.compiled()
    g.start(0, compiled)
    refused_token = next(t for t in range(vocab) if "x" in tokenizer.decode([t]))
    params = SamplingParams(temperature=0, structured_outputs=spec)
    item = ScheduledSeq(0, [1], 5, [0], True, params, None, None)
    sched = SchedulerOutput([item], 1, 1)

    def masked_steps() -> int:
        """Refreshes until the row is left unmasked; their number."""
        for n in range(200):
            done, unchecked = g.refresh(sched, check_after=True)
            assert not done
            if unchecked == [0]:
                return n
            assert item.token_bitmask is not None
        raise AssertionError("never unmasked")

    assert masked_steps() == grammars.WIDE_MASKS_TO_UNMASK
    for k in range(1, 8):
        assert g.check([item], [refused_token]) == [0]
        assert masked_steps() == min(grammars.WIDE_MASKS_TO_UNMASK * 2**k, grammars.MAX_WIDE_MASKS_TO_UNMASK)
    allowed = next(t for t in range(vocab) if tokenizer.decode([t]).isalpha() and "x" not in tokenizer.decode([t]))
    assert g.check([item], [allowed]) == []
    g.drop([0])
    g.shutdown()


def test_each_masked_row_gets_its_own_sequences_mask_as_the_masked_rows_change(tokenizer_dir):
    """Step after step, with the step's masked rows changing in number and order (a new
    sequence each step, the batch's order reversed every other step), each row's mask allows
    exactly what its own sequence's grammar allows next."""
    from transformers import AutoTokenizer

    from nanovllm.engine.grammars import Grammars
    from nanovllm.step import ScheduledSeq, SchedulerOutput
    from nanovllm.structured.matcher import allowed_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    g = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    letters = "abcdefgh"
    specs = {letter: StructuredOutputsParams(regex=f"{letter}+!") for letter in letters}
    for letter, spec in specs.items():
        g.submit(letter, spec)
    compiled = {}
    while len(compiled) < len(specs):
        compiled.update(g.compiled())
    single = {letter: next(t for t in range(vocab) if tokenizer.decode([t]) == letter) for letter in letters}
    started = []
    for step in range(12):
        if step < len(letters):
            g.start(step, compiled[letters[step]])
            started.append(step)
        order = started[::-1] if step % 2 else started
        # greedy and sampled rows alike: a narrow grammar keeps every row masked
        items = [ScheduledSeq(s, [1], 5, [0], True, SamplingParams(temperature=s % 2, structured_outputs=specs[letters[s]]),
                              None, None) for s in order]
        done, unchecked = g.refresh(SchedulerOutput(items, len(items), len(items)), check_after=True)
        assert not done and not unchecked
        for item in items:
            letter = letters[item.seq_id]
            allowed = {tokenizer.decode([t]) for t in allowed_token_ids(item.token_bitmask).tolist()}
            assert letter in allowed, (step, letter)
            assert all(text == "!" or set(text) <= {letter, "!"} for text in allowed), (step, letter, allowed)
        for item in items:
            assert g.accept(item.seq_id, single[letters[item.seq_id]]) is None
    g.drop(started)
    g.shutdown()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]},
    {"type": "object", "additionalProperties": True},  # json_object's: any value under any key
])
def test_json_strings_take_utf8_characters_and_nothing_else(tokenizer_dir, schema):
    """Inside a JSON string the grammar takes any UTF-8 character but raw control characters and
    surrogate code points (U+D800-U+DFFF: their 3-byte forms are not UTF-8, decode to
    replacement characters and so break maxLength)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from nanovllm.structured.grammar import build_grammar

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    compiled = compiler.compile_grammar(build_grammar(StructuredOutputsParams(json=schema)))
    opening = b'{"s": "'

    def takes(chars: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(opening)
        return matcher.accept_string(chars)

    assert takes("é한🙂a".encode())
    if "maxLength" not in json.dumps(schema):  # xgrammar's length-bounded strings take no escapes
        assert takes(b"\\n\\u00e9")
    for bad in (b"\xed\xa0\x80", b"\xed\xae\x89", b"\xed\xbf\xbf", b"\x01", b"\n"):
        assert not takes(bad), bad
