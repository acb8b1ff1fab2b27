"""vLLM's request fields that real clients send, live through the server (test_server's: the
engine core in its own process, as `nanovllm serve` runs it; and one with a 48-token context on
an in-process AsyncEngine): include_stop_str_in_output, truncate_prompt_tokens,
stream_options.continuous_usage_stats, echo (completions and chat, with logprobs too), prompt_logprobs and
return_tokens_as_token_ids. What a choice says is
compared with the offline engine on the same checkpoint; bad values are a 400 naming the field."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from nanovllm import SamplingParams
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.server import create_app
from test_server import (  # noqa: F401 (live, offline: fixtures)
    KEY, MODEL, assert_error_body, greedy_offline, live, offline, serve_in_thread,
)


def streamed_texts(live, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Each choice's streamed text, and every chunk (parsed), of a streamed request."""
    texts: dict[int, str] = {}
    chunks = []
    with live.http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunks.append(chunk)
                for c in chunk["choices"]:
                    piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                    texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts, chunks


def choice_text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def post(live, path: str, body: dict) -> dict:
    resp = live.http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


# ---- include_stop_str_in_output --------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_stop_str_in_output_keeps_the_stop_string(live, offline, endpoint):
    """The stop string that ends a choice stays at the end of its text (what followed it is cut),
    every choice of n, streamed or not; stop_reason still names it."""
    prompt = "Large language models"
    if endpoint == "chat":
        messages = [{"role": "user", "content": prompt}]
        text = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
        path, body = "/v1/chat/completions", {"messages": messages}
    else:
        text = greedy_offline(offline, prompt, 24).outputs[0].text
        path, body = "/v1/completions", {"prompt": prompt}
    stop = text[4:7]
    expected = text[: text.index(stop) + len(stop)]
    body.update(model=MODEL, max_tokens=24, temperature=0, n=2, stop=[stop], ignore_eos=True,
                include_stop_str_in_output=True)
    r = post(live, path, body)
    for c in r["choices"]:
        assert (choice_text(c), c["finish_reason"], c["stop_reason"]) == (expected, "stop", stop)
    texts, _ = streamed_texts(live, path, body)
    assert texts == {0: expected, 1: expected}
    without = post(live, path, {**body, "include_stop_str_in_output": False})["choices"][0]
    assert choice_text(without) == text[: text.index(stop)]


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(live, offline):
    """As vLLM: the text of the stop token that ends a choice (a stop_token_ids entry) stays in
    the output too, streamed or not; without the flag it is left out."""
    prompt = "Large language models"
    ref = greedy_offline(offline, prompt, 24).outputs[0]
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    body = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_id],
                include_stop_str_in_output=True)
    with_token = offline.tokenizer.decode(ref.token_ids[: first + 1])
    assert with_token != offline.tokenizer.decode(ref.token_ids[:first])
    r = post(live, "/v1/completions", body)
    assert (r["choices"][0]["text"], r["choices"][0]["stop_reason"]) == (with_token, stop_id)
    assert r["usage"]["completion_tokens"] == first + 1
    assert streamed_texts(live, "/v1/completions", body)[0] == {0: with_token}
    without = post(live, "/v1/completions", {**body, "include_stop_str_in_output": False})["choices"][0]["text"]
    assert without == offline.tokenizer.decode(ref.token_ids[:first])


