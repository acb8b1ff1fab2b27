"""What routers, gateways and autoscalers read from a replica (docs/scaling.md), from a real
`nanovllm serve` process: /v1/models with `root`, /health, /tokenize and /detokenize in vLLM's
shapes (checked against the Hugging Face tokenizer), and vLLM's Prometheus names in /metrics
with values that match what the requests did.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny"
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replica(qwen3_tiny, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("replica") / "serve.log", "w")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "serve", str(qwen3_tiny), "--device", "cpu", "--port", str(port),
         "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nanovllm serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("nanovllm serve did not become healthy")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tiny)


def test_models_names_the_root(replica, qwen3_tiny):
    card = httpx.get(replica + "/v1/models").json()["data"][0]
    assert card["id"] == NAME
    assert card["root"] == str(qwen3_tiny)
    assert card["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_a_prompt_and_a_chat_as_vllm_does(replica, hf_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    got = httpx.post(replica + "/tokenize", json={"model": NAME, "prompt": text}).json()
    expected = hf_tokenizer.encode(text)
    assert got == {"tokens": expected, "count": len(expected), "max_model_len": MAX_MODEL_LEN, "token_strs": None}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris is the capital of"}]
    chat = httpx.post(replica + "/tokenize", json={"messages": messages}).json()
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["tokens"] == expected and chat["count"] == len(expected)
    # The count is what generation sees.
    usage = httpx.post(replica + "/v1/chat/completions",
                       json={"model": NAME, "messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]


def test_tokenize_returns_the_token_strings_when_asked(replica, hf_tokenizer):
    text = "The quick brown fox"
    got = httpx.post(replica + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = hf_tokenizer.encode(text)
    assert got["tokens"] == ids
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(ids) and len(got["token_strs"]) == len(ids)
    chat = httpx.post(replica + "/tokenize", json={"messages": [{"role": "user", "content": text}],
                                                   "return_token_strs": True}).json()
    assert chat["token_strs"] == hf_tokenizer.convert_ids_to_tokens(chat["tokens"])


def test_continue_final_message_prompt_is_hugging_faces(replica, hf_tokenizer):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                            continue_final_message=True)
    expected = hf_tokenizer.encode(text, add_special_tokens=False)
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    got = httpx.post(replica + "/tokenize", json={"messages": messages, **flags}).json()
    assert got["tokens"] == expected
    usage = httpx.post(replica + "/v1/chat/completions",
                       json={"model": NAME, "messages": messages, "max_tokens": 1, **flags}).json()["usage"]
    assert usage["prompt_tokens"] == len(expected)


def test_version_names_the_package(replica):
    import nanovllm

    assert httpx.get(replica + "/version").json() == {"version": nanovllm.__version__}


def test_detokenize_round_trips(replica, hf_tokenizer):
    text = "Large language models generate text one token at a time."
    ids = hf_tokenizer.encode(text)
    got = httpx.post(replica + "/detokenize", json={"model": NAME, "tokens": ids}).json()
    assert got == {"prompt": hf_tokenizer.decode(ids)}
    assert got["prompt"] == text


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", [1, 2], None),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(replica, path, body, field):
    resp = httpx.post(replica + path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    if field is not None:
        assert field in (error["param"] or "") + error["message"], error


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    """A sample's value; a labelled counter not incremented yet has no sample, i.e. 0."""
    return samples.get((name, tuple(sorted({"model_name": NAME, **labels}.items()))), 0.0)


def test_metrics_under_vllm_names_count_what_was_served(replica):
    before = scrape(replica)
    prompt_tokens = completion_tokens = 0
    for i in range(3):
        usage = httpx.post(replica + "/v1/completions", json={"model": NAME, "prompt": f"request {i} says",
                                                              "max_tokens": 5, "temperature": 0}).json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    with httpx.stream("POST", replica + "/v1/completions",
                      json={"model": NAME, "prompt": "stream", "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        body = "".join(resp.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    after = scrape(replica)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert value(after, gauge) == 0  # idle again
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    assert value(after, "vllm:gpu_cache_usage_perc") == value(after, "vllm:kv_cache_usage_perc")
    assert grew("vllm:request_success_total", finished_reason="length") == 4
    assert grew("vllm:generation_tokens_total") == completion_tokens + 6
    assert grew("vllm:prompt_tokens_total") >= prompt_tokens + 1
    assert grew("vllm:time_to_first_token_seconds_count") == 4
    assert grew("vllm:e2e_request_latency_seconds_count") == 4
    # Gaps between the stream's deliveries: at most 5 for 6 tokens (a delivery may carry several).
    assert ("vllm:inter_token_latency_seconds_count", (("model_name", NAME),)) in after
    assert grew("vllm:inter_token_latency_seconds_count") <= 5
    # One set of truth: the nanovllm_ duplicates of these are gone.
    names = {name for name, _ in after}
    for gone in ("nanovllm_num_requests_running", "nanovllm_time_to_first_token_seconds_count",
                 "nanovllm_generation_tokens_total"):
        assert gone not in names


def test_health(replica):
    assert httpx.get(replica + "/health").status_code == 200


def test_metrics_count_what_an_abandoned_unstreamed_request_generated(replica):
    """A client that leaves an unstreamed request before it ends: the abort, and the prompt and
    generated tokens it had cost, are counted (they used to be counted for streams only)."""
    before = scrape(replica)
    prompt = "a long answer please"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(replica + "/v1/completions", timeout=0.5, json={
            "model": NAME, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while True:  # the abort reaches the engine once the server sees the disconnect
        after = scrape(replica)
        if value(after, "vllm:request_success_total", finished_reason="abort") > \
                value(before, "vllm:request_success_total", finished_reason="abort"):
            break
        assert time.monotonic() < deadline, "the abandoned request was not counted"
        time.sleep(0.2)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="abort") == 1
    assert grew("vllm:prompt_tokens_total") >= 3
    assert 0 < grew("vllm:generation_tokens_total") < MAX_MODEL_LEN - 16
    assert grew("vllm:time_to_first_token_seconds_count") == 1
