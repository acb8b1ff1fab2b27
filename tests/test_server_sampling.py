"""The server's sampling fields: penalties, logit_bias, allowed_token_ids and bad_words reach
the engine, and a field the request leaves unset takes the model's generation_config.json (vLLM's
--generation-config auto)."""
from __future__ import annotations

import contextlib
import json
import shutil

import msgspec
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    apply_generation_defaults,
)
from test_server import MODEL, greedy_offline, live, offline  # noqa: F401 (live, offline: fixtures)

MODEL_DEFAULTS = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05, max_tokens=33)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_request_over_model_over_server():
    assert apply_generation_defaults(dict(temperature=None, top_k=5, max_tokens=None), dict(temperature=0.6, top_k=20),
                                     dict(max_tokens=16)) == dict(temperature=0.6, top_k=5, max_tokens=16)
    p = completion().sampling_params(16, None, 384, MODEL_DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 1.05, 33)
    p = completion(temperature=0, top_k=-1, repetition_penalty=1.0, max_tokens=4, presence_penalty=1,
                   frequency_penalty=-0.5, logit_bias={"7": -100, "9": 2.5}).sampling_params(16, None, 384, MODEL_DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 0.95, -1, 1.0, 4)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (1.0, -0.5, {7: -100.0, 9: 2.5})
    p = completion().sampling_params(16, None, 384, {})
    assert p == SamplingParams(max_tokens=16)  # no model defaults: OpenAI's
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 3})
    assert chat.sampling_params(400, None, 384, MODEL_DEFAULTS).max_tokens == 3


@pytest.mark.parametrize("fields, param", [
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(logit_bias={"384": 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 100.5}), "logit_bias"),
])
def test_bad_logit_bias_is_a_400_naming_it(fields, param):
    with pytest.raises(OpenAIError) as err:
        completion(**fields).sampling_params(16, None, 384, {})
    assert err.value.status == 400 and err.value.param == param


def test_allowed_token_ids_and_bad_words_reach_the_sampling_params():
    p = completion(allowed_token_ids=[5, 7], bad_words=["fox", " lazy dog"]).sampling_params(16, None, 384, {})
    assert (p.allowed_token_ids, p.bad_words) == ([5, 7], ["fox", " lazy dog"])
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "allowed_token_ids": [383], "bad_words": ["a"]})
    p = chat.sampling_params(16, None, 384, {})
    assert (p.allowed_token_ids, p.bad_words) == ([383], ["a"])
    p = completion(allowed_token_ids=None, bad_words=[]).sampling_params(16, None, 384, {})
    assert (p.allowed_token_ids, p.bad_words) == (None, None)


@pytest.mark.parametrize("fields, param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[5, 384]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=["fox", "  "]), "bad_words"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_allowed_token_ids_or_bad_words_are_a_400_naming_them(fields, param):
    for request in (completion(**fields),
                    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})):
        with pytest.raises(OpenAIError) as err:
            request.sampling_params(16, None, 384, {})
        assert err.value.status == 400 and err.value.param == param


def test_live_server_honours_allowed_token_ids_and_bad_words(live, offline):
    """Through the engine core (decode bursts on): the token ids of each endpoint's choice are
    the offline engine's under the same fields, which change the plain greedy output."""
    prompt = [11, 12, 13, 14]
    plain = greedy_offline(offline, prompt, 12).outputs[0].token_ids
    allowed = [t for t in range(3, 384) if t not in plain][:3]
    word = next(text for i in range(len(plain) - 1) if (text := offline.tokenizer.decode(plain[i : i + 2])).strip()
                and plain[i : i + 2] in offline.engine.bad_words_token_ids([text]))
    base = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)

    def served(**fields) -> list[int]:
        resp = live.http.post("/v1/completions", json={"prompt": prompt, **base, **fields})
        assert resp.status_code == 200, resp.text
        return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]

    def expected(**fields) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **fields)
        return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    assert served(allowed_token_ids=allowed) == expected(allowed_token_ids=allowed) != plain
    assert served(bad_words=[word]) == expected(bad_words=[word]) != plain
    messages = [{"role": "user", "content": "Paris is"}]
    resp = live.http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 6,
                                                        "ignore_eos": True, "logprobs": True,
                                                        "return_tokens_as_token_ids": True,
                                                        "allowed_token_ids": allowed, "bad_words": [word]})
    assert resp.status_code == 200, resp.text
    tokens = [int(c["token"].removeprefix("token_id:")) for c in resp.json()["choices"][0]["logprobs"]["content"]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed, bad_words=[word])
    assert tokens == offline.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    assert set(tokens) <= set(allowed)


