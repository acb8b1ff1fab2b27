"""vLLM's request fields that real clients send, live through the server (the engine core in its
own process, as `nanovllm serve` runs it): include_stop_str_in_output, truncate_prompt_tokens,
stream_options.continuous_usage_stats, echo and return_tokens_as_token_ids. What a choice says is
compared with the offline engine on the same checkpoint; bad values are a 400 naming the field."""
from __future__ import annotations

import asyncio
import json

import pytest

from nanovllm import SamplingParams
from test_server import MODEL, assert_error_body, greedy_offline, live, offline  # noqa: F401 (fixtures)


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


def test_include_stop_str_in_output_streams_without_holding_text_back(live, offline):
    """Through the engine core: a stream holds back no characters for a possible stop string
    when the stop string stays in the output (vLLM streams so); each output shows the text of
    all its tokens."""
    from nanovllm.engine.detokenizer import IncrementalDetokenizer

    prompt = [20, 21, 22]
    text = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)

    async def main():
        return [o async for o in live.engine.generate("include-stop", prompt, params)]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == text[: text.index(stop) + len(stop)]
    assert len(outs) > 2
    for out in outs[:-1]:
        detok = IncrementalDetokenizer(offline.tokenizer, prompt)
        for token in out.outputs[0].token_ids:
            detok.add(token)
        assert out.outputs[0].text == detok.text


def test_include_stop_str_in_output_bad_value_is_400(live):
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": "x", "include_stop_str_in_output": 1}),
                            400)
    assert err["param"] == "include_stop_str_in_output"
