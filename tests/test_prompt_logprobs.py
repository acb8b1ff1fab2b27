"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob under the model given the
tokens before it, and the k likeliest tokens at its position, equal to transformers' log_softmax
of the same model's logits, whatever path the prompt takes (chunked, cached before, preempted,
batched with plain requests)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.messages import params_from_wire, params_to_wire, prompt_logprobs_from_wire, prompt_logprobs_to_wire

from test_engine import random_prompts


def engine(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 1024)
    return LLM(str(path), **kw)


@pytest.fixture(scope="module")
def hf_logprobs(qwen3_tiny):
    """prompt -> transformers' log_softmax of its logits [len(prompt), vocab] (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.float32).eval()

    def of(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)

    return of


def assert_matches(prompt_logprobs, prompt, ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[j], ref[j - 1], prompt[j]
        assert 1 <= len(entry) <= k + 1
        assert next(iter(entry)) == token  # the prompt token's own entry first, as vLLM's
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        # 1 + the tokens scoring higher (near-ties of the two computations either way)
        assert 1 + int((row > row[token] + 1e-4).sum()) <= entry[token].rank <= int((row > row[token] - 1e-4).sum())
        top = torch.topk(row, k).indices.tolist()
        assert set(top) <= set(entry)
        for rank, t in enumerate(top, 1):
            assert entry[t] == pytest.approx(row[t].item(), abs=1e-4)
            if t != token:
                assert entry[t].rank == rank


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers(qwen3_tiny, hf_logprobs, k):
    llm = engine(qwen3_tiny)
    prompt = random_prompts(llm.engine.vocab_size, [23], seed=5)[0]
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k))[0]
    assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), k)
    assert out.outputs[0].logprobs is None  # prompt_logprobs alone asks nothing of the generated tokens


def test_not_asked_is_none_and_one_token_prompt_has_one_entry(qwen3_tiny):
    llm = engine(qwen3_tiny)
    plain, single = generate(llm, [[30, 31, 32], [30]],
                             [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=2)])
    assert plain.prompt_logprobs is None
    assert single.prompt_logprobs == [None]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prefill(qwen3_tiny, hf_logprobs, prefix_caching, async_scheduling):
    """A prompt longer than the step's token budget: each chunk scores its positions, in order."""
    llm = engine(qwen3_tiny, max_num_batched_tokens=7, kvcache_block_size=4, enable_prefix_caching=prefix_caching,
                 async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.vocab_size, [40, 9], seed=6)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    for out, prompt in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 2)


def test_one_token_chunks(qwen3_tiny, hf_logprobs):
    """A budget of two tokens beside a decoding sequence leaves a prompt chunks of one token,
    each scoring the next prompt token."""
    llm = engine(qwen3_tiny, max_num_batched_tokens=2, max_num_seqs=2)
    prompts = random_prompts(llm.engine.vocab_size, [2, 11], seed=7)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1))
    for out, prompt in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 1)


def test_prompt_cached_before_is_computed_whole(qwen3_tiny, hf_logprobs):
    llm = engine(qwen3_tiny, kvcache_block_size=4)
    prompt = random_prompts(llm.engine.vocab_size, [30], seed=8)[0]
    generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2))
    again = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # the cache holds the prompt
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 3)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_records_each_position_once(qwen3_tiny, hf_logprobs, async_scheduling):
    llm = engine(qwen3_tiny, kvcache_block_size=4, num_kvcache_blocks=40, max_num_batched_tokens=16,
                 async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.vocab_size, [40, 37, 33, 30], seed=9)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 2)


def test_batch_mixing_prompt_logprobs_and_plain_requests(qwen3_tiny, hf_logprobs):
    llm = engine(qwen3_tiny, max_num_batched_tokens=32)
    prompts = random_prompts(llm.engine.vocab_size, [25, 14, 31, 8], seed=10)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    asking = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=4)
    alone = generate(llm, prompts, plain)
    mixed = generate(llm, prompts, [asking, plain, asking, plain])
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        for ea, em in zip(a.outputs[0].logprobs, m.outputs[0].logprobs):
            assert ea.keys() == em.keys() and all(ea[t] == pytest.approx(em[t], abs=1e-4) for t in ea)
        if i % 2:
            assert m.prompt_logprobs is None
        else:
            assert_matches(m.prompt_logprobs, prompts[i], hf_logprobs(prompts[i]), 4)


def test_n_samples_share_one_prompt_logprobs(qwen3_tiny, hf_logprobs):
    llm = engine(qwen3_tiny)
    prompt = random_prompts(llm.engine.vocab_size, [12], seed=11)[0]
    out = generate(llm, [prompt], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3
    assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 1)


def test_stream_carries_prompt_logprobs(qwen3_tiny, hf_logprobs):
    llm = engine(qwen3_tiny)
    prompt = random_prompts(llm.engine.vocab_size, [10], seed=12)[0]
    outs = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)))
    assert len(outs) > 1
    for out in outs:
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_cross_the_engine_core_wire():
    params = SamplingParams(prompt_logprobs=3)
    assert params_from_wire(params_to_wire(params)).prompt_logprobs == 3
    from nanovllm.outputs import prompt_logprob_entry

    entries = [None, prompt_logprob_entry(7, -2.5, 9, [(3, -0.5), (4, -1.0)])]
    back = prompt_logprobs_from_wire(prompt_logprobs_to_wire(entries))
    assert back == entries
    assert [(t, lp.rank) for t, lp in back[1].items()] == [(7, 9), (3, 1), (4, 2)]


@pytest.mark.parametrize("bound", ["slice", "max_num_seqs"])
def test_scored_in_slices_of_positions(qwen3_tiny, hf_logprobs, monkeypatch, bound):
    """A prompt longer than a slice of positions (PROMPT_LOGPROB_ROWS, at most max_num_seqs) is
    scored a slice at a time, the slices in order."""
    from nanovllm.runner import model_runner

    if bound == "slice":
        monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 5)
    llm = engine(qwen3_tiny, **({"max_num_seqs": 3} if bound == "max_num_seqs" else {}))
    prompts = random_prompts(llm.engine.vocab_size, [23, 12], seed=13)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    for out, prompt in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(prompt), 2)


def test_tensor_parallel(qwen3_tiny, hf_logprobs):
    """TP=2 (gloo): every rank runs the LM head over the scored positions, rank 0 scores them."""
    llm = engine(qwen3_tiny, tensor_parallel_size=2, max_num_batched_tokens=16, kvcache_block_size=4)
    try:
        prompts = random_prompts(llm.engine.vocab_size, [40, 6], seed=14)
        outs = generate(llm, prompts, [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3),
                                       SamplingParams(temperature=0, max_tokens=3)])
        assert_matches(outs[0].prompt_logprobs, prompts[0], hf_logprobs(prompts[0]), 3)
        assert outs[1].prompt_logprobs is None
    finally:
        llm.shutdown()