def test_include_stop_str_in_output_streams_without_holding_text_back(offline):
    """The front-end's side of the engine core (CoreStream), fed one token at a time: a stream
    holds back no characters for a possible stop string when the stop string stays in the output
    (vLLM streams so): each output shows the text of all its tokens, the last ends with the
    stop string, and the core is told to stop the sample."""
    from nanovllm.engine.core_client import CoreStream
    from nanovllm.engine.detokenizer import IncrementalDetokenizer
    from nanovllm.engine.messages import Abort, Delta

    class Client:  # what a CoreStream asks of its CoreClient
        def __init__(self):
            self.tokenizer = offline.tokenizer
            self.eos_token_ids = offline.engine.eos_token_ids
            self._streams = {}
            self.sent = []

        def _send(self, msg):
            self.sent.append(msg)

    prompt = [20, 21, 22]
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    text = ref.text
    stop = next(text[i:i + 3] for i in range(len(text) * 3 // 4, len(text) - 2) if text.index(text[i:i + 3]) == i)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    client = Client()
    loop = asyncio.new_event_loop()
    try:
        stream = CoreStream(client, "r", prompt, params, True, loop)
        detok = IncrementalDetokenizer(offline.tokenizer, prompt)
        for token in ref.token_ids:
            stream._apply(Delta("r", [[token]], [None], False))
            out = stream.snapshot().outputs[0]
            if out.finish_reason is not None:
                break
            detok.add(token)
            assert out.text == detok.text  # nothing held back
    finally:
        loop.close()
    assert (out.text, out.finish_reason, out.stop_reason) == (text[: text.index(stop) + len(stop)], "stop", stop)
    assert [type(m) for m in client.sent] == [Abort]


def test_include_stop_str_in_output_bad_value_is_400(live):
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": "x", "include_stop_str_in_output": 1}),
                            400)
    assert err["param"] == "include_stop_str_in_output"


# ---- truncate_prompt_tokens ------------------------------------------------------------------
SMALL_CONTEXT = 48


@pytest.fixture(scope="module")
def small(qwen3_tiny):
    """A server (in-process AsyncEngine) with a 48-token context, for what the context's end
    decides."""
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), device="cpu", max_model_len=SMALL_CONTEXT, kvcache_block_size=4,
                                     num_kvcache_blocks=64)
    try:
        with serve_in_thread(create_app(engine, MODEL, api_key=KEY)) as url:
            yield httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    finally:
        engine.shutdown()


def test_truncate_prompt_tokens_keeps_the_last_k(live, offline):
    """The request runs on the last k tokens of each prompt (a text's after tokenizing, a chat's
    after its template): usage counts them, and the output is the offline engine's on them."""
    text = "Paris is the capital of France and the largest city of the country"
    ids = offline.tokenizer.encode(text)
    assert len(ids) > 6
    body = dict(model=MODEL, max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=4)
    r = post(live, "/v1/completions", {**body, "prompt": text})
    assert r["usage"]["prompt_tokens"] == 4
    assert r["choices"][0]["text"] == greedy_offline(offline, ids[-4:], 6).outputs[0].text
    assert r["choices"][0]["text"] != greedy_offline(offline, ids, 6).outputs[0].text
    r = post(live, "/v1/completions", {**body, "prompt": [ids, [7, 8, 9]]})  # the short one stays whole
    assert r["usage"]["prompt_tokens"] == 4 + 3
    _, chunks = streamed_texts(live, "/v1/completions", {**body, "prompt": text,
                                                         "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens"] == 4
    messages = [{"role": "user", "content": text}]
    r = post(live, "/v1/chat/completions", {**body, "messages": messages, "truncate_prompt_tokens": 5})
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert len(ref.prompt_token_ids) == 5 and r["usage"]["prompt_tokens"] == 5
    assert r["choices"][0]["message"]["content"] == ref.outputs[0].text


def test_truncate_prompt_tokens_cuts_the_prompt_once(live, offline, monkeypatch):
    """The server cuts each prompt (it counts the kept tokens) and hands the engine the kept ids
    with nothing left to cut; a CoreClient used directly cuts a prompt itself and hands the
    core the kept ids likewise."""
    from nanovllm.engine.core_client import CoreClient
    from nanovllm.engine.messages import AddRequest

    def recording(client):
        added, sent = [], []
        add_request, send = client.add_request, client._send

        async def record_add(request_id, prompt, params=None, stream=True):
            added.append((prompt, params))
            return await add_request(request_id, prompt, params, stream)

        def record_send(message):
            if isinstance(message, AddRequest):
                sent.append(message)
            send(message)

        monkeypatch.setattr(client, "add_request", record_add)
        monkeypatch.setattr(client, "_send", record_send)
        return added, sent

    text = "Paris is the capital of France and the largest city of the country"
    ids = offline.tokenizer.encode(text)
    added, sent = recording(live.engine)
    r = post(live, "/v1/completions", dict(model=MODEL, prompt=text, max_tokens=2, truncate_prompt_tokens=4))
    assert r["usage"]["prompt_tokens"] == 4
    assert [(prompt, params.truncate_prompt_tokens) for prompt, params in added] == [(ids[-4:], None)]
    assert [(m.prompt_token_ids, m.params["truncate_prompt_tokens"]) for m in sent] == [(ids[-4:], None)]

    direct = CoreClient(live.core.addresses, live.core.info, core_alive=live.core.is_alive)
    try:
        _, sent = recording(direct)

        async def run():
            stream = await direct.add_request("cut", ids, SamplingParams(max_tokens=2, truncate_prompt_tokens=5))
            return [out async for out in stream][-1]

        assert asyncio.run(run()).prompt_token_ids == ids[-5:]
        assert [(m.prompt_token_ids, m.params["truncate_prompt_tokens"]) for m in sent] == [(ids[-5:], None)]
    finally:
        direct.shutdown()


@pytest.mark.parametrize("message, param", [("bad_words: their tokens [70000] are outside the vocabulary", "bad_words"),
                                            ("allowed_token_ids [70000] are outside the vocabulary", "allowed_token_ids"),
                                            ("the prompt has 9000 tokens but max_model_len is 64", "prompt")])
def test_an_engine_refusal_names_the_field_its_message_is_about(live, monkeypatch, message, param):
    """The engine core checks some fields against the model (bad words' tokens, the
    vocabulary): its ValueError becomes a 400 naming the field it is about."""
    async def refuse(*args, **kwargs):
        raise ValueError(message)

    monkeypatch.setattr(live.engine, "add_request", refuse)
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 400)
    assert err["param"] == param and err["message"] == message