def test_params_cross_to_the_core_intact():
    from nanovllm.engine.messages import AddRequest, FrontendMessage, params_from_wire, params_to_wire

    p = SamplingParams(temperature=0.7, presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.2,
                       logit_bias={7: -100.0, 9: 2.5}, include_stop_str_in_output=True,
                       truncate_prompt_tokens=5, allowed_token_ids=[3, 4], bad_words=["fox", "lazy dog"],
                       bad_words_token_ids=[[5], [6, 7]])
    wire = msgspec.msgpack.encode(AddRequest("r", [1, 2], params_to_wire(p)))
    crossed = params_from_wire(msgspec.msgpack.Decoder(FrontendMessage).decode(wire).params)
    assert crossed == p and crossed.bad_words_token_ids == [[5], [6, 7]]


def test_the_front_end_hands_the_core_bad_words_as_token_sequences(live, offline, monkeypatch):
    """The server tokenizes bad_words on its own tokenizer thread, and the engine core gets the
    token sequences with the request (the ones the engine would make), so the core's loop
    tokenizes none of a request's words."""
    seen = []
    add = live.engine.add_request

    async def spy(request_id, prompt, params=None, **kwargs):
        seen.append(params)
        return await add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(live.engine, "add_request", spy)
    words = ["fox", "lazy dog", "Nova Haven"]
    for path, body in (("/v1/completions", {"prompt": "Once"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once"}]})):
        r = live.http.post(path, json={"model": MODEL, "max_tokens": 2, "bad_words": words, **body})
        assert r.status_code == 200, r.text
        assert seen[-1].bad_words == words
        assert seen[-1].bad_words_token_ids == offline.engine.bad_words_token_ids(words)


def test_bad_words_token_ids_need_their_words_and_token_ids():
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[5]])  # no bad_words
    for ids in ([[]], [[-1]], [["5"]], [5]):
        with pytest.raises(ValueError, match="bad_words_token_ids"):
            SamplingParams(bad_words=["fox"], bad_words_token_ids=ids)


@contextlib.contextmanager
def core_engine(path, kw):
    """The engine as `nanovllm serve` runs it: a core process and a CoreClient front-end."""
    from nanovllm.engine.core import CoreProcess
    from nanovllm.engine.core_client import CoreClient

    core = CoreProcess(str(path), kw, max_pending=64)
    try:
        engine = CoreClient(core.addresses, core.info, core_alive=core.is_alive)
        try:
            yield engine
        finally:
            engine.shutdown()
    finally:
        core.shutdown()


def test_live_server_applies_model_defaults_and_penalties(qwen3_tiny, tmp_path):
    from test_server import KEY, serve_in_thread

    import httpx

    from nanovllm.entrypoints.server import create_app

    path = tmp_path / "model"
    shutil.copytree(qwen3_tiny, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 6}))
    kw = dict(device="cpu", max_model_len=256)
    offline = LLM(str(path), **kw)
    prompt = [11, 12, 13, 14]
    with core_engine(path, kw) as engine:
        assert engine.generation_defaults == dict(temperature=0.0, max_tokens=6)
        with serve_in_thread(create_app(engine, "tiny", api_key=KEY)) as url:
            http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})

            def tokens(**fields):
                resp = http.post("/v1/completions", json={"prompt": prompt, "logprobs": 0, "ignore_eos": True, **fields})
                assert resp.status_code == 200, resp.text
                return resp.json()["choices"][0]["logprobs"]["tokens"]

            def expected(**kw):
                out = offline.generate([prompt], SamplingParams(logprobs=0, ignore_eos=True, **kw), use_tqdm=False)[0]
                return [offline.tokenizer.decode([t]) for t in out.outputs[0].token_ids]

            # Unset fields: the model's greedy and 6 tokens, not OpenAI's temperature 1 and 16.
            assert tokens() == expected(temperature=0.0, max_tokens=6)
            assert len(tokens(max_tokens=9)) == 9
            pen = dict(presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=3.0)
            assert tokens(**pen) == expected(temperature=0.0, max_tokens=6, **pen) != expected(temperature=0.0, max_tokens=6)
            forced = tokens(temperature=1.0, logit_bias={"42": 100})
            assert forced == [offline.tokenizer.decode([42])] * 6


