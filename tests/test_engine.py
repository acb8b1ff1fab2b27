"""End-to-end engine tests on tiny random checkpoints (CPU, fp32, torch attention).

Greedy output must equal Hugging Face transformers token for token, and must not change when
the engine takes a different path to it: prefix-cache hit vs miss, chunked vs whole prefill,
preempted vs not, batched vs alone, one sequence at a time vs many.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams

SHAPES = [
    pytest.param(dict(arch="qwen3"), id="qwen3-gqa2-hd32-tied"),
    pytest.param(dict(arch="qwen3", num_heads=4, num_kv_heads=4, head_dim=64, tie_word_embeddings=False), id="qwen3-mha-hd64-untied"),
    pytest.param(dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=32), id="qwen3-gqa4"),
    pytest.param(dict(arch="qwen2", num_heads=4, num_kv_heads=2, head_dim=16), id="qwen2-bias"),
    pytest.param(dict(arch="llama", num_heads=4, num_kv_heads=1, head_dim=16, tie_word_embeddings=False), id="llama"),
    pytest.param(
        dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        id="llama3-rope-scaling",
    ),
    pytest.param(
        dict(arch="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        id="qwen3-yarn-rope-scaling",
    ),
]


def random_prompts(vocab: int, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(gen[0, len(p):].tolist())
    return outs


def engine(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 1024)
    return LLM(str(path), **kw)


def greedy(n):
    # min_tokens = max_tokens: EOS is masked until the end, exactly like HF's min_new_tokens.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def test_yarn_reaches_past_max_position_embeddings(tmp_path_factory, tokenizer_dir):
    """A YaRN config with max_position_embeddings 64 and factor 4 serves 256 positions (as
    Qwen3's 40,960 serve 131,072): a 150-token prompt plus 30 tokens equals transformers', whose
    rotary embedding is not bounded by max_position_embeddings."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("yarn"), tokenizer_dir, "qwen3", max_position_embeddings=64,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    llm = engine(path, max_model_len=256)
    assert llm.engine.max_model_len == 256
    prompts = random_prompts(llm.engine.vocab_size, [150], seed=3)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(30), use_tqdm=False)]
    assert ours == hf_greedy(path, prompts, 30)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_matches_transformers(checkpoint_factory, shape):
    path = checkpoint_factory(**shape)
    llm = engine(path)
    prompts = random_prompts(llm.engine.vocab_size, [1, 5, 23, 70, 150])
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    assert ours == hf_greedy(path, prompts, 12)


@pytest.fixture(scope="module")
def reference(qwen3_tiny):
    """Greedy outputs of a mixed batch from the plainest configuration."""
    prompts = random_prompts(384, [3, 40, 17, 90, 8, 33], seed=1)
    prompts.append(prompts[1][:30] + [5, 6, 7])  # shares a prefix with prompt 1
    llm = engine(qwen3_tiny, enable_prefix_caching=False)
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def assert_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_prefix_cache_hit_equals_miss(qwen3_tiny, reference):
    prompts, expected = reference
    llm = engine(qwen3_tiny, kvcache_block_size=4)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(20), use_tqdm=False)]
    second = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert first == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 4)
    assert_free(llm)