def test_truncate_prompt_tokens_minus_one_and_the_chat_default_max_tokens(small):
    """-1 keeps as many tokens as the context leaves room for (max_model_len - 1, one left to
    generate); a chat's default max_tokens is the room the truncated prompt leaves."""
    resp = small.post("/v1/completions", json={"prompt": list(range(10, 110)), "truncate_prompt_tokens": -1,
                                               "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"] == {"prompt_tokens": SMALL_CONTEXT - 1, "completion_tokens": 1,
                                    "total_tokens": SMALL_CONTEXT}
    messages = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 2}]
    resp = small.post("/v1/chat/completions", json={"messages": messages, "truncate_prompt_tokens": 4,
                                                    "ignore_eos": True, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": SMALL_CONTEXT - 4,
                                    "total_tokens": SMALL_CONTEXT}


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", True, SMALL_CONTEXT + 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_truncate_prompt_tokens_is_400(small, path, value):
    body = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    err = assert_error_body(small.post(path, json={**body, "truncate_prompt_tokens": value, "max_tokens": 1}), 400)
    assert err["param"] == "truncate_prompt_tokens", err


# ---- stream_options.continuous_usage_stats ---------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_usage_in_every_chunk(live, endpoint, include_usage):
    """As vLLM: every chunk of a choice carries usage, its prompt's tokens and the tokens that
    choice has generated so far (chat's first chunk: 0); include_usage adds the last chunk with
    the request's total, as without continuous_usage_stats."""
    n, max_tokens = 2, 5
    body = dict(model=MODEL, max_tokens=max_tokens, temperature=0.8, seed=1, n=n, ignore_eos=True,
                stream_options={"include_usage": include_usage, "continuous_usage_stats": True})
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body.update(messages=[{"role": "user", "content": "Count with me"}], logprobs=True, top_logprobs=0)
    else:
        path = "/v1/completions"
        body.update(prompt="Count with me", logprobs=0)
    _, chunks = streamed_texts(live, path, body)
    prompt_tokens = post(live, path, {**body, "stream": False, "stream_options": None})["usage"]["prompt_tokens"]
    generated = {i: 0 for i in range(n)}
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        (choice,) = chunk["choices"]
        lp = choice["logprobs"]
        generated[choice["index"]] += len(lp["tokens"] if endpoint == "completions" else lp["content"]) if lp else 0
        assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": generated[choice["index"]],
                                  "total_tokens": prompt_tokens + generated[choice["index"]]}
        if choice["finish_reason"]:
            assert generated[choice["index"]] == max_tokens
    if endpoint == "chat":
        assert [c["usage"]["completion_tokens"] for c in chunks[:n]] == [0] * n  # the role chunks
    assert generated == {i: max_tokens for i in range(n)}
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": prompt_tokens, "completion_tokens": n * max_tokens,
            "total_tokens": prompt_tokens + n * max_tokens}
    else:
        assert chunks[-1]["choices"]
    _, plain = streamed_texts(live, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain if c["choices"])  # without it, the choice chunks carry none


