"""vLLM's allowed_token_ids and bad_words end to end on a tiny checkpoint: greedy output equals a
plain reference loop (transformers' logits, masked token by token), alone, batched with plain
requests, under async scheduling, decode bursts and preemption; the fields are checked; logprobs
stay those of the raw logits; a request with either field never takes a path that samples
without them (decode bursts, the fast path's graphs, the runner's greedy shortcut)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.step import ScheduledSeq

N = 16
PROMPT = [11, 12, 13, 14]

CONFIGS = [
    dict(),
    dict(async_scheduling=True),
    dict(max_num_seqs=1, decode_burst=4),
    dict(max_num_seqs=1, decode_burst=4, async_scheduling=True),
    dict(async_scheduling=True, kvcache_block_size=4, num_kvcache_blocks=8, max_num_batched_tokens=16),
]
CONFIG_IDS = ["sync", "async", "bursts", "async-bursts", "async-preempted"]


def engine(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 512)
    return LLM(str(path), **kw)


def greedy(n: int = N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def token_ids(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def reference_greedy(model, prompt: list[int], n: int, allowed: list[int] | None = None,
                     bad: list[list[int]] = ()) -> list[int]:
    """Greedy decoding under vLLM's rules, one token at a time in plain Python: only `allowed`
    tokens, and no token that would complete a bad word (its other tokens ending the output)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            banned = {w[-1] for w in bad if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}
            candidates = [t for t in (allowed or range(len(logits))) if t not in banned]
            nxt = max(candidates, key=lambda t: (logits[t], -t))
            out.append(nxt)
            ids.append(nxt)
    return out


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.fixture(scope="module")
def hf_model(qwen3_tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain(hf_model):
    return reference_greedy(hf_model, PROMPT, N)


@pytest.fixture(scope="module")
def bad_words(qwen3_tiny, plain):
    """Two bad words built from the plain greedy output: a two-token one whose tokens (as the
    engine tokenizes it) the output holds, and a one-token one it holds, not its first token
    (so that the first ban comes mid-output)."""
    llm = engine(qwen3_tiny)
    tok = llm.tokenizer

    def word_of(tokens: list[int]) -> str | None:
        text = tok.decode(tokens)
        if text.strip() and any(seq == tokens for seq in llm.engine.bad_words_token_ids([text])):
            return text
        return None

    two = next(w for i in range(len(plain) - 1) if (w := word_of(plain[i : i + 2])) is not None)
    one = next(w for t in plain[1:] if t != plain[0] and (w := word_of([t])) is not None)
    return two, one


@pytest.mark.parametrize("extra", CONFIGS, ids=CONFIG_IDS)
def test_greedy_samples_only_allowed_tokens(qwen3_tiny, hf_model, plain, extra):
    """Allowed ids that plain greedy never picks: the output is the reference's masked argmax, and
    a plain request beside it keeps its own output."""
    allowed = [t for t in range(3, 384) if t not in plain][:3]
    expected = reference_greedy(hf_model, PROMPT, N, allowed=allowed)
    assert set(expected) <= set(allowed)
    llm = engine(qwen3_tiny, **extra)
    assert token_ids(llm, [PROMPT], greedy(allowed_token_ids=allowed)) == [expected]
    assert token_ids(llm, [PROMPT, PROMPT], [greedy(allowed_token_ids=allowed), greedy()]) == [expected, plain]
    if "num_kvcache_blocks" in extra:
        assert llm.engine.scheduler.num_preemptions > 0


def test_sampled_rows_draw_only_allowed_tokens(qwen3_tiny):
    llm = engine(qwen3_tiny)
    allowed = [5, 77, 300]
    params = [SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed, seed=s, **kw)
              for s, kw in enumerate([dict(), dict(top_k=2), dict(top_p=0.5), dict(logit_bias={77: -100})])]
    outs = token_ids(llm, [PROMPT] * len(params), params)
    assert all(set(out) <= set(allowed) for out in outs)
    assert 77 not in outs[-1]
    assert token_ids(llm, [PROMPT], SamplingParams(temperature=1.0, max_tokens=4, allowed_token_ids=[42])) == [[42] * 4]


