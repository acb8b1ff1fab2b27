"""Penalties and logit biases end to end on a tiny checkpoint: greedy output equals a plain
reference loop (transformers' logits, the penalties applied token by token), alone, batched
with plain requests, under chunked prefill, preemption, async scheduling and decode bursts."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams

N = 16


def engine(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 512)
    return LLM(str(path), **kw)


def reference_greedy(model, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding with vLLM's penalty definitions, one token at a time in plain Python."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            for t, b in (p.logit_bias or {}).items():
                logits[t] += b
            counts = Counter(out)
            seen = set(prompt) | set(out)
            for t in range(len(logits)):
                if t in seen:
                    logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
                logits[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
            nxt = max(range(len(logits)), key=lambda t: (logits[t], -t))
            out.append(nxt)
            ids.append(nxt)
    return out


PENALIZED = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7, presence_penalty=-0.3, logit_bias={7: 0.2, 9: -0.5}),
    dict(),  # plain greedy, batched with the others
]


@pytest.fixture(scope="module")
def case(qwen3_tiny):
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (9, 23, 14, 30)]
    # A prompt that repeats, so that the repetition penalty has prompt tokens to act on.
    prompts[0] = prompts[0][:3] * 3
    params = [SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw) for kw in PENALIZED]
    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.float32).eval()
    expected = [reference_greedy(model, pr, p, N) for pr, p in zip(prompts, params)]
    plain = [reference_greedy(model, pr, params[-1], N) for pr in prompts]
    # The penalties change every penalized output: a test that ignored them would fail.
    assert all(e != q for e, q in zip(expected[:3], plain[:3]))
    return prompts, params, expected


@pytest.mark.parametrize("extra", [
    dict(),
    dict(max_num_batched_tokens=7, enable_prefix_caching=False),
    dict(kvcache_block_size=4, num_kvcache_blocks=24, max_num_batched_tokens=16),
    dict(async_scheduling=True, kvcache_block_size=4, num_kvcache_blocks=24, max_num_batched_tokens=16),
    dict(max_num_seqs=1),
    dict(max_num_seqs=1, decode_burst=4),  # lone streams decode in bursts, penalized ones too
    dict(max_num_seqs=1, decode_burst=4, async_scheduling=True),
], ids=["batched", "chunked", "preempted", "async-preempted", "one-at-a-time", "bursts", "async-bursts"])
def test_penalized_greedy_equals_the_reference(qwen3_tiny, case, extra):
    prompts, params, expected = case
    llm = engine(qwen3_tiny, **extra)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "num_kvcache_blocks" in extra:
        assert llm.engine.scheduler.num_preemptions > 0
    runner = llm.engine.executor.runner
    assert not runner.penalty_state.slots or llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not runner.penalty_state.slots  # finished sequences give their rows back


def test_penalties_in_a_batch_with_sampled_rows(qwen3_tiny, case):
    """Seeded sampled rows next to penalized ones get the tokens they get alone."""
    prompts, params, expected = case
    llm = engine(qwen3_tiny)
    seeded = SamplingParams(temperature=0.9, top_k=40, max_tokens=N, ignore_eos=True, seed=11)
    seeded_pen = SamplingParams(temperature=0.9, max_tokens=N, ignore_eos=True, seed=12, repetition_penalty=1.3)
    alone = [llm.generate([prompts[1]], p, use_tqdm=False)[0].outputs[0].token_ids for p in (seeded, seeded_pen)]
    outs = llm.generate(prompts + [prompts[1], prompts[1]], params + [seeded, seeded_pen], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected + alone


def test_huge_logit_bias_forces_or_bans_a_token(qwen3_tiny):
    llm = engine(qwen3_tiny)
    forced = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={42: 100})
    assert llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 8
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    banned = {t: -100.0 for t in set(plain)}
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=banned),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert not set(out) & set(plain)


def test_big_penalties_stop_repeats(qwen3_tiny):
    llm = engine(qwen3_tiny)
    prompt = [11, 12, 13, 14]
    n = 40
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert len(set(plain[0].outputs[0].token_ids)) < n  # the tiny model repeats itself
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=2.0,
                                                repetition_penalty=50.0), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(out)) == n and not set(out) & set(prompt)


def test_logit_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(qwen3_tiny):
    llm = engine(qwen3_tiny)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={384: 1.0}), use_tqdm=False)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