def test_continuous_usage_stats_counts_each_prompt_of_a_batch(live):
    """A batch of completions prompts: each chunk's usage is its own prompt's."""
    body = dict(model=MODEL, prompt=[[5, 6, 7], [5, 6, 7, 8, 9, 10, 11]], max_tokens=3, temperature=0, ignore_eos=True,
                stream_options={"continuous_usage_stats": True})
    _, chunks = streamed_texts(live, "/v1/completions", body)
    for chunk in chunks:
        assert chunk["usage"]["prompt_tokens"] == (3 if chunk["choices"][0]["index"] == 0 else 7)
    assert {c["choices"][0]["index"]: c["usage"]["completion_tokens"] for c in chunks} == {0: 3, 1: 3}


def test_bad_continuous_usage_stats_is_400(live):
    body = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}
    assert assert_error_body(live.http.post("/v1/completions", json=body), 400)["param"] == "stream_options"


# ---- echo (completions) ----------------------------------------------------------------------
def test_echo_puts_the_prompt_before_each_choice(live, offline):
    """Each choice's text starts with its prompt's: a text as given, token ids decoded (special
    tokens kept), a truncated prompt as kept; streamed, in the first chunk of each choice."""
    text = "Paris is the capital of"
    completion = greedy_offline(offline, text, 6).outputs[0].text
    body = dict(model=MODEL, prompt=text, echo=True, max_tokens=6, temperature=0, ignore_eos=True, n=2)
    r = post(live, "/v1/completions", body)
    assert [c["text"] for c in r["choices"]] == [text + completion] * 2
    assert r["usage"] == post(live, "/v1/completions", {**body, "echo": False})["usage"]
    texts, chunks = streamed_texts(live, "/v1/completions", body)
    assert texts == {0: text + completion, 1: text + completion}
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk["choices"][0]["index"], chunk["choices"][0]["text"])
    assert all(first.startswith(text) and len(first) > len(text) for first in firsts.values())

    tok = offline.tokenizer
    ids = [tok.eos_token_id] + tok.encode("The quick brown fox")
    assert tok.decode(ids).startswith(tok.eos_token)  # the special token's text stays
    expected = [tok.decode(p) + greedy_offline(offline, p, 6).outputs[0].text for p in (ids, ids[2:])]
    batch = post(live, "/v1/completions", {**body, "n": 1, "prompt": [ids, ids[2:]]})["choices"]
    assert [c["text"] for c in batch] == expected
    texts, _ = streamed_texts(live, "/v1/completions", {**body, "n": 1, "prompt": [ids, ids[2:]]})
    assert texts == {0: expected[0], 1: expected[1]}

    cut = post(live, "/v1/completions", {**body, "n": 1, "truncate_prompt_tokens": 3})["choices"][0]["text"]
    kept = tok.encode(text)[-3:]
    assert cut == tok.decode(kept) + greedy_offline(offline, kept, 6).outputs[0].text
    stop = completion[2:5]
    stopped = post(live, "/v1/completions", {**body, "n": 1, "stop": [stop]})["choices"][0]
    assert stopped["text"] == text + completion[: completion.index(stop)] and stopped["finish_reason"] == "stop"


