"""Structured output through the server (engine core in its own process, as `nanovllm serve`
runs it): response_format json_schema / json_object and vLLM's structured_outputs on both
endpoints, streamed or not; the official client's `chat.completions.parse` with a pydantic
model; bad grammars are 400s with OpenAI's body naming the field, and harm nothing."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="xgrammar is not installed")

from test_server import KEY, MODEL, assert_error_body, live, pool_is_free, wait_until  # noqa: E402,F401 (live: the fixture)

MESSAGES = [{"role": "user", "content": "Where is the Eiffel tower? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "floors": {"type": "integer",
          "minimum": 1, "maximum": 3}}, "required": ["city", "floors"], "additionalProperties": False}


class Landmark(BaseModel):
    city: Literal["Paris", "Rome", "Berlin"]
    year: int = Field(ge=1800, le=2000)
    open: bool


def test_chat_json_schema_streamed_or_not(live):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    r = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, temperature=0,
                                            max_completion_tokens=40)
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    assert answer["city"] in ("Paris", "Rome") and 1 <= answer["floors"] <= 3 and set(answer) == {"city", "floors"}
    chunks = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, temperature=0,
                                                 max_completion_tokens=40, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


LINE_BREAKS_JSON_KEEPS = "a\u2028b\x85c\u2029d"  # str.splitlines breaks at each; JSON need not escape them


def test_streamed_text_with_unicode_line_breaks_reads_back_whole(live):
    """A grammar makes the output hold the characters that str.splitlines takes for line ends:
    a client that reads the stream with httpx's aiter_lines (which splits that way) still gets
    each event whole, and so does the load generator's own SSE reader."""
    from nanovllm.entrypoints.serve_bench import sse_lines

    body = {"model": MODEL, "prompt": "Say it:", "max_tokens": 30, "temperature": 0, "stream": True,
            "structured_outputs": {"choice": [LINE_BREAKS_JSON_KEEPS]}}

    async def read(split_by_httpx: bool) -> str:
        text = []
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}) as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.aiter_lines() if split_by_httpx else sse_lines(resp.aiter_bytes())
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    assert asyncio.run(read(split_by_httpx=True)) == LINE_BREAKS_JSON_KEEPS
    assert asyncio.run(read(split_by_httpx=False)) == LINE_BREAKS_JSON_KEEPS


def test_openai_client_parse_returns_the_pydantic_object(live):
    r = live.client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Landmark, temperature=0.8,
                                           seed=3, max_completion_tokens=64)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Landmark) and 1800 <= parsed.year <= 2000