def test_logprobs_stay_those_of_the_raw_logits(qwen3_tiny):
    """The bans come after the logprobs (vLLM's raw logprobs): fewer allowed ids than logprobs
    asked for still give the raw top k, all finite."""
    llm = engine(qwen3_tiny)
    plain = llm.generate([PROMPT], greedy(1, logprobs=5), use_tqdm=False)[0].outputs[0]
    allowed = [t for t in range(3, 384) if t not in plain.logprobs[0]][:2]
    out = llm.generate([PROMPT], greedy(1, logprobs=5, allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] in allowed
    top = {t: lp for t, lp in out.logprobs[0].items() if t != out.token_ids[0]}
    assert top == {t: pytest.approx(lp) for t, lp in plain.logprobs[0].items()}


@pytest.mark.parametrize("extra", CONFIGS, ids=CONFIG_IDS)
def test_bad_words_never_appear_in_the_output(qwen3_tiny, hf_model, plain, bad_words, extra):
    """Plain greedy holds both words' tokens; with bad_words it holds neither, and equals the
    reference loop under vLLM's rule (only generated tokens count)."""
    llm = engine(qwen3_tiny, **extra)
    for word in bad_words:
        assert any(contains(plain, seq) for seq in llm.engine.bad_words_token_ids([word])), word
    chosen = [[bad_words[0]], [bad_words[1]], list(bad_words)]
    sequences = [llm.engine.bad_words_token_ids(words) for words in chosen]
    expected = [reference_greedy(hf_model, PROMPT, N, bad=seqs) for seqs in sequences]
    outs = token_ids(llm, [PROMPT] * 4, [greedy(bad_words=words) for words in chosen] + [greedy()])
    assert outs == expected + [plain]
    assert not any(contains(out, seq) for out, seqs in zip(outs, sequences) for seq in seqs)
    if "num_kvcache_blocks" in extra:
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_bad_word_begun_in_the_prompt_is_not_banned(qwen3_tiny, hf_model, bad_words):
    """Only generated tokens count: a prompt that ends with a bad word's first token does not
    ban its last one at the first step (allowed there beside a token the model likes less)."""
    llm = engine(qwen3_tiny)
    word = llm.engine.bad_words_token_ids([bad_words[0]])[0]
    prompt = PROMPT + word[:-1]
    with torch.no_grad():
        worse = int(hf_model(torch.tensor([prompt])).logits[0, -1].argmin())
    params = greedy(1, bad_words=[bad_words[0]], allowed_token_ids=[word[-1], worse])
    assert token_ids(llm, [prompt], params) == [[word[-1]]]


def test_bad_words_are_tokenized_as_vllm_does(qwen3_tiny):
    """Each word with its leading spaces stripped, and after a space where that starts with
    another token and has as many; no special tokens."""
    llm = engine(qwen3_tiny)
    tok = llm.tokenizer

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    for word in ("fox", "  capital", "Paris is", "<|im_end|>"):
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        expected = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert llm.engine.bad_words_token_ids([word]) == expected, word


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_structured_output_and_allowed_token_ids_both_apply(qwen3_tiny, async_scheduling):
    """A choice the model does not pick, made the only one its allowed ids spell: the output is
    it (async: a greedy row samples under its bans without its grammar mask, which checks its
    token after)."""
    llm = engine(qwen3_tiny, async_scheduling=async_scheduling)
    choices = ["Paris", "Berlin"]
    grammar = StructuredOutputsParams(choice=choices)
    picked = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar),
                          use_tqdm=False)[0].outputs[0].text
    other = choices[1 - choices.index(picked)]
    allowed = llm.tokenizer.encode(other, add_special_tokens=False) + llm.engine.eos_token_ids
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=8, structured_outputs=grammar,
                                allowed_token_ids=allowed, seed=3)
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text == other


@pytest.mark.parametrize("kw, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"),
    (dict(allowed_token_ids=["5"]), "allowed_token_ids"),
    (dict(bad_words="fox"), "bad_words"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=[1]), "bad_words"),
])
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kw)


def test_values_are_normalized():
    p = SamplingParams(allowed_token_ids=(3, 4, 3, 3), bad_words=("a",))
    assert (p.allowed_token_ids, p.bad_words) == ([3, 4], ["a"])
    assert SamplingParams(bad_words=[]).bad_words is None
    assert SamplingParams(bad_words=[]).restricts_tokens is False
    assert SamplingParams(allowed_token_ids=[1]).restricts_tokens and SamplingParams(bad_words=["a"]).restricts_tokens


def test_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(qwen3_tiny):
    llm = engine(qwen3_tiny)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[5, 384]), use_tqdm=False)
    assert not llm.engine.requests
    assert token_ids(llm, [[1, 2]], greedy(2, allowed_token_ids=[383])) == [[383, 383]]


def test_no_decode_burst_for_either_field():
    """A lone decode with allowed_token_ids or bad_words is an ordinary step: a burst's later
    steps would sample without their bans."""
    for kw in (dict(), dict(allowed_token_ids=[3]), dict(bad_words=["a"])):
        bm = BlockManager(64, 4, True)
        sched = Scheduler(bm, 4, 64)
        seq = Sequence(0, "0", [1, 2, 3], greedy(**kw), max_tokens=50)
        sched.add(seq)
        out = sched.schedule(4)
        sched.advance(out, {0: seq})
        sched.resolve(out, {0: seq}, [9])
        assert sched.schedule(4).seqs[0].num_steps == (1 if kw else 4), kw