@pytest.mark.parametrize("prompt", [[1511637452380852], [-1], [5, 100000], [[5, 6], [7, -3]]])
def test_echo_of_ids_outside_the_vocabulary_is_400_naming_the_prompt(live, prompt):
    body = {"prompt": prompt, "echo": True, "max_tokens": 2}
    for stream in (False, True):
        err = assert_error_body(live.http.post("/v1/completions", json={**body, "stream": stream}), 400)
        assert err["param"] == "prompt" and "vocabulary" in err["message"], err


def completion_logprobs_of(offline, prompt_ids: list[int], logprobs: int, max_tokens: int) -> tuple[list, list]:
    """The offline engine's prompt logprobs and generated tokens of a greedy request, for echo."""
    out = offline.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max(1, max_tokens), ignore_eos=True,
                                                        logprobs=logprobs, prompt_logprobs=logprobs),
                           use_tqdm=False)[0]
    return out.prompt_logprobs, out.outputs[0]


def assert_echoed_logprobs(lp: dict, offline, prompt_ids: list[int], text: str, k: int, max_tokens: int) -> None:
    """A choice's echo + logprobs: the prompt tokens' logprobs first (the first token's null),
    equal to the offline engine's prompt_logprobs, then the generated tokens'; text_offset
    walks the echoed text."""
    prompt_lps, sample = completion_logprobs_of(offline, prompt_ids, k, max_tokens)
    ids = prompt_ids + (sample.token_ids if max_tokens else [])
    entries = prompt_lps + (sample.logprobs if max_tokens else [])
    tok = offline.tokenizer
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(float(entries[j][ids[j]]), abs=1e-4)
        top = sorted(entries[j].items(), key=lambda kv: -kv[1])[:k]
        if ids[j] not in dict(top):
            top.append((ids[j], entries[j][ids[j]]))
        expected = {tok.decode([t]): float(v) for t, v in top}  # texts may repeat: the later one stays
        assert lp["top_logprobs"][j] == pytest.approx(expected, abs=1e-4)
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert "".join(lp["tokens"]) == text