def test_chunked_prefill_equals_whole(qwen3_tiny, reference):
    prompts, expected = reference
    llm = engine(qwen3_tiny, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(20), use_tqdm=False)] == expected
    assert_free(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_equals_no_preemption(qwen3_tiny, reference, prefix_caching):
    prompts, expected = reference
    llm = engine(qwen3_tiny, kvcache_block_size=4, num_kvcache_blocks=40, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the prompt's prefix-cache hit at admission (none in a fresh cache), not a readmission's hit
    # over prompt and output
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    assert_free(llm)


def test_batch_equals_each_alone_and_one_seq_at_a_time(qwen3_tiny, reference):
    prompts, expected = reference
    llm = engine(qwen3_tiny, max_num_seqs=1)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(20), use_tqdm=False)] == expected
    llm = engine(qwen3_tiny)
    alone = [llm.generate([p], greedy(20), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == expected


def test_outputs_work_both_ways_and_keep_prompt_order(qwen3_tiny):
    llm = engine(qwen3_tiny)
    outs = llm.generate(["Paris is the capital", "The quick brown fox jumps"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    tok = llm.tokenizer
    for prompt, out in zip(["Paris is the capital", "The quick brown fox jumps"], outs):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out["token_ids"] == out.outputs[0].token_ids and len(out["token_ids"]) == 5
        assert out["text"] == out.outputs[0].text == tok.decode(out["token_ids"], skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length"


def test_per_prompt_params_and_n(qwen3_tiny):
    llm = engine(qwen3_tiny)
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                             SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=3, ignore_eos=True)], use_tqdm=False)
    assert len(outs[0].outputs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    assert len(outs[1].outputs) == 3 and all(len(c.token_ids) == 6 for c in outs[1].outputs)
    assert_free(llm)


def test_seeded_sampling_reproducible_whatever_the_batch(qwen3_tiny):
    llm = engine(qwen3_tiny)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    batch = llm.generate([[1, 2, 3, 4, 5], [10, 11, 12], [7] * 30], [others, sp, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [llm.generate([[10, 11, 12]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # really random without a seed


def test_stop_strings_and_stop_token_ids(qwen3_tiny):
    llm = engine(qwen3_tiny)
    base = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert cut.stop_reason == stop and base.stop_reason is None  # vLLM's stop_reason
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    by_id = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: first + 1]
    assert by_id.stop_reason == stop_id
    # vLLM's rule: the stop token stays in token_ids, its text is left out (streamed too)
    assert by_id.text == llm.tokenizer.decode(base.token_ids[:first]) != llm.tokenizer.decode(by_id.token_ids)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    *_, last = llm.stream([20, 21, 22], params)
    assert last.outputs[0].text == by_id.text
    eos = llm.engine.eos_token_ids[0]
    ended = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=4, logit_bias={eos: 100.0},
                                                        skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert (ended.token_ids, ended.text, ended.finish_reason, ended.stop_reason) == ([eos], "", "stop", None)
    assert_free(llm)


def test_include_stop_str_in_output_keeps_the_stop_string(qwen3_tiny):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (what
    the same token added after it is cut), each of n samples, streamed or not; a stream holds
    back no characters for a stop string then (what precedes one stays in the output)."""
    llm = engine(qwen3_tiny)
    prompt = [20, 21, 22]
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].text
    stop = text[3:6]
    expected = text[: text.index(stop) + len(stop)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], n=2,
                            include_stop_str_in_output=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [(expected, "stop", stop)] * 2
    streamed = list(llm.stream(prompt, params))
    assert [c.text for c in streamed[-1].outputs] == [expected] * 2
    unstopped = {len(o.outputs[0].token_ids): o.outputs[0].text for o in llm.stream(prompt, plain)}
    for o in streamed[:-1]:  # as much text as a stream without stop strings shows
        assert o.outputs[0].text == unstopped[len(o.outputs[0].token_ids)]
    # a stop string that ends inside a token: the rest of that token's text is cut
    boundaries = {len(t) for t in unstopped.values()}
    end = next(i for i in range(2, len(text)) if i not in boundaries and text.index(text[i - 2:i]) == i - 2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[end - 2:end]],
                            include_stop_str_in_output=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[:end] and out.stop_reason == text[end - 2:end]
    # vLLM's rule: the text of a stop token that ends the output stays too (a stop_token_ids
    # entry, EOS), streamed or not
    ids = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id],
                            include_stop_str_in_output=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with_token = llm.tokenizer.decode(ids[: first + 1])
    assert (out.text, out.stop_reason) == (with_token, stop_id) and with_token != llm.tokenizer.decode(ids[:first])
    assert list(llm.stream(prompt, params))[-1].outputs[0].text == with_token
    eos = llm.engine.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=False,
                            include_stop_str_in_output=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == ([eos], llm.tokenizer.decode([eos])) and out.text
    assert list(llm.stream(prompt, params))[-1].outputs[0].text == out.text
    assert_free(llm)


def test_truncate_prompt_tokens_keeps_the_last_k(qwen3_tiny):
    """vLLM's truncate_prompt_tokens: the request runs on the last k tokens of its prompt (token
    ids, a tokenized text or a chat), which its output reports; -1 keeps as many as the context
    leaves room for; more than max_model_len is a ValueError naming the field."""
    llm = engine(qwen3_tiny, max_model_len=64)
    greedy4 = dict(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(10, 40))
    out = llm.generate([prompt], SamplingParams(**greedy4, truncate_prompt_tokens=5), use_tqdm=False)[0]
    alone = llm.generate([prompt[-5:]], SamplingParams(**greedy4), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-5:] and out.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(**greedy4), use_tqdm=False)[0]
    assert whole.outputs[0].token_ids != alone.outputs[0].token_ids  # the cut changed what the model saw
    text = "the quick brown fox jumps over the lazy dog"
    out = llm.generate([text], SamplingParams(**greedy4, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(text)[-3:]
    messages = [{"role": "user", "content": text}]
    chat = llm.chat(messages, SamplingParams(**greedy4), use_tqdm=False)[0].prompt_token_ids
    out = llm.chat(messages, SamplingParams(**greedy4, truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == chat[-6:]
    long = list(range(10, 110))  # longer than max_model_len
    out = llm.generate([long], SamplingParams(temperature=0, max_tokens=None, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-63:] and len(out.outputs[0].token_ids) == 1
    out = llm.generate([prompt], SamplingParams(**greedy4, truncate_prompt_tokens=64), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt  # shorter than k: as it is
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([prompt], SamplingParams(**greedy4, truncate_prompt_tokens=65), use_tqdm=False)
    assert_free(llm)


def expected_with_min_tokens(text: str, prefix: str, stop: str) -> str:
    """vLLM's rule: a stop string is searched for only once more than min_tokens tokens are out,
    and only where it reaches past the text of the first min_tokens tokens (`prefix`)."""
    j = text.find(stop, max(0, len(prefix) - len(stop) + 1))
    return text if j == -1 else text[:j]


def test_stop_strings_wait_for_min_tokens(qwen3_tiny):
    llm = engine(qwen3_tiny)
    prompt = [[20, 21, 22]]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text, stop = base.text, base.text[3:6]
    first = text.index(stop)
    # The fewest tokens whose text holds the first stop string whole.
    m = next(k for k in range(1, 30) if len(llm.tokenizer.decode(base.token_ids[:k])) >= first + len(stop))
    prefix = llm.tokenizer.decode(base.token_ids[:m])
    assert text.startswith(prefix)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=m)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    expected = expected_with_min_tokens(text, prefix, stop)
    assert out.text == expected and len(out.text) > first
    assert out.finish_reason == ("stop" if expected != text else "length")
    *_, last = llm.stream(prompt[0], params)
    assert last.outputs[0].text == expected
    assert_free(llm)


def test_eos_stops_unless_ignored(qwen3_tiny):
    llm = engine(qwen3_tiny)
    eos = llm.engine.eos_token_ids
    assert eos == [llm.tokenizer.eos_token_id]
    base = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    llm2 = engine(qwen3_tiny, eos=base.token_ids[2])  # pretend the third greedy token is EOS
    out = llm2.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[2]) + 1]


def test_logprobs(qwen3_tiny):
    from transformers import AutoModelForCausalLM

    llm = engine(qwen3_tiny)
    prompt = [30, 31, 32, 33]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(entry)
        # vLLM's Logprob reads too: .logprob, and .rank 1..3 in the reference's order
        assert entry[token].logprob == entry[token]
        assert [entry[t].rank for t in top] == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-5)
    # a sampled token outside the top k has no rank
    sampled = llm.generate([prompt], SamplingParams(temperature=5.0, seed=1, max_tokens=40, logprobs=1, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    outside = [(t, e) for t, e in zip(sampled.token_ids, sampled.logprobs) if len(e) == 2]
    assert outside and all(e[t].rank is None and [x.rank for x in e.values() if x is not e[t]] == [1]
                           for t, e in outside)


def test_chat_template(qwen3_tiny):
    llm = engine(qwen3_tiny)
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    turns = messages + [{"role": "assistant", "content": "hi"}]
    out = llm.chat(turns, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                   add_generation_prompt=False)[0]
    expected = llm.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)


def test_streaming_yields_growing_outputs(qwen3_tiny):
    llm = engine(qwen3_tiny)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    final = llm.generate([[40, 41]], sp, use_tqdm=False)[0].outputs[0]
    chunks = list(llm.stream([40, 41], sp))
    assert [len(c.outputs[0].token_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].finished and chunks[-1].outputs[0].token_ids == final.token_ids
    assert chunks[-1].outputs[0].text == final.text


def _stream_outputs(llm, prompt, params, delta):
    eng = llm.engine
    eng.add_request("r", prompt, params, stream=True, delta=delta)
    outputs = []
    while eng.has_unfinished_requests():
        outputs += [o for o in eng.step() if o.request_id == "r"]
    return outputs


@pytest.mark.parametrize("stop", [False, True], ids=["logprobs-n2", "stop-string"])
def test_delta_stream_adds_up_to_the_cumulative_one(qwen3_tiny, stop):
    """A delta stream (each output only what a sample gained since the last) carries, output by
    output, exactly the growth of the cumulative stream of the same request: token ids, text
    (a stop string holds back and truncates it alike), logprobs, finish reasons."""
    llm = engine(qwen3_tiny)
    prompt = [40, 41, 42]
    params = dict(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    if stop:
        text = _stream_outputs(llm, prompt, SamplingParams(**params), delta=False)[-1].outputs[0].text
        params["stop"] = [text[len(text) // 2 : len(text) // 2 + 3]]
    else:
        params["logprobs"] = 2
    cumulative = _stream_outputs(llm, prompt, SamplingParams(**params), delta=False)
    deltas = _stream_outputs(llm, prompt, SamplingParams(**params), delta=True)
    assert len(deltas) == len(cumulative) and deltas[-1].finished and cumulative[-1].finished
    if stop:
        assert cumulative[-1].outputs[0].finish_reason == "stop"
    for before, after in zip(cumulative, cumulative[1:]):  # text never shrinks, a finished sample's neither
        assert all(after.outputs[i].text.startswith(before.outputs[i].text) for i in range(2))
    tokens, texts, logprobs = [[], []], ["", ""], [[], []]
    for d, c in zip(deltas, cumulative):
        for i in range(2):
            tokens[i] += d.outputs[i].token_ids
            texts[i] += d.outputs[i].text
            assert tokens[i] == c.outputs[i].token_ids
            assert texts[i] == c.outputs[i].text
            assert d.outputs[i].finish_reason == c.outputs[i].finish_reason
            if not stop:
                logprobs[i] += d.outputs[i].logprobs
                assert logprobs[i] == c.outputs[i].logprobs
                assert d.outputs[i].cumulative_logprob == pytest.approx(c.outputs[i].cumulative_logprob)
    assert all(len(c.token_ids) > 1 for c in cumulative[-1].outputs)
    assert_free(llm)


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ("", "empty"), ([1, 2, 10**6], "outside the vocabulary"), ([-1], "outside the vocabulary"),
     ([5] * 2000, "max_model_len")],
)
def test_bad_prompts_raise_and_engine_keeps_serving(qwen3_tiny, prompt, message):
    llm = engine(qwen3_tiny)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_free(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert_free(llm)


def test_prompt_larger_than_pool_is_rejected(qwen3_tiny):
    llm = engine(qwen3_tiny, kvcache_block_size=4, num_kvcache_blocks=4)
    with pytest.raises(ValueError, match="KV cache blocks"):
        llm.generate([[3] * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(llm.generate([[3] * 5], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
     (dict(max_tokens=0), "max_tokens"), (dict(min_p=2), "min_p"), (dict(n=0), "n"),
     (dict(stop=[1]), "stop"), (dict(logprobs=-1), "logprobs"), (dict(min_tokens=9, max_tokens=2), "min_tokens"),
     (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
     (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
     (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
     (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
     (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_llm_kwarg_is_a_type_error(qwen3_tiny):
    with pytest.raises(TypeError, match="not_an_option"):
        LLM(str(qwen3_tiny), not_an_option=1)
    with pytest.raises(ValueError, match="device"):
        LLM(str(qwen3_tiny), device="tpu")


@pytest.mark.parametrize("kwargs, field", [
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=None), "gpu_memory_utilization"),
    (dict(num_kvcache_blocks=True), "num_kvcache_blocks"),
    (dict(cpu_kvcache_space_gib=float("nan")), "cpu_kvcache_space_gib"),
    (dict(cpu_kvcache_space_gib=0), "cpu_kvcache_space_gib"),
    (dict(cpu_kvcache_space_gib="1"), "cpu_kvcache_space_gib"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=-1), "seed"),
    (dict(eos=-5), "eos"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(enforce_eager="yes"), "enforce_eager"),
    (dict(async_scheduling="x"), "async_scheduling"),
    (dict(max_model_len=0), "max_model_len"),
])
def test_bad_engine_options_are_value_errors_naming_them(kwargs, field):
    from nanovllm.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(None, **kwargs)


def test_max_model_len_defaults_to_the_models_context_and_may_not_pass_it(qwen3_tiny):
    """qwen3_tiny's context is 1,024 positions: that is the default (under 4,096), a longer
    max_model_len is refused naming it (vLLM's rule), and an eos outside the vocabulary too."""
    assert LLM(str(qwen3_tiny), device="cpu").engine.max_model_len == 1024
    with pytest.raises(ValueError, match="max_model_len=2048.*1024"):
        LLM(str(qwen3_tiny), device="cpu", max_model_len=2048)
    with pytest.raises(ValueError, match="eos"):
        LLM(str(qwen3_tiny), device="cpu", eos=10**6)


def test_interleaved_streams_and_generate_each_get_every_output(qwen3_tiny):
    """Two streams read in turns, and a generate while a stream is open: each call's own steps
    serve the others' requests too, and every call still ends on its final output."""
    llm = engine(qwen3_tiny)
    short, long_ = greedy(4), greedy(12)
    alone = {p: llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in (("hello", short), ("The quick brown fox", long_))}
    a, b = llm.stream("The quick brown fox", long_), llm.stream("hello", short)
    b_outputs = [next(b)]
    a_outputs = list(a)
    b_outputs += list(b)
    for outputs, prompt in ((a_outputs, "The quick brown fox"), (b_outputs, "hello")):
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == alone[prompt]
        assert all(not o.finished for o in outputs[:-1])
    open_stream = llm.stream("hello", short)
    first = next(open_stream)
    (whole,) = llm.generate(["The quick brown fox"], long_, use_tqdm=False)
    assert whole.outputs[0].token_ids == alone["The quick brown fox"]
    rest = list(open_stream)
    assert rest and rest[-1].finished and rest[-1].outputs[0].token_ids == alone["hello"] and not first.finished
    assert_free(llm)


def test_max_model_len_caps_generation(qwen3_tiny):
    llm = engine(qwen3_tiny, max_model_len=20)
    out = llm.generate([[4] * 15], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    # max_tokens=None (vLLM's): as many as the context leaves
    out = llm.generate([[4] * 12], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=None, min_tokens=4).min_tokens == 4


def test_triton_backend_under_interpreter_equals_torch(qwen3_tiny, reference):
    """The Triton backend through the whole engine (on CPU via TRITON_INTERPRET=1, set in conftest)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1, which conftest sets where "
                    "there is no CUDA device; on a CUDA host the engine's default triton backend runs on the GPU")
    prompts, expected = reference
    llm = engine(qwen3_tiny, attention_backend="triton", kvcache_block_size=8)
    assert llm.engine.executor.runner.backend.name == "triton"
    # The shortest and the longest prompt: 3 tokens (part of one block) and 90 (twelve blocks).
    picked = [0, 3]
    outs = llm.generate([prompts[i] for i in picked], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[i][:6] for i in picked]


@pytest.mark.parametrize("extra", [dict(), dict(kvcache_block_size=4, num_kvcache_blocks=40, max_num_batched_tokens=16)],
                         ids=["plain", "preempt-chunked"])
def test_async_scheduling_equals_synchronous(qwen3_tiny, reference, extra):
    """Scheduling step N+1 before step N's ids reach the host changes nothing, greedy or seeded."""
    prompts, expected = reference
    sync = engine(qwen3_tiny, **extra)  # on CPU the default is synchronous
    asyn = engine(qwen3_tiny, async_scheduling=True, **extra)
    assert asyn.engine.async_scheduling and not sync.engine.async_scheduling
    assert [o.outputs[0].token_ids for o in sync.generate(prompts, greedy(20), use_tqdm=False)] == expected
    assert [o.outputs[0].token_ids for o in asyn.generate(prompts, greedy(20), use_tqdm=False)] == expected
    seeded = SamplingParams(temperature=0.8, top_k=50, max_tokens=15, seed=7, ignore_eos=True, logprobs=2)
    a = sync.generate(prompts, seeded, use_tqdm=False)
    b = asyn.generate(prompts, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):  # same tokens; logprobs equal up to fp32 rounding (batches differ)
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            common = set(ex) & set(ey)
            assert len(common) >= 2 and all(ex[t] == pytest.approx(ey[t], abs=1e-4) for t in common)
    assert_free(sync)
    assert_free(asyn)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abandoned_stream_frees_blocks(qwen3_tiny, async_scheduling):
    llm = engine(qwen3_tiny, async_scheduling=async_scheduling)
    stream = llm.stream([40, 41, 42], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    first = [next(stream) for _ in range(3)]
    assert len(first[-1].outputs[0].token_ids) == 3
    stream.close()  # the consumer walks away: the request is aborted
    assert_free(llm)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_every_decode_batch_has_a_graph_that_fits():
    """A step of n decodes replays the smallest captured graph of at least n rows (padded)."""
    from nanovllm.runner.cuda_graph import CudaGraphRunner

    for max_batch in (1, 8, 40, 512):
        graphs = CudaGraphRunner(None, torch.device("cpu"), max_batch, 4, 64)
        assert graphs.max_batch >= max_batch
        for n in range(1, max_batch + 1):
            size = graphs.graph_size(n)
            assert size in graphs.sizes and n <= size
            assert not any(n <= smaller < size for smaller in graphs.sizes)


def test_packed_step_arrays_start_on_16_byte_boundaries(qwen3_tiny):
    """A step's arrays share one host-to-device copy; each view must start 16-byte aligned
    whatever the token count (Triton compiles a variant per pointer alignment)."""
    import numpy as np

    runner = LLM(str(qwen3_tiny), device="cpu").engine.executor.runner
    for sizes in [(3, 3, 3, 0, 0), (5, 1, 7, 2, 2), (1, 1, 1, 1, 1)]:
        arrays = [np.arange(n, dtype=np.int64) * (i + 1) for i, n in enumerate(sizes)]
        views = runner._to_device_packed(arrays)
        for a, v in zip(arrays, views):
            assert v.data_ptr() % 16 == 0 and v.dtype == torch.int64 and v.tolist() == a.tolist()
    # int64 and int32 arrays in one copy, as a step sends them
    mixed = [np.arange(3, dtype=np.int64), np.arange(1, dtype=np.int32) + 7, np.arange(5, dtype=np.int64) - 9,
             np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros(0, dtype=np.int64), np.arange(3, dtype=np.int32)]
    for a, v in zip(mixed, runner._to_device_packed(mixed)):
        assert v.data_ptr() % 16 == 0 and v.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
        assert v.shape == a.shape and v.tolist() == a.tolist()


def test_engine_freezes_startup_objects_out_of_gc(qwen3_tiny):
    """Start-up objects are moved to the collector's permanent generation (full collections then
    skip them)."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = engine(qwen3_tiny)
    assert gc.get_freeze_count() > 0
    assert "gc_freeze" in llm.engine.startup_seconds


def count_bursts(llm):
    """Wrap the runner's multi-step decode (run_steps, what runs a burst on the CPU); returns the
    list its calls' step counts land in."""
    runner = llm.engine.executor.runner
    calls, inner = [], runner.run_steps

    def counted(item, launch):
        calls.append(item.num_steps)
        return inner(item, launch)

    runner.run_steps = counted
    return calls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_bursts_equal_single_steps(qwen3_tiny, async_scheduling):
    """A lone greedy sequence decodes 3 steps per engine step (blocks of 4 positions: bursts cross
    block boundaries; 20 tokens: the last ones as single steps); the tokens equal one step at a
    time, and a second request added mid-stream ends the bursts until it is done."""
    prompts = random_prompts(384, [3, 40, 17], seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    single = engine(qwen3_tiny, kvcache_block_size=4, decode_burst=1, async_scheduling=async_scheduling)
    expected = [single.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = engine(qwen3_tiny, kvcache_block_size=4, decode_burst=3, async_scheduling=async_scheduling)
    bursts = count_bursts(llm)
    assert [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == expected
    assert bursts and set(bursts) == {3}
    assert_free(llm)
    eng = llm.engine
    eng.add_request("a", prompts[0], params)
    for _ in range(4):
        eng.step()
    eng.add_request("b", prompts[1], params)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)
    assert done == {"a": expected[0], "b": expected[1]}
    assert_free(llm)


def test_a_request_ends_in_shorter_bursts(qwen3_tiny):
    """Bursts of 4: 19 tokens after the prefill's are four bursts of 4, one of 2 (burst_sizes) and
    a single step, with the tokens of one step at a time."""
    prompt = random_prompts(384, [11], seed=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = engine(qwen3_tiny, kvcache_block_size=4, decode_burst=1).generate(prompt, params, use_tqdm=False)
    llm = engine(qwen3_tiny, kvcache_block_size=4, decode_burst=4)
    bursts = count_bursts(llm)
    out = llm.generate(prompt, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert bursts == [4, 4, 4, 4, 2]
    assert_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_decode_bursts_equal_single_steps(qwen3_tiny, async_scheduling):
    """A lone plain-temperature stream takes bursts too. Here (no persistent kernel) a burst's 3
    steps each sample with the reference sampler, drawing from torch's RNG in the order single
    steps do, so from the same seed the tokens equal one step at a time; and they are a sample,
    not the greedy tokens. A top-p or seeded stream bursts as well (a seeded one gives the tokens
    it gives one step at a time); a logprobs stream takes no burst."""
    prompt = [[7, 8, 9, 10]]
    kw = dict(kvcache_block_size=4, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True)
    single = engine(qwen3_tiny, decode_burst=1, **kw)
    expected = single.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = engine(qwen3_tiny, decode_burst=3, **kw)
    bursts = count_bursts(llm)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert bursts and set(bursts) == {3}
    greedy_ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert greedy_ids != expected
    for other in (dict(top_p=0.9), dict(seed=4, top_k=5), dict(logprobs=1)):
        bursts.clear()
        p = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True, **other)
        out = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert bool(bursts) == ("logprobs" not in other) and len(out.token_ids) == 20, other
        if "seed" in other:
            assert out.token_ids == single.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    assert_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_burst_stops_inside_a_burst(qwen3_tiny, async_scheduling):
    """EOS, a stop token id, a stop string and max_tokens landing inside a burst of 4: the
    output ends where it would one step at a time, and the tokens after it are dropped."""
    kw = dict(kvcache_block_size=4, async_scheduling=async_scheduling)
    prompt = [[20, 21, 22]]
    base = engine(qwen3_tiny, decode_burst=1, **kw).generate(
        prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids, text = base.token_ids, base.text
    eos = ids[6]
    first_eos = ids.index(eos)
    llm = engine(qwen3_tiny, decode_burst=4, eos=eos, **kw)
    bursts = count_bursts(llm)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[: first_eos + 1]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ids[9]]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(ids[9]) + 1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    for n in (5, 14):  # 1 + 4 and 1 + 3 * 4 + 1: the last token alone
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and out.token_ids == ids[:n]
    assert bursts
    assert_free(llm)


def test_decode_burst_streams_and_prefix_caches_what_it_made(qwen3_tiny):
    """Streaming over bursts yields every token once, in order (several per output); the blocks
    a burst filled are cached with the right tokens: a prompt that continues the output hits
    them and goes on exactly as the first generation did."""
    llm = engine(qwen3_tiny, kvcache_block_size=4, decode_burst=4, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [50, 51, 52, 53, 54]
    outs = list(llm.stream(prompt, params))
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 24 and any(b - a > 1 for a, b in zip(lengths, lengths[1:]))
    ids = outs[-1].outputs[0].token_ids
    follow = llm.generate([prompt + ids[:15]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)[0]
    assert follow.num_cached_tokens >= 16
    assert follow.outputs[0].token_ids == ids[15:]
    assert_free(llm)


def test_decode_burst_is_validated():
    from nanovllm.config import EngineConfig

    for bad in (0, -2, 2.5, True, 65):
        with pytest.raises(ValueError, match="decode_burst"):
            EngineConfig(decode_burst=bad)
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(decode_burst=4, tensor_parallel_size=2)