def test_live_server_refuses_bans_that_leave_nothing_and_too_many_bad_words(live, offline):
    """A grammar none of whose tokens are allowed is a 400 naming the grammar's field (not a
    503: the server is fine); allowed ids that a min_tokens ban covers, or that bad words of two
    tokens come to ban once the output has begun, a 400 naming allowed_token_ids (in a stream,
    an error event); more than MAX_BAD_WORDS bad words, a 400 naming bad_words."""
    from nanovllm.entrypoints.protocol import MAX_BAD_WORDS

    body = {"prompt": [11, 12, 13, 14], "max_tokens": 5, "temperature": 0}
    resp = live.http.post("/v1/completions", json={**body, "allowed_token_ids": [5, 6],
                                                   "structured_outputs": {"choice": ["Paris", "Berlin"]}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "structured_outputs", resp.text
    resp = live.http.post("/v1/completions", json={**body, "allowed_token_ids": [7], "stop_token_ids": [7],
                                                   "min_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text
    pair = [offline.tokenizer.decode([t]) for t in (40, 41)]  # every two-token word of them: both banned after one token
    two_token_words = [a + b for a in pair for b in pair]
    resp = live.http.post("/v1/completions", json={**body, "allowed_token_ids": [40, 41], "bad_words": two_token_words})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text
    assert "after 1 tokens of output" in resp.json()["error"]["message"]
    streamed = live.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True,
        "allowed_token_ids": [40, 41], "bad_words": two_token_words}).text
    error = json.loads(next(line[6:] for line in streamed.splitlines() if line.startswith('data: {"error"')))
    assert error["error"]["param"] == "allowed_token_ids" and streamed.rstrip().endswith("data: [DONE]")
    resp = live.http.post("/v1/completions", json={**body, "bad_words": ["w"] * (MAX_BAD_WORDS + 1)})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words", resp.text
    assert live.http.post("/v1/completions", json={**body, "bad_words": ["w"] * MAX_BAD_WORDS}).status_code == 200
    assert live.http.get("/health").status_code == 200


@pytest.mark.parametrize("best_of", [True, 1.0, "1"])
def test_best_of_is_an_integer_like_every_count(best_of):
    """best_of takes a JSON integer only, as n and max_tokens do (a JSON true is not a number)."""
    from pydantic import ValidationError

    assert completion(best_of=1).best_of == 1
    with pytest.raises(ValidationError, match="best_of"):
        completion(best_of=best_of)


def test_the_engine_refuses_bad_words_token_ids_outside_the_vocabulary(offline):
    with pytest.raises(ValueError, match="bad_words.*outside the vocabulary"):
        offline.engine.add_request("outside", "Once", SamplingParams(bad_words=["fox"], bad_words_token_ids=[[10**7]]))
    assert offline.engine.block_manager.num_free_blocks == offline.engine.block_manager.num_blocks
