"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client.

One server (uvicorn in a background thread, on a port the OS picks, its engine core in a child
process as `nanovllm serve` runs it) serves the tiny Qwen3 checkpoint with a deliberately small
KV pool (96 blocks of 4 tokens), so concurrent load forces preemption. Greedy outputs are compared with the offline `LLM` on the same checkpoint. A second
engine is broken on purpose (its step raises) to check error propagation, and one test runs
`nanovllm serve` as a process to check SIGTERM handling and the exit code.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncEngine, EngineDeadError
from nanovllm.engine.core import CoreProcess
from nanovllm.engine.core_client import CoreClient
from nanovllm.entrypoints.serve_bench import ServeBenchConfig, run_serve_bench
from nanovllm.entrypoints.server import create_app

KEY = "test-key"
MODEL = "tiny"
# decode_burst=3: greedy lone requests decode 3 steps per engine step, as the GPU does (8)
ENGINE_KW = dict(device="cpu", max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=96, decode_burst=3)


@contextlib.contextmanager
def serve_in_thread(app, sndbuf: int | None = None):
    """Run `app` with uvicorn on a socket the OS bound for us; yields the base URL. `sndbuf`
    fixes the send buffer of accepted connections (Linux: inherited from the listener)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def pool_is_free(engine: AsyncEngine) -> bool:
    s = engine.stats
    return s.num_free_blocks == s.num_blocks and s.num_requests_running == 0 and s.num_requests_waiting == 0


class Live:
    def __init__(self, url: str, engine: AsyncEngine, core: CoreProcess | None = None) -> None:
        self.url = url
        self.engine = engine
        self.core = core
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def live(qwen3_tiny):
    """The server as `nanovllm serve` runs it: the engine core in its own process, the HTTP
    front-end (a CoreClient) here."""
    core = CoreProcess(str(qwen3_tiny), ENGINE_KW, max_pending=1024)
    try:
        engine = CoreClient(core.addresses, core.info, core_alive=core.is_alive)
        try:
            with serve_in_thread(create_app(engine, MODEL, api_key=KEY)) as url:
                yield Live(url, engine, core)
        finally:
            engine.shutdown()
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def offline(qwen3_tiny):
    return LLM(str(qwen3_tiny), **ENGINE_KW)


def greedy_offline(llm, prompt, n):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]


def offline_streamed(llm, prompts, params) -> list[list[str]]:
    """Final texts (per prompt, per sample) of the offline engine run with stream=True, i.e. what
    a streamed request must add up to."""
    engine = llm.engine
    ids = [f"offline-stream-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params, stream=True)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [c.text for c in out.outputs]
    return [final[rid] for rid in ids]


def assert_error_body(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- basics --------------------------------------------------------------------------------
def test_models_health_and_auth(live):
    assert [m.id for m in live.client.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    err = assert_error_body(httpx.post(live.url + "/v1/completions", json={"prompt": "hi"}), 401)
    assert err["code"] == "invalid_api_key"
    assert_error_body(live.http.get("/v1/nothing"), 404)


def test_retrieve_model_gives_the_listed_card_and_404_for_other_ids(live):
    """GET /v1/models/{model} (OpenAI's retrieve-model): the card /v1/models lists, behind the
    same API key; an id the server does not serve is a 404 in OpenAI's shape naming it."""
    listed = live.http.get("/v1/models").json()["data"]
    got = live.http.get(f"/v1/models/{MODEL}")
    assert got.status_code == 200 and [got.json()] == listed
    assert live.client.models.retrieve(MODEL).model_dump() == live.client.models.list().data[0].model_dump()
    for unknown in ("nope", f"{MODEL}/extra", f"org/{MODEL}", ""):
        err = assert_error_body(live.http.get(f"/v1/models/{unknown}"), 404)
        assert err["code"] == "model_not_found" and repr(unknown) in err["message"], err
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("nope")
    assert assert_error_body(httpx.get(f"{live.url}/v1/models/{MODEL}"), 401)["code"] == "invalid_api_key"
    # Responses are counted under the route, not under each id asked for.
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
    endpoints = {s.labels["endpoint"] for s in families["nanovllm_http_requests"].samples}
    assert "/v1/models/{model}" in endpoints and not any("nope" in e for e in endpoints)


def test_retrieve_model_takes_an_id_with_slashes(live):
    app = create_app(live.engine, "org/tiny-2", api_key=KEY)
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            card = client.models.retrieve("org/tiny-2")
            assert card.id == "org/tiny-2" and card.model_dump() == client.models.list().data[0].model_dump()
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            assert http.get("/v1/models/org/tiny-2").json()["id"] == "org/tiny-2"
            assert http.get("/v1/models/org%2Ftiny-2").json()["id"] == "org/tiny-2"
            err = assert_error_body(http.get("/v1/models/org/other"), 404)
            assert err["code"] == "model_not_found" and "'org/other'" in err["message"]
    finally:
        app.state.server.close()


def test_completion_greedy_equals_offline_streaming_or_not(live, offline):
    prompt = "Paris is the capital of"
    ref = greedy_offline(offline, prompt, 12)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r = live.client.completions.create(**kw)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12

    chunks = list(live.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == offline_streamed(offline, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0][0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)

    # token-id prompts and top_k=1 (an extra field) at temperature 1 are greedy too
    r = live.client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=1.0,
                                       extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.0})
    assert r.choices[0].text == ref.outputs[0].text