def test_completions_structured_outputs_and_json_object(live):
    r = live.client.completions.create(model=MODEL, prompt="Is Paris in France?", max_tokens=20, n=3, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [c.text in ("yes", "no") for c in r.choices] == [True] * 3
    r = live.client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = live.client.completions.create(model=MODEL, prompt="JSON:", max_tokens=30, temperature=0,
                                       extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")
    r = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=30, temperature=0,
                                            extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
    assert json.loads(r.choices[0].message.content)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("route, extra, param", [
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strng"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
], ids=["bad-regex", "two-kinds", "json-text", "bad-gbnf", "unsupported-keyword", "bad-type", "no-schema",
        "unknown-type", "both-fields"])
def test_bad_structured_requests_are_400_naming_the_field(live, route, extra, param):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": MESSAGES}
    err = assert_error_body(live.http.post(route, json={**body, "max_tokens": 4, **extra}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert wait_until(lambda: pool_is_free(live.engine))
    r = live.client.completions.create(model=MODEL, prompt="fine", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_openai_client_raises_bad_request_for_a_bad_schema(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert info.value.body["param"] == "response_format" and "uniqueItems" in info.value.body["message"]


@pytest.mark.parametrize("route, extra, where", [
    ("/v1/completions", {"structured_outputs": {"json": {"$ref": "#/my/L", "my": {"L": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}, "#/my/L/uniqueItems"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}}}}, "#/required"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "integer", "enum": ["a", 1]}}}, "#/enum"),
], ids=["keyword-behind-ref", "required-undefined", "enum-off-type"])
def test_a_schema_the_grammar_would_not_hold_is_a_400_naming_the_place(live, route, extra, where):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": MESSAGES}
    err = assert_error_body(live.http.post(route, json={**body, "max_tokens": 4, **extra}), 400)
    assert err["param"] == next(iter(extra)) and where in err["message"], err


@pytest.mark.parametrize("depth", [65, 950])  # 950: just within what the server's JSON parser takes
@pytest.mark.parametrize("route, param", [("/v1/completions", "structured_outputs"),
                                          ("/v1/chat/completions", "response_format")])
def test_a_schema_nested_too_deeply_is_a_400_naming_the_field(live, route, param, depth):
    schema = '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)
    if route == "/v1/completions":
        body = '{"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": %s}}' % schema
    else:
        body = ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": '
                '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % schema)
    err = assert_error_body(live.http.post(route, content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "is nested too deeply (more than 64 levels" in err["message"], err


DEAD_ENDS = [({"grammar": "root ::= root"}, 0),  # matches nothing: no first token
             ({"json": {"type": "string", "pattern": "[^\\s\\S]"}}, 1)]  # its opening quote, then nothing


@pytest.mark.parametrize("so, tokens", DEAD_ENDS, ids=["no-first-token", "after-one-token"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_grammar_that_matches_no_output_is_a_400_streamed_or_not(live, so, tokens, route):
    """xgrammar compiles these, but they allow no token at some point: the request ends with a
    400 naming the field (an error event in a stream), not a "shutting down" 503 that clients
    retry; the server keeps serving."""
    body = ({"prompt": "x"} if route == "/v1/completions" else {"messages": MESSAGES}) | {
        "max_tokens": 8, "temperature": 0, "structured_outputs": so}
    err = assert_error_body(live.http.post(route, json=body), 400)
    assert err["param"] == "structured_outputs" and f"after {tokens} tokens" in err["message"]
    with live.http.stream("POST", route, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["param"] == "structured_outputs" and "matches no complete output" in err["message"]
    assert wait_until(lambda: pool_is_free(live.engine))
    r = live.client.completions.create(model=MODEL, prompt="fine", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_the_server_checks_a_constraint_once_not_per_request(live, monkeypatch):
    """The server builds a request's grammar for its errors before the engine sees it; a
    constraint that passed is not built again for the next request, one that failed is."""
    import nanovllm.entrypoints.server as server

    built = []
    build = server._build_grammar
    monkeypatch.setattr(server, "_build_grammar", lambda spec: (built.append(spec.kind), build(spec))[1])
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "once[0-9]+"}}
    for _ in range(3):
        assert live.http.post("/v1/completions", json=body).status_code == 200
    bad = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(once"}}
    for _ in range(2):
        assert assert_error_body(live.http.post("/v1/completions", json=bad), 400)["param"] == "structured_outputs"
    assert built == ["regex"] * 3  # the good one once, the bad one each time


def test_a_grammar_check_still_queued_when_its_client_leaves_is_dropped(live, monkeypatch):
    """Slow checks hold every one of the front-end's grammar-check threads; one more waits for
    one. All their clients leave: each request ends at once (499), the queued check never runs,
    and the next request is checked at once."""
    import threading

    import nanovllm.entrypoints.server as server

    started, release = [], threading.Event()
    build = server._build_grammar

    def slow_build(spec):
        if spec.kind == "regex" and spec.regex.startswith("slow"):
            started.append(spec.regex)
            release.wait(30)
        return build(spec)

    monkeypatch.setattr(server, "_build_grammar", slow_build)

    def leave_early(regex):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(live.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1,
                       json={"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": regex}})

    def dropped() -> float:  # requests answered 499: their client left first
        for family in text_string_to_metric_families(live.http.get("/metrics").text):
            for sample in family.samples:
                if sample.name == "nanovllm_http_requests_total" and sample.labels == {
                        "code": "499", "endpoint": "/v1/completions"}:
                    return sample.value
        return 0.0

    threads = server.GRAMMAR_CHECK_THREADS
    before = dropped()
    clients = [threading.Thread(target=leave_early, args=(f"slow{i}[a-z]",)) for i in range(threads + 1)]
    for client in clients:
        client.start()
    assert wait_until(lambda: len(started) == threads)
    for client in clients:
        client.join()
    assert wait_until(lambda: dropped() == before + threads + 1)  # each answered once its client left
    release.set()
    body = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "next[0-9]"}}
    assert live.http.post("/v1/completions", json=body).status_code == 200
    assert len(started) == threads  # the last slow check, queued behind the others, never ran


def test_a_slow_grammar_check_holds_up_no_other(live, monkeypatch):
    """A grammar that takes long to build (a pattern's long repeat can take seconds) is
    checked beside the others: a request with another new grammar is answered meanwhile."""
    import threading

    import nanovllm.entrypoints.server as server

    started, release = threading.Event(), threading.Event()
    build = server._build_grammar

    def slow_build(spec):
        if spec.kind == "regex" and spec.regex.startswith("slower"):
            started.set()
            release.wait(30)
        return build(spec)

    monkeypatch.setattr(server, "_build_grammar", slow_build)
    slow = [threading.Thread(target=live.http.post, args=("/v1/completions",), kwargs=dict(json={
        "prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": f"slower{i}[a-z]"}})) for i in range(2)]
    for client in slow:
        client.start()
    try:
        assert started.wait(30)
        body = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "quick[0-9]"}}
        assert live.http.post("/v1/completions", json=body, timeout=20).status_code == 200
    finally:
        release.set()
        for client in slow:
            client.join()