@pytest.mark.parametrize("max_tokens", [1, 4, 0])
def test_echo_with_logprobs_scores_the_prompt(live, offline, max_tokens):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs and max_tokens 1 or 0 (0:
    the prompt alone). Streamed, the first chunk of each choice carries the prompt's entries."""
    text = "Paris is the capital of France"
    prompt_ids = offline.tokenizer.encode(text)
    body = dict(model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0,
                ignore_eos=True)
    r = post(live, "/v1/completions", body)
    choice = r["choices"][0]
    assert "prompt_logprobs" not in choice  # echo's scores come in logprobs; prompt_logprobs only where asked
    assert_echoed_logprobs(choice["logprobs"], offline, prompt_ids, choice["text"], 2, max_tokens)
    assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
    assert r["usage"]["completion_tokens"] == max_tokens
    texts, chunks = streamed_texts(live, "/v1/completions", body)
    assert texts == {0: choice["text"]}
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk["choices"]:
            for key in streamed:
                streamed[key] += (c["logprobs"] or {}).get(key, [])
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    assert_echoed_logprobs(streamed, offline, prompt_ids, choice["text"], 2, max_tokens)
    _, chunks = streamed_texts(live, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens == r["usage"]["completion_tokens"]


def test_prompt_logprobs_field_as_vllm_returns_it(live, offline):
    text = "The quick brown fox jumps"
    prompt_ids = offline.tokenizer.encode(text)
    r = post(live, "/v1/completions", dict(model=MODEL, prompt=text, prompt_logprobs=3, max_tokens=2, n=2))
    expected, _ = completion_logprobs_of(offline, prompt_ids, 3, 2)
    for choice in r["choices"]:
        got = choice["prompt_logprobs"]
        assert len(got) == len(prompt_ids) and got[0] is None
        for j in range(1, len(prompt_ids)):
            assert list(got[j]) == [str(t) for t in expected[j]]  # the prompt token's entry first
            for t, lp in expected[j].items():
                assert got[j][str(t)] == {"logprob": pytest.approx(float(lp), abs=1e-4), "rank": lp.rank,
                                          "decoded_token": offline.tokenizer.decode([t])}
        assert choice["logprobs"] is None
    as_ids = post(live, "/v1/completions", dict(model=MODEL, prompt=text, prompt_logprobs=0, max_tokens=1,
                                                return_tokens_as_token_ids=True))["choices"][0]["prompt_logprobs"]
    assert [list(e.values())[0]["decoded_token"] for e in as_ids[1:]] == [f"token_id:{t}" for t in prompt_ids[1:]]
    plain = post(live, "/v1/completions", dict(model=MODEL, prompt=text, max_tokens=1))
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_prompt_logprobs_at_the_response_level(live, offline):
    messages = [{"role": "user", "content": "hello there"}]
    r = post(live, "/v1/chat/completions", dict(model=MODEL, messages=messages, prompt_logprobs=1, max_tokens=2))
    ours = offline.chat(messages, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    prompt_ids, expected = ours.prompt_token_ids, ours.prompt_logprobs
    got = r["prompt_logprobs"]
    assert len(got) == len(prompt_ids) and got[0] is None
    for j in range(1, len(prompt_ids)):
        assert {int(t): v["logprob"] for t, v in got[j].items()} == pytest.approx(
            {t: float(lp) for t, lp in expected[j].items()}, abs=1e-4)
    assert "prompt_logprobs" not in post(live, "/v1/chat/completions", dict(model=MODEL, messages=messages,
                                                                           max_tokens=1))
    err = assert_error_body(live.http.post("/v1/chat/completions", json=dict(
        messages=messages, prompt_logprobs=1, stream=True)), 400)
    assert err["param"] == "prompt_logprobs"


def test_bad_echo_is_400_naming_echo(live):
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": "x", "echo": "yes"}), 400)
    assert err["param"] == "echo"


# ---- echo (chat) --------------------------------------------------------------------------------
def test_chat_echo_puts_the_last_message_before_the_reply_when_the_roles_match(live):
    """vLLM's chat echo: an assistant message that the model continues (add_generation_prompt
    false) starts the reply, streamed or not, every choice; a user's last message does not
    (the reply is the assistant's)."""
    prefix = "The answer is"
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."},
                                       {"role": "assistant", "content": prefix}],
                add_generation_prompt=False, continue_final_message=True, max_tokens=6, temperature=0,
                ignore_eos=True, n=2)
    plain = post(live, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = post(live, "/v1/chat/completions", {**body, "echo": True})
    assert [c["message"]["content"] for c in echoed["choices"]] == [prefix + plain] * 2
    texts, chunks = streamed_texts(live, "/v1/chat/completions", {**body, "echo": True})
    assert texts == {0: prefix + plain, 1: prefix + plain}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert contents[:4] == ["", prefix, "", prefix]  # each choice's role chunk, then the echo

    parts = [{"type": "text", "text": "The"}, {"type": "text", "text": "answer"}]
    listed = {**body, "n": 1, "echo": True, "messages": [body["messages"][0], {"role": "assistant", "content": parts}]}
    reply = post(live, "/v1/chat/completions", listed)["choices"][0]["message"]["content"]
    assert reply.startswith("The\nanswer")

    assert {c["message"]["role"] for c in echoed["choices"]} == {"assistant"}
    user_goes_on = post(live, "/v1/chat/completions", {**body, "n": 1, "messages": body["messages"][:1],
                                                       "continue_final_message": True, "echo": True})
    assert user_goes_on["choices"][0]["message"]["role"] == "user"  # vLLM's: the reply goes on with it
    assert user_goes_on["choices"][0]["message"]["content"].startswith("Name a colour.")
    _, chunks = streamed_texts(live, "/v1/chat/completions", {**body, "n": 1, "messages": body["messages"][:1],
                                                               "continue_final_message": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "user"

    asked = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
                 temperature=0, ignore_eos=True)
    assert (post(live, "/v1/chat/completions", {**asked, "echo": True})["choices"][0]["message"]["content"]
            == post(live, "/v1/chat/completions", asked)["choices"][0]["message"]["content"])


# ---- return_tokens_as_token_ids ----------------------------------------------------------------
def as_id(token: int) -> str:
    return f"token_id:{token}"


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_in_completion_logprobs(live, offline, stream):
    """vLLM's form: logprobs name each token "token_id:<id>", in `tokens` and as `top_logprobs`
    keys; the text, logprobs and text_offset (offsets in the text) stay as they were."""
    prompt = "Continuous batching"
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True,
                return_tokens_as_token_ids=True)

    def logprobs(body: dict) -> tuple[str, dict]:
        if not stream:
            choice = post(live, "/v1/completions", body)["choices"][0]
            return choice["text"], choice["logprobs"]
        texts, chunks = streamed_texts(live, "/v1/completions", body)
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in chunks:
            for key in merged:
                merged[key] += chunk["choices"][0]["logprobs"][key]
        return texts[0], merged

    text, lp = logprobs(body)
    plain_text, plain = logprobs({**body, "return_tokens_as_token_ids": False})
    assert lp["tokens"] == [as_id(t) for t in ref.token_ids]
    assert [set(top) for top in lp["top_logprobs"]] == [{as_id(t) for t in entry} for entry in ref.logprobs]
    assert lp["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-4)
    assert lp["text_offset"] == plain["text_offset"]
    assert text == plain_text == ref.text
    assert plain["tokens"] == [offline.tokenizer.decode([t]) for t in ref.token_ids]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_in_chat_logprobs(live, offline, stream):
    """Chat: `token` and each `top_logprobs[].token` are "token_id:<id>", and `bytes` are that
    string's UTF-8, as vLLM gives them."""
    messages = [{"role": "user", "content": "hello"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    body = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                ignore_eos=True, return_tokens_as_token_ids=True)
    if stream:
        _, chunks = streamed_texts(live, "/v1/chat/completions", body)
        content = [item for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for item in c["choices"][0]["logprobs"]["content"]]
    else:
        content = post(live, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [as_id(t) for t in ref.token_ids]
    for item, entry in zip(content, ref.logprobs):
        assert item["bytes"] == list(item["token"].encode())
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:3]
        assert {t["token"] for t in item["top_logprobs"]} == {as_id(t) for t, _ in top}
        assert all(t["bytes"] == list(t["token"].encode()) for t in item["top_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_rebuild_the_content(live, stream):
    """Chat logprobs' `bytes` are the tokens' raw bytes (OpenAI's): joined, the output's tokens
    give the content's UTF-8, though this byte-level tokenizer spells the CJK and emoji of the
    forced answer in single bytes, each token's text U+FFFD. Top alternatives' bytes read back
    as their token text (U+FFFD for partial characters)."""
    pytest.importorskip("xgrammar", reason="xgrammar is not installed")
    answer = "日本語 🙂 ok"
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=40, temperature=0,
                logprobs=True, top_logprobs=2, structured_outputs={"choice": [answer]})
    if stream:
        texts, chunks = streamed_texts(live, "/v1/chat/completions", body)
        content = texts[0]
        items = [item for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                 for item in c["choices"][0]["logprobs"]["content"]]
    else:
        choice = post(live, "/v1/chat/completions", body)["choices"][0]
        content, items = choice["message"]["content"], choice["logprobs"]["content"]
    assert content == answer
    assert any(item["token"] == "\ufffd" for item in items)
    assert b"".join(bytes(item["bytes"]) for item in items) == answer.encode()
    for item in items:
        for t in [item, *item["top_logprobs"]]:
            assert bytes(t["bytes"]).decode("utf-8", errors="replace") == t["token"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_return_tokens_as_token_ids_is_400(live, path):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    err = assert_error_body(live.http.post(path, json={**body, "return_tokens_as_token_ids": "yes"}), 400)
    assert err["param"] == "return_tokens_as_token_ids"