def test_chat_greedy_equals_offline_streaming_or_not(live, offline):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_completion_tokens=10, extra_body={"ignore_eos": True})
    r = live.client.chat.completions.create(**kw)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 10)

    chunks = list(live.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == offline_streamed(offline, [ref.prompt_token_ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0][0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_text_equals_unstreamed_when_output_ends_mid_character(live):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
              temperature=0, max_tokens=10, extra_body={"ignore_eos": True})
    whole = live.client.chat.completions.create(**kw).choices[0].message.content
    assert whole.endswith("\ufffd")  # this greedy output ends inside a multi-byte character
    streamed = "".join(c.choices[0].delta.content or "" for c in live.client.chat.completions.create(stream=True, **kw))
    assert streamed == whole


def test_n_seed_and_batched_prompts(live, offline):
    kw = dict(model=MODEL, prompt="The quick", max_tokens=8, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True})
    a = live.client.completions.create(**kw)
    b = live.client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # the n samples differ
    assert a.usage.completion_tokens == 24

    # two prompts x n=2: choice index = prompt * n + sample, streamed or not
    kw = dict(model=MODEL, prompt=["Paris is", "A paged KV cache"], max_tokens=5, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    r = live.client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    texts = {c.index: c.text for c in r.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in live.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    ref = offline_streamed(offline, kw["prompt"], SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True))
    assert streamed == {i * 2 + j: ref[i][j] for i in range(2) for j in range(2)}
    assert finished == {0, 1, 2, 3}

    chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=4, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_stop_strings_and_stop_token_ids(live, offline):
    prompt = "Large language models"
    ref = greedy_offline(offline, prompt, 24).outputs[0]
    stop = ref.text[4:7]
    assert len(stop) == 3
    expected = ref.text[: ref.text.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    r = live.client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    chunks = [c for c in live.client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].model_extra["stop_reason"] is None

    stop_id = ref.token_ids[3]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    r = live.client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    first = ref.token_ids.index(stop_id)
    assert r.usage.completion_tokens == first + 1
    # the stop token's text is left out (vLLM's rule), streamed or not
    expected = offline.tokenizer.decode(ref.token_ids[:first])
    assert r.choices[0].text == expected and r.choices[0].model_extra["stop_reason"] == stop_id
    chunks = [c for c in live.client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop_id


def test_stop_strings_wait_for_min_tokens(live, offline):
    """vLLM's rule, streamed and not: a stop string counts only once more than min_tokens tokens
    are out, and only where it reaches past their text."""
    prompt = "Large language models"
    ref = greedy_offline(offline, prompt, 24).outputs[0]
    stop = ref.text[4:7]
    first = ref.text.index(stop)
    tok = offline.tokenizer
    m = next(k for k in range(1, 24) if len(tok.decode(ref.token_ids[:k])) >= first + len(stop))
    prefix = tok.decode(ref.token_ids[:m])
    assert ref.text.startswith(prefix)
    j = ref.text.find(stop, max(0, len(prefix) - len(stop) + 1))
    expected = ref.text if j == -1 else ref.text[:j]
    assert len(expected) > first
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True, "min_tokens": m})
    r = live.client.completions.create(**kw)
    assert r.choices[0].text == expected
    chunks = [c for c in live.client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_logprobs(live, offline):
    prompt = "Continuous batching"
    llm_out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    r = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    for token, value, entry in zip(llm_out.token_ids, lp.token_logprobs, llm_out.logprobs):
        assert value == pytest.approx(entry[token], abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # greedy: the sampled token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # As OpenAI's: a completion's top_logprobs hold the sampled token too (up to logprobs + 1 entries).
    for k in (0, 1):
        r = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.5, seed=5,
                                           logprobs=k, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == pytest.approx(value) and len(top) <= k + 1
        assert k == 0 or any(len(top) == 2 for top in lp.top_logprobs)  # some token sampled below the top one

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = live.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy picks the top token
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token  # the raw bytes
    streamed = [c for c in live.client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.content) for c in streamed) == 5


# ---- load, preemption, disconnects ----------------------------------------------------------
def test_64_concurrent_streams_with_preemption_free_the_pool(live, offline):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(6, 20))] for _ in range(64)]
    max_tokens = 24
    expected = [texts[0] for texts in offline_streamed(offline, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]
    preemptions_before = live.engine.stats.num_preemptions

    async def one(client, prompt):
        text, usage, finish = "", None, None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    for (text, usage, finish), prompt, ref in zip(results, prompts, expected):
        assert usage.completion_tokens == max_tokens and usage.prompt_tokens == len(prompt)
        assert finish == "length"
        assert text == ref  # preemption and batching do not change greedy output
    assert live.engine.stats.num_preemptions > preemptions_before
    assert wait_until(lambda: pool_is_free(live.engine))


def test_client_disconnect_aborts_and_frees_blocks(live):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    aborted = live.engine.stats.num_aborted
    with live.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # leaving the block closed the connection mid-stream
    assert wait_until(lambda: live.engine.stats.num_aborted == aborted + 1 and pool_is_free(live.engine))

    # a non-streaming client that gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        live.http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    assert wait_until(lambda: live.engine.stats.num_aborted == aborted + 2 and pool_is_free(live.engine))
    assert live.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens >= 1


# ---- bad input -------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    pytest.param("{not json", None, id="malformed-json"),
    pytest.param(json.dumps([1, 2]), None, id="body-not-object"),
    pytest.param(json.dumps({"model": MODEL}), "prompt", id="missing-prompt"),
    pytest.param(json.dumps({"model": "gpt-4", "prompt": "x"}), "model", id="unknown-model"),
    pytest.param(json.dumps({"prompt": "x", "temperature": -1}), "temperature", id="negative-temperature"),
    pytest.param(json.dumps({"prompt": "x", "top_p": 0}), "top_p", id="top-p-zero"),
    pytest.param(json.dumps({"prompt": "x", "top_k": -2}), "top_k", id="top-k-below-off"),
    pytest.param(json.dumps({"prompt": "x", "n": 0}), "n", id="n-zero"),
    pytest.param(json.dumps({"prompt": "x", "n": "many"}), "n", id="n-string"),
    pytest.param(json.dumps({"prompt": "x", "max_tokens": 0}), "max_tokens", id="max-tokens-zero"),
    pytest.param(json.dumps({"prompt": "x", "n": 1000}), "n", id="n-too-large"),
    pytest.param(json.dumps({"prompt": "x", "min_tokens": 2, "stop_token_ids": [100000]}), "stop_token_ids",
                 id="stop-token-outside-vocab"),
    pytest.param(json.dumps({"prompt": "x", "min_tokens": 5, "max_tokens": 2}), "min_tokens", id="min-over-max"),
    pytest.param(json.dumps({"prompt": "x", "logprobs": 50}), "logprobs", id="logprobs-too-many"),
    pytest.param(json.dumps({"prompt": "x", "stop": [1]}), "stop", id="stop-not-strings"),
    pytest.param(json.dumps({"prompt": "x", "presence_penalty": 2.5}), "presence_penalty", id="presence-penalty-range"),
    pytest.param(json.dumps({"prompt": "x", "frequency_penalty": "high"}), "frequency_penalty", id="frequency-penalty-string"),
    pytest.param(json.dumps({"prompt": "x", "repetition_penalty": 0}), "repetition_penalty", id="repetition-penalty-zero"),
    pytest.param(json.dumps({"prompt": "x", "logit_bias": {"abc": 1}}), "logit_bias", id="logit-bias-key-not-id"),
    pytest.param(json.dumps({"prompt": "x", "logit_bias": {"100000": 1}}), "logit_bias", id="logit-bias-key-outside-vocab"),
    pytest.param(json.dumps({"prompt": "x", "logit_bias": {"5": 101}}), "logit_bias", id="logit-bias-too-large"),
    pytest.param(json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}), "stream_options", id="stream-options-without-stream"),
    pytest.param(json.dumps({"prompt": ""}), "prompt", id="empty-prompt"),
    pytest.param(json.dumps({"prompt": []}), "prompt", id="empty-prompt-list"),
    pytest.param(json.dumps({"prompt": [1, 2, 100000]}), "prompt", id="token-outside-vocab"),
    pytest.param(json.dumps({"prompt": [5] * 600}), "prompt", id="prompt-too-long"),
    pytest.param(json.dumps({"prompt": ["ok", [5] * 600], "stream": True}), "prompt", id="batch-one-too-long-stream"),
    pytest.param(json.dumps({"prompt": "x", "allowed_token_ids": []}), "allowed_token_ids",
                 id="allowed-token-ids-empty"),
    pytest.param(json.dumps({"prompt": "x", "allowed_token_ids": [5, 100000]}), "allowed_token_ids",
                 id="allowed-token-id-outside-vocab"),
    pytest.param(json.dumps({"prompt": "x", "allowed_token_ids": ["5"]}), "allowed_token_ids",
                 id="allowed-token-id-string"),
    pytest.param(json.dumps({"prompt": "x", "bad_words": "fox"}), "bad_words", id="bad-words-not-a-list"),
    pytest.param(json.dumps({"prompt": "x", "bad_words": ["fox", " "]}), "bad_words", id="bad-words-blank"),
    pytest.param(json.dumps({"prompt": "x", "prompt_logprobs": -1}), "prompt_logprobs", id="prompt-logprobs-negative"),
    pytest.param(json.dumps({"prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs", id="prompt-logprobs-too-many"),
    pytest.param(json.dumps({"prompt": "x", "prompt_logprobs": True}), "prompt_logprobs", id="prompt-logprobs-bool"),
    pytest.param(json.dumps({"prompt": "x", "prompt_logprobs": 1, "stream": True}), "prompt_logprobs",
                 id="prompt-logprobs-stream"),
    pytest.param(json.dumps({"prompt": "x", "max_tokens": 0}), "max_tokens", id="max-tokens-0-without-echo"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(live, body, param):
    resp = live.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    err = assert_error_body(resp, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [({"messages": []}, "messages"),
     ({"messages": [{"content": "no role"}]}, "messages"),
     ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
     ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
     ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
     ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages"),
     ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
     ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
     ({"messages": [{"role": "assistant", "content": "The answer is"}], "continue_final_message": True},
      "continue_final_message"),  # needs add_generation_prompt false
     ({"messages": [{"role": "user", "content": "x"}], "echo": "yes"}, "echo"),
     ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, "chat_template")],
    ids=["no-messages", "no-role", "top-logprobs-without-logprobs", "top-logprobs-too-many", "negative-max-tokens",
         "too-long", "image-part", "tools", "continue-final-message", "echo", "chat-template"],
)
def test_bad_chat_requests_are_400(live, body, param):
    err = assert_error_body(live.http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param


def test_null_fields_take_their_defaults_and_developer_is_a_system_message(live):
    """The openai client sends a field left as None as null (OpenAI marks them nullable)."""
    r = live.client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=None, stream=None, echo=None,
                                       logprobs=None, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 3
    kw = dict(model=MODEL, max_completion_tokens=3, n=None, stream=None, logprobs=None, temperature=0,
              extra_body={"ignore_eos": True, "top_k": None})
    r = live.client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kw)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and r.usage.completion_tokens == 3
    as_system = live.client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], **kw)
    as_developer = live.client.chat.completions.create(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}], **kw)
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_server_keeps_serving_after_bad_requests(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client.completions.create(model=MODEL, prompt="x", temperature=-2)
    assert info.value.body["param"] == "temperature"
    assert live.http.post("/v1/completions", content=b"\xff\xfe", headers={"Content-Type": "application/json"}).status_code == 400
    assert live.http.get("/v1/completions").status_code == 405
    r = live.client.completions.create(model=MODEL, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert wait_until(lambda: pool_is_free(live.engine))


# ---- metrics and the load generator ------------------------------------------------------------
def test_metrics_parse_as_prometheus_text(live):
    live.client.completions.create(model=MODEL, prompt="count me", max_tokens=3, stream=False)
    text = httpx.get(live.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    names = {name for name, _ in samples}
    for name in ("nanovllm_http_requests_total", "vllm:request_success_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "nanovllm_prefix_cache_hit_rate", "vllm:num_preemptions_total", "nanovllm_engine_steps_total",
                 "nanovllm_engine_step_seconds_total", "nanovllm_engine_device_wait_seconds_total",
                 "nanovllm_engine_prompt_steps_total", "nanovllm_engine_prompt_step_seconds_total",
                 "process_cpu_seconds_total"):
        assert name in names, name
    ok = samples[("nanovllm_http_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))]
    assert ok >= 1
    assert samples[("vllm:generation_tokens_total", (("model_name", MODEL),))] >= 3
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", MODEL),))] == 0.0
    assert 0.0 <= samples[("nanovllm_prefix_cache_hit_rate", ())] <= 1.0
    # Three tokens took at least three engine steps; the loop's waits for the device are part of its steps.
    assert samples[("nanovllm_engine_steps_total", ())] >= 3
    step_seconds = samples[("nanovllm_engine_step_seconds_total", ())]
    assert 0.0 < step_seconds and 0.0 <= samples[("nanovllm_engine_device_wait_seconds_total", ())] <= step_seconds
    assert 0.0 < samples[("nanovllm_engine_prompt_step_seconds_total", ())] <= step_seconds


def test_metrics_count_the_steps_that_compute_prompt_tokens(live):
    def counters() -> dict[str, float]:
        text = httpx.get(live.url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("nanovllm_engine_")}

    before = counters()
    live.client.completions.create(model=MODEL, prompt="a prompt of its own, computed in one step", max_tokens=6,
                                   extra_body={"min_tokens": 6}, stream=False)
    after = counters()
    delta = {k: after[k] - before[k] for k in after}
    # Nothing else runs: one step computes the prompt (and samples the first token), five more decode.
    assert delta["nanovllm_engine_prompt_steps_total"] == 1
    assert delta["nanovllm_engine_steps_total"] >= 6
    assert 0.0 < delta["nanovllm_engine_prompt_step_seconds_total"] < delta["nanovllm_engine_step_seconds_total"]


def test_a_client_gone_before_its_body_ended_counts_499_not_500(live):
    """A client that sends headers and part of the body, then closes: nothing to answer, and the
    metrics count it as the client's leaving (499), not as a server error (500)."""
    def count(code: str) -> float:
        for family in text_string_to_metric_families(httpx.get(live.url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "nanovllm_http_requests_total" and sample.labels == {
                        "code": code, "endpoint": "/v1/completions"}:
                    return sample.value
        return 0.0

    before_499, before_500 = count("499"), count("500")
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-5])
    assert wait_until(lambda: count("499") == before_499 + 1)
    assert count("500") == before_500


def test_serve_bench_against_live_server(live):
    cfg = ServeBenchConfig(url=live.url, num_clients=4, num_requests=8, input_len=8, output_len=6, api_key=KEY,
                           time_limit_s=60)
    result = asyncio.run(run_serve_bench(cfg))
    assert result.num_ok == 8 and result.num_failed == 0, result.errors
    assert result.output_tokens == 48 and result.pool_free_after is True
    assert 8 <= result.output_chunks <= 48  # each stream: between one chunk and one per token
    assert 1 <= result.summary()["tokens_per_chunk"] <= 6
    assert result.summary()["ttft_ms_p50"] is not None
    # The engine's counters over the run: 8 requests of 6 tokens, 4 at a time, took at least 12
    # steps, and the loop was inside its steps for part of the run's wall time.
    summary = result.summary()
    assert result.engine_steps >= 12
    assert summary["tokens_per_engine_step"] > 0.0
    assert 0.0 < summary["engine_busy"] <= 1.1 and 0.0 <= summary["engine_device_wait"] <= summary["engine_busy"]
    # Each of the 8 short prompts was computed in one step, some of them maybe in the same one.
    assert 1 <= summary["engine_prompt_steps"] <= 8 and 0.0 < summary["engine_prompt_busy"] <= summary["engine_busy"]
    # The load generator and the front-end that streamed the tokens both used the CPU.
    assert summary["client_cpu"] > 0.0 and summary["frontend_cpu"] > 0.0
    with pytest.raises(ValueError, match="127.0.0.1"):
        asyncio.run(run_serve_bench(ServeBenchConfig(url="http://example.com:8000")))
    # A server it cannot reach, or one that refuses the key: a ValueError saying so (the CLI's
    # one-line error), not an httpx traceback.
    with pytest.raises(ValueError, match="--api-key"):
        asyncio.run(run_serve_bench(ServeBenchConfig(url=live.url, num_requests=1, num_clients=1)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes
    with pytest.raises(ValueError, match="cannot reach the server"):
        asyncio.run(run_serve_bench(ServeBenchConfig(url=closed, num_requests=1, num_clients=1)))


def test_serve_bench_spreads_its_clients_over_processes(live):
    cfg = ServeBenchConfig(url=live.url, num_clients=3, num_requests=7, input_len=8, output_len=5, api_key=KEY,
                           time_limit_s=60, client_processes=2)
    result = asyncio.run(run_serve_bench(cfg))
    assert result.num_ok == 7 and result.num_failed == 0, result.errors
    assert result.output_tokens == 35 and result.pool_free_after is True
    assert len(result.ttft) == 7 and result.summary()["client_cpu"] > 0.0
    with pytest.raises(ValueError, match="client_processes"):
        asyncio.run(run_serve_bench(ServeBenchConfig(url=live.url, num_clients=2, client_processes=3)))


def test_serve_bench_prompt_seed_option_chooses_the_prompts_seed():
    import argparse

    from nanovllm.entrypoints.serve_bench import add_serve_bench_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    assert config_from_args(parser.parse_args([])).seed == 0
    assert config_from_args(parser.parse_args(["--prompt-seed", "7"])).seed == 7


def test_serve_bench_splits_event_streams_only_where_sse_ends_lines():
    """LF and CRLF end a line; U+2028 (raw in JSON) does not, even split across chunks."""
    from nanovllm.entrypoints.serve_bench import sse_lines

    stream = 'data: {"text": "a\u2028b"}\r\n\r\ndata: [DONE]\n\n'.encode()
    cut = stream.index("\u2028".encode()) + 1  # inside the character's three bytes

    async def lines():
        async def chunks():
            yield stream[:cut]
            yield stream[cut:]
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(lines()) == ['data: {"text": "a\u2028b"}', "", "data: [DONE]", ""]


# ---- the async engine itself -----------------------------------------------------------------
def test_async_engine_streams_aborts_and_idles(live):
    engine = live.engine

    async def main():
        outs = [o async for o in engine.generate("ae-1", [9, 10, 11], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        assert all(len(a.outputs[0].token_ids) <= len(b.outputs[0].token_ids) for a, b in zip(outs, outs[1:]))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("ae-2", [], SamplingParams())
        stream = await engine.add_request("ae-3", [9, 10], SamplingParams(max_tokens=300, ignore_eos=True))
        first = await stream.__anext__()
        engine.abort("ae-3")
        last = first
        async for last in stream:
            pass
        assert last.finished and last.outputs[0].finish_reason == "abort"

    asyncio.run(main())
    assert wait_until(lambda: pool_is_free(engine))
    time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.2  # an idle engine (and idle server) does not spin


def test_core_stream_text_never_shrinks_when_a_sample_stops_first(live, offline):
    """n=2 with a stop string that only sample 0 meets: it ends while sample 1 runs on. Each
    output of the stream extends the one before (a finished sample's text is whole, not held
    back for a stop string), and the last equals the offline engine's."""
    params = dict(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    free = offline.generate([[40, 41, 42]], SamplingParams(**params), use_tqdm=False)[0].outputs
    text = free[0].text
    params["stop"] = [next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2)
                           if text[i : i + 3] not in free[1].text)]
    expected = offline.generate([[40, 41, 42]], SamplingParams(**params), use_tqdm=False)[0].outputs
    assert [c.finish_reason for c in expected] == ["stop", "length"]

    async def main():
        return [o async for o in live.engine.generate("shrink", [40, 41, 42], SamplingParams(**params))]

    outs = asyncio.run(main())
    assert [c.text for c in outs[-1].outputs] == [c.text for c in expected]
    for before, after in zip(outs, outs[1:]):
        assert all(a.text.startswith(b.text) for a, b in zip(after.outputs, before.outputs))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_streamed_choice_that_ends_first_gets_its_finish_reason_as_it_ends(live, offline, endpoint):
    """n=2 with a stop string that only sample 0 meets, early: its finish_reason comes in the
    chunk where it ends, while sample 1 streams on (as vLLM and OpenAI send them), once per
    choice, and each choice's text is the offline engine's."""
    messages = [{"role": "user", "content": "Say something"}]
    params = dict(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)

    def offline_outputs(**extra):
        sp = SamplingParams(**params, **extra)
        if endpoint == "chat":
            return offline.chat(messages, sp, use_tqdm=False)[0].outputs
        return offline.generate([[40, 41, 42]], sp, use_tqdm=False)[0].outputs

    free = offline_outputs()
    text = free[0].text
    stop = [next(text[i : i + 3] for i in range(len(text) // 4, len(text) // 2) if text[i : i + 3] not in free[1].text)]
    expected = offline_outputs(stop=stop)
    assert [c.finish_reason for c in expected] == ["stop", "length"] and len(expected[0].token_ids) < 20
    body = dict(model=MODEL, stop=stop, stream=True, **{k: v for k, v in params.items()})
    if endpoint == "chat":
        body["messages"], path = messages, "/v1/chat/completions"
    else:
        body["prompt"], path = [40, 41, 42], "/v1/completions"
    order = []  # (choice, has text, finish_reason) per choice in a chunk, in arrival order
    texts = {0: "", 1: ""}
    with live.http.stream("POST", path, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    piece = c["text"] if endpoint == "completions" else c["delta"].get("content") or ""
                    texts[c["index"]] += piece
                    order.append((c["index"], bool(piece), c["finish_reason"]))
    assert sorted((i, reason) for i, _, reason in order if reason) == [(0, "stop"), (1, "length")]
    ended_at = next(k for k, (i, _, reason) in enumerate(order) if i == 0 and reason)
    assert sum(i == 1 and has_text for i, has_text, _ in order[ended_at + 1:]) >= 2  # sample 1 streamed on
    assert [texts[0], texts[1]] == [c.text for c in expected]


def test_core_stream_logprobs_match_the_offline_engine(live, offline):
    """Through the engine core, each output's logprobs and their cumulative sum (kept as the
    tokens arrive) are the offline engine's."""
    params = SamplingParams(n=2, temperature=0.7, seed=11, max_tokens=20, logprobs=2, ignore_eos=True)
    expected = offline.generate([[40, 41, 42]], params, use_tqdm=False)[0].outputs

    async def main():
        return [o async for o in live.engine.generate("logprobs", [40, 41, 42], params)]

    outs = asyncio.run(main())
    for got, want in zip(outs[-1].outputs, expected):
        assert got.token_ids == want.token_ids
        assert [e[t] for t, e in zip(got.token_ids, got.logprobs)] == pytest.approx(
            [e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    for out in outs:  # every output of the stream: the sum of its own tokens' logprobs
        for c in out.outputs:
            assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)), abs=1e-4)


def test_an_idle_front_end_reads_the_cores_stats_as_of_now(live):
    """With several front-ends (--api-server-count), each keeps the stats that reached it, and
    an idle one gets them only with the core's heartbeat; asked for at scrape time they are
    current, so counters read through different front-ends never go backwards."""
    idle = CoreClient(live.core.addresses, live.core.info, core_alive=live.core.is_alive)
    try:
        live.client.completions.create(model=MODEL, prompt="count my steps", max_tokens=4, stream=False)
        busy = live.engine.stats.num_steps  # came with the request's last output
        stats = asyncio.run(idle.fresh_stats())
        assert stats.num_steps >= busy and idle.stats.num_steps >= busy
    finally:
        idle.shutdown()


def test_engine_failure_fails_requests_and_health_is_503(qwen3_tiny):
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), **ENGINE_KW)

    def broken_step():
        raise RuntimeError("boom: the device fell off")

    engine.engine.step = broken_step
    try:
        with serve_in_thread(create_app(engine, MODEL)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            assert httpx.get(url + "/health").status_code == 200
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert info.value.status_code == 503 and "boom" in info.value.body["message"]
            health = httpx.get(url + "/health")
            assert_error_body(health, 503)
            with pytest.raises(openai.APIStatusError) as info:  # later requests: 503 at once
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
            assert info.value.status_code == 503
            metrics = httpx.get(url + "/metrics").text
            assert "nanovllm_engine_healthy 0.0" in metrics
    finally:
        engine.shutdown()
    assert not engine._thread.is_alive()

    async def after_shutdown():
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi")

    asyncio.run(after_shutdown())


def test_engine_failure_mid_stream_reaches_the_stream(qwen3_tiny):
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), **ENGINE_KW)
    real_step, calls = engine.engine.step, []

    def step_then_fail():
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("boom mid-stream")
        return real_step()

    engine.engine.step = step_then_fail
    try:
        with serve_in_thread(create_app(engine, MODEL)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            got = []
            with pytest.raises(openai.APIError, match="boom mid-stream"):
                for chunk in client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=50,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    got.append(chunk)
            assert got  # some tokens arrived before the failure
            assert httpx.get(url + "/health").status_code == 503
    finally:
        engine.shutdown()


# ---- the command line --------------------------------------------------------------------------
def test_serve_command_sigterm_is_graceful_and_exits_0(checkpoint_factory):
    """SIGTERM: a short in-flight stream still finishes; a long one is aborted after
    --shutdown-timeout and still ends cleanly; the process exits 0. The long one asks for 30k
    tokens so that no machine decodes it within the 1 s timeout."""
    checkpoint = checkpoint_factory("qwen3", max_position_embeddings=32768)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "serve", str(checkpoint), "--port", "0", "--device", "cpu",
         "--max-model-len", "32768", "--served-model-name", MODEL, "--shutdown-timeout", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        url = None
        for line in proc.stderr:
            match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1)
                break
        assert url is not None, "the server did not start"
        # keep draining stderr so the server never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def start(max_tokens):
            stream = iter(client.completions.create(model=MODEL, prompt="in flight", max_tokens=max_tokens,
                                                    stream=True, extra_body={"ignore_eos": True}))
            return [next(stream)], stream

        short, long_ = start(8), start(30000)
        proc.send_signal(signal.SIGTERM)
        for chunks, stream in (short, long_):
            chunks.extend(stream)
        assert short[0][-1].choices[0].finish_reason == "length"
        assert long_[0][-1].choices[0].finish_reason == "abort"  # ended by the server, with [DONE]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_flags_map_onto_engine_config():
    from dataclasses import fields

    from nanovllm.config import EngineConfig
    from nanovllm.entrypoints.cli import build_parser, engine_kwargs

    parser = build_parser()
    default = engine_kwargs(parser.parse_args(["generate", "--model", "m", "hi"]))
    assert set(default) <= {f.name for f in fields(EngineConfig)}
    assert default["persistent_decode"] is True and default["async_scheduling"] is None and default["decode_burst"] is None
    off = engine_kwargs(parser.parse_args(["serve", "m", "--no-persistent-decode", "--no-async-scheduling",
                                           "--decode-burst", "1"]))
    assert off["persistent_decode"] is False and off["async_scheduling"] is False and off["decode_burst"] == 1


def test_cli_generate_chat_bench_and_help(qwen3_tiny, live, monkeypatch, capsys):
    import io

    from nanovllm.entrypoints.cli import main

    engine_args = ["--model", str(qwen3_tiny), "--device", "cpu", "--max-model-len", "256"]
    assert main(["generate", *engine_args, "--max-tokens", "3", "--ignore-eos", "--quiet", "Paris is"]) == 0
    assert capsys.readouterr().out.strip()

    # chat keeps the history: the second turn's prompt holds the first exchange
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n/exit\nnever read\n"))
    prompts = []
    real_stream = LLM.stream

    def spy(self, prompt, params=None):
        prompts.append(self.tokenizer.decode(prompt))
        return real_stream(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", spy)
    assert main(["chat", str(qwen3_tiny), "--device", "cpu", "--max-tokens", "4", "--ignore-eos"]) == 0
    assert len(prompts) == 2 and "hello" in prompts[1] and prompts[1].count("<|im_start|>assistant") == 2
    assert capsys.readouterr().out.count("\n") == 2  # one line per reply

    assert main(["bench", *engine_args, "--num-prompts", "3", "--min-input-len", "4", "--max-input-len", "8",
                 "--min-output-len", "2", "--max-output-len", "4", "--quiet"]) == 0
    assert "tok/s" in capsys.readouterr().out
    assert main(["bench", *engine_args, "--num-prompts", "3", "--min-input-len", "4", "--max-input-len", "8",
                 "--min-output-len", "2", "--max-output-len", "2", "--quiet", "--json"]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # --json without --serving too
    assert offline["requests"] == 3 and offline["output_tokens"] == 6 and offline["output_tok_per_s"] > 0
    assert main(["bench", "--serving", "--url", live.url, "--api-key", KEY, "--num-clients", "2", "--num-requests", "2",
                 "--input-len", "4", "--output-len", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["requests_ok"] == 2 and summary["kv_pool_free_after"] is True

    for command in ("serve", "generate", "chat", "bench"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert "--device" in capsys.readouterr().out


@pytest.mark.parametrize("port", ["70000", "-5", "http"])
def test_serve_refuses_a_port_outside_the_tcp_range(port, capsys):
    from nanovllm.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "m", "--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_serve_with_a_missing_model_says_so_without_a_traceback(tmp_path):
    """A model that does not load: one clear error line and exit status 2, no traceback from
    the engine core's process (it used to exit through its SIGTERM handler mid-shutdown)."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm", "serve", str(tmp_path / "missing"), "--port", "0", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "missing" in proc.stderr