def test_bans_follow_the_generated_tokens():
    """A one-token word is always banned; a longer one's last token only where the output (not
    the prompt) ends with the rest."""
    seq = Sequence(0, "0", [7, 8], greedy(bad_words=["x"]), bad_words_token_ids=[[5], [8, 9], [3, 4, 6]])
    assert Scheduler._banned_ids(seq) == [5]
    seq.append_token(8)
    assert Scheduler._banned_ids(seq) == [5, 9]
    seq.append_token(3)
    seq.append_token(4)
    assert Scheduler._banned_ids(seq) == [5, 6]
    seq.params = greedy(bad_words=["x"], min_tokens=9)
    seq.min_tokens_banned_ids = [2]
    assert Scheduler._banned_ids(seq) == [2, 5, 6]


def test_the_fast_path_leaves_either_field_to_the_runner():
    """The persistent kernel's graphs pick greedy and plain-temperature tokens, and its filtered
    graphs sample with logit edits: neither applies allowed ids or bad words."""
    from types import SimpleNamespace

    from test_penalties import faked_fast_path

    fast = faked_fast_path(has_filtered=True)
    fast.decoder = SimpleNamespace(fused_head=True)

    def step(**kw):
        return ScheduledSeq(0, [1], 3, [0], True, SamplingParams(**kw), None, None)

    for restrict in (dict(allowed_token_ids=[3]), dict(bad_words=["a"])):
        for kw in (dict(temperature=0), dict(temperature=0.7), dict(temperature=0.7, top_k=3),
                   dict(temperature=0, logit_bias={3: 1.0}), dict(temperature=0, presence_penalty=1.0)):
            assert fast._graph_picks_token(step(**kw)) or fast._graph_filters(step(**kw)), kw
            assert not fast._graph_picks_token(step(**kw, **restrict)), (kw, restrict)
            assert not fast._graph_filters(step(**kw, **restrict)), (kw, restrict)


@pytest.mark.parametrize("ban", ["bad-words", "min-tokens"])
def test_allowed_ids_that_the_bans_leave_none_of_are_refused(qwen3_tiny, ban):
    """Every allowed id banned (a bad word of one token; a stop token within min_tokens): the
    request is refused naming allowed_token_ids, not run on logits that are all -inf."""
    llm = engine(qwen3_tiny)
    if ban == "bad-words":  # a token whose text is a bad word of that one token
        token, word = next((t, text) for t in range(3, 384) if (text := llm.tokenizer.decode([t])).strip()
                           and llm.engine.bad_words_token_ids([text])[0] == [t])
        kw = dict(bad_words=[word])
    else:
        token, kw = 7, dict(stop_token_ids=[7], min_tokens=2)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([PROMPT], greedy(4, allowed_token_ids=[token], **kw), use_tqdm=False)
    assert not llm.engine.requests
    assert token_ids(llm, [PROMPT], greedy(2, allowed_token_ids=[token, 383], **kw)) == [[383, 383]]


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[4]], ids=["sync", "async", "async-preempted"])
def test_bad_words_that_come_to_ban_every_allowed_id_end_the_sample_in_error(qwen3_tiny, config):
    """Two allowed ids and every two-token bad word of them: after the first token, the bans
    cover both. The sample ends there with finish_reason "error" (the server's 400 naming
    allowed_token_ids), instead of sampling from logits that are all -inf (a token outside
    allowed_token_ids), and its blocks are freed."""
    llm = engine(qwen3_tiny, **config)
    allowed = [40, 41]
    texts = [llm.tokenizer.decode([t]) for t in allowed]
    words = [a + b for a in texts for b in texts]
    assert sorted(map(tuple, llm.engine.bad_words_token_ids(words))) == [(a, b) for a in allowed for b in allowed]
    plain = token_ids(llm, [PROMPT], greedy(6, allowed_token_ids=allowed))[0]
    assert len(plain) == 6 and set(plain) <= set(allowed)
    out = llm.generate([PROMPT, PROMPT], [greedy(6, allowed_token_ids=allowed, bad_words=words),
                                          greedy(6, allowed_token_ids=allowed)], use_tqdm=False)
    banned, other = out[0].outputs[0], out[1].outputs[0]
    assert banned.finish_reason == "error" and banned.token_ids == plain[:1]
    assert other.finish_reason == "length" and other.token_ids == plain
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_with_no_allowed_token_ends_in_error(qwen3_tiny, async_scheduling):
    """A grammar none of whose tokens are allowed: the sample ends with finish_reason "error"
    (the server's 400), not "abort" (which the server reports as its own shutdown), and its
    blocks are freed."""
    llm = engine(qwen3_tiny, async_scheduling=async_scheduling)
    grammar = StructuredOutputsParams(choice=["Paris", "Berlin"])
    spelled = set(llm.tokenizer.encode("Paris", add_special_tokens=False) + llm.tokenizer.encode(
        "Berlin", add_special_tokens=False))
    allowed = [t for t in range(3, 40) if t not in spelled][:2]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar,
                                                allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
