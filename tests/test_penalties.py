"""Logit bias and presence / frequency / repetition penalties: exact against a plain loop over
tokens, statistically (100k draws, chi-square) against the filtered softmax of a reference
pipeline, the per-sequence token counts of the runner, and validation."""
from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.runner.penalty_state import PenaltyState
from nanovllm.sampling_params import SamplingParams
from nanovllm.step import ScheduledSeq


# ---- the plain reference ---------------------------------------------------------------------
def ref_edit(logits, p: SamplingParams, prompt, output) -> np.ndarray:
    """vLLM's definitions, one token at a time, in float64."""
    x = np.array(logits, dtype=np.float64)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = Counter(output)
    seen = set(prompt) | set(output)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


def ref_probs(logits, p: SamplingParams, prompt=(), output=()) -> np.ndarray:
    """The distribution a sampled row draws from: edit, / temperature, top-k, top-p, min-p."""
    x = ref_edit(logits, p, prompt, output) / p.temperature
    v = len(x)
    order = sorted(range(v), key=lambda t: (-x[t], t))  # descending, ties to the lower id
    keep = set(order[: p.top_k] if p.top_k != -1 else order)
    kept = [t for t in order if t in keep]
    z = sum(math.exp(x[t]) for t in kept)
    mass = 0.0
    nucleus = []
    for t in kept:
        q = math.exp(x[t]) / z
        if mass >= p.top_p and p.top_p < 1.0:
            break
        assert abs(mass - p.top_p) > 1e-4 or p.top_p == 1.0, "top_p sits on a boundary: pick other logits"
        nucleus.append(t)
        mass += q
    probs = np.zeros(v)
    for t in nucleus:
        probs[t] = math.exp(x[t])
    probs /= probs.sum()
    probs[probs < p.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def token_stats(prompt, output, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)
    seen = np.zeros(vocab, dtype=bool)
    seen[list(prompt) + list(output)] = True
    return torch.from_numpy(counts).to(torch.int32), torch.from_numpy(seen)


# ---- exact -----------------------------------------------------------------------------------
def random_case(rng: random.Random, vocab: int) -> tuple[SamplingParams, list[int], list[int]]:
    kind = rng.randrange(5)
    kw = {}
    if kind in (1, 4):
        kw.update(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2))
    if kind in (2, 4):
        kw.update(repetition_penalty=rng.choice([0.5, 1.3, 2.0, 7.5]))
    if kind in (3, 4) or rng.random() < 0.3:
        kw.update(logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))})
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    return SamplingParams(temperature=0.0, **kw), prompt, output


def test_edits_equal_the_reference_loop_in_a_mixed_batch():
    rng = random.Random(0)
    vocab, rows = 40, 24
    cases = [random_case(rng, vocab) for _ in range(rows)]
    assert any(not p.edits_logits for p, _, _ in cases) and sum(p.penalized for p, _, _ in cases) >= 5
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
    stats = [token_stats(pr, out, vocab) for p, pr, out in cases if p.penalized]
    counts = torch.stack([c for c, _ in stats])
    seen = torch.stack([s for _, s in stats])
    st = SamplingTensors.from_params([p for p, _, _ in cases], None, vocab, "cpu", token_stats=(counts, seen))
    edited = logits.clone()
    st.logit_bias.apply_(edited)
    st.penalties.apply_(edited)
    expected = np.stack([ref_edit(logits[i].numpy(), *cases[i]) for i in range(rows)])
    np.testing.assert_allclose(edited.numpy(), expected, rtol=1e-5, atol=1e-4)
    for i, (p, _, _) in enumerate(cases):  # rows without edits are untouched, bit for bit
        if not p.edits_logits:
            assert torch.equal(edited[i], logits[i])
    # Greedy rows pick the argmax of the edited logits; logprobs stay those of the raw logits.
    params = [SamplingParams(temperature=0.0, logprobs=0, presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                             logit_bias=p.logit_bias) for p, _, _ in cases]
    out = Sampler(fused=False)(logits, SamplingTensors.from_params(params, None, vocab, "cpu", token_stats=(counts, seen)))
    assert out.token_ids.tolist() == expected.argmax(axis=1).tolist()
    raw = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.sampled_logprobs, raw)


def test_penalized_rows_without_token_stats_are_refused():
    with pytest.raises(ValueError, match="token_stats"):
        SamplingTensors.from_params([SamplingParams(presence_penalty=1.0)], None, 8, "cpu")


def test_logit_bias_outside_the_logits_is_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingTensors.from_params([SamplingParams(logit_bias={8: 1.0})], None, 8, "cpu")


def test_fused_sampler_is_not_taken_by_rows_that_edit_logits():
    sampler = Sampler(fused=True)
    many = 2 * sampler.fast_path_min_rows
    plain = SamplingTensors.from_params([SamplingParams()] * many, None, 8, "cpu")
    biased = SamplingTensors.from_params([SamplingParams()] * (many - 1) + [SamplingParams(logit_bias={1: 5.0})],
                                         None, 8, "cpu")
    assert sampler.fast_path_ok(plain) and not sampler.fast_path_ok(biased)
    assert not SamplingParams(repetition_penalty=1.2).plain_temperature
    assert not SamplingParams(logit_bias={0: 1.0}).plain_temperature


# ---- statistics ------------------------------------------------------------------------------
def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile at the standard normal quantile z (3.719: p = 1e-4)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * n
    return float((((counts[support] - expected) ** 2) / expected).sum()), int(support.sum()) - 1


LOGITS = [2.0, 1.6, 1.1, 0.9, 0.5, 0.2, 0.0, -0.3, -0.7, -1.2, -2.0, 1.3]
PROMPT = [0, 3, 3, 9]
OUTPUT = [1, 1, 1, 4, 11, 10]
MODES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "combined": dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.5),
    "bias": dict(temperature=1.2, logit_bias={10: 3.0, 0: -1.5}),
    "everything": dict(temperature=0.8, top_k=7, top_p=0.95, min_p=0.02, presence_penalty=-0.4,
                       frequency_penalty=0.6, repetition_penalty=0.7, logit_bias={8: 2.5, 2: -100}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_100k_draws_match_the_reference_distribution(mode):
    n, vocab = 100_000, len(LOGITS)
    p = SamplingParams(**MODES[mode])
    probs = ref_probs(LOGITS, p, PROMPT, OUTPUT)
    torch.manual_seed(1234)
    logits = torch.tensor(LOGITS).expand(n, vocab)
    stats = None
    if p.penalized:
        counts, seen = token_stats(PROMPT, OUTPUT, vocab)
        stats = (counts.expand(n, vocab), seen.expand(n, vocab))
    st = SamplingTensors.from_params([p] * n, None, vocab, "cpu", token_stats=stats)
    tokens = Sampler(fused=False)(logits, st).token_ids.numpy()
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0, f"drew tokens the filters drop: {np.flatnonzero(counts * (probs == 0))}"
    stat, df = chi2(counts, probs, n)
    assert stat < chi2_critical(df), (stat, df, counts, probs * n)
    # The test can tell: the unedited, unfiltered softmax at temperature 1 is rejected.
    plain = ref_probs(LOGITS, SamplingParams())
    wrong, wrong_df = chi2(counts, plain, n)
    assert wrong > 10 * chi2_critical(wrong_df)


# ---- the runner's per-sequence counts --------------------------------------------------------
def scheduled(seq_id: int, params: SamplingParams, prompt=None) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [0], 0, [], True, params, None, None, penalty_prompt_ids=prompt)


def test_penalty_state_counts_what_was_sampled():
    vocab = 16
    state = PenaltyState(vocab, torch.device("cpu"))
    pen = SamplingParams(presence_penalty=1.0)
    plain = SamplingParams()
    prompts = {i: [i, i + 1, 2] for i in range(6)}
    outputs: dict[int, list[int]] = {i: [] for i in range(6)}
    rng = random.Random(3)
    # Six penalized sequences (the pool grows past its first 4 rows) and a plain one, over 5 steps.
    for step in range(5):
        rows = [scheduled(i, pen, prompts[i] if step == 0 else None) for i in range(6)] + [scheduled(99, plain)]
        slots, counts, seen = state.gather(rows)
        for j, i in enumerate(range(6)):
            c, s = token_stats(prompts[i], outputs[i], vocab)
            assert torch.equal(counts[j], c) and torch.equal(seen[j], s), (step, i)
        sampled = [rng.randrange(vocab) for _ in range(6)]
        state.record(slots, torch.tensor(sampled))
        for i, t in zip(range(6), sampled):
            outputs[i].append(t)
    # A finished sequence's row is reused, and starts from the new prompt only.
    state.release([2])
    _, counts, seen = state.gather([scheduled(7, pen, [5])])
    assert counts.sum() == 0 and seen[0].nonzero().flatten().tolist() == [5]
    assert 7 in state.slots and 2 not in state.slots
    with pytest.raises(RuntimeError, match="first sampling step"):
        state.gather([scheduled(123, pen)])


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
])
def test_bad_penalties_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_good_penalties_are_kept():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, logit_bias={3: -100, 4: 100})
    assert p.logit_bias == {3: -100.0, 4: 100.0} and p.penalized and p.edits_logits
    assert not SamplingParams(logit_bias={}).edits_logits
    assert SamplingParams(logit_bias={1: 0.5}).edits_logits and not SamplingParams(logit_bias={1: 0.5}).penalized


# ---- scheduling --------------------------------------------------------------------------------
def test_the_prompt_goes_down_with_the_first_sampling_step_only():
    """Chunked prefill: the chunks before the last sample nothing; the last carries the prompt;
    decodes and the recompute after a preemption carry nothing (the runner kept the counts)."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence

    bm = BlockManager(64, 4, False)
    sched = Scheduler(bm, 4, 5)
    prompt = list(range(1, 12))
    seq = Sequence(0, "0", prompt, SamplingParams(repetition_penalty=1.3))
    plain = Sequence(1, "1", [1, 2], SamplingParams())
    sched.add(seq)
    sched.add(plain)
    carried = []
    for step in range(12):
        if step == 5:
            sched.running.remove(seq)
            sched._preempt(seq)
        out = sched.schedule()
        carried += [(step, s.seq_id, s.sample, s.penalty_prompt_ids) for s in out.seqs]
        seqs = {0: seq, 1: plain}
        sched.advance(out, seqs)
        sched.resolve(out, seqs, [50 + step] * sum(s.sample for s in out.seqs))
    with_prompt = [c for c in carried if c[3] is not None]
    assert len(with_prompt) == 1 and with_prompt[0][1:] == (0, True, prompt)
    assert any(c[1] == 0 and c[0] > 5 and c[2] for c in carried)  # it sampled again after the preemption
    assert seq.num_preemptions == 1


def faked_fast_path(has_filtered: bool):
    """A FastPath with its graphs faked as captured (taking a step would need them for real)."""
    from types import SimpleNamespace

    from nanovllm.fastpath.penalties import LonePenalties
    from nanovllm.fastpath.seam import FastPath

    fast = object.__new__(FastPath)
    fast._pending = fast._dry_pass = None
    fast.graphs = SimpleNamespace(has_single=True, has_filtered=has_filtered)
    fast.runner = SimpleNamespace(penalty_state=PenaltyState(8, torch.device("cpu")))
    fast.penalties = LonePenalties(8, torch.device("cpu"))
    fast.penalties_match = True
    return fast


EDITS = [dict(presence_penalty=1.0), dict(frequency_penalty=-1.0), dict(repetition_penalty=1.1), dict(logit_bias={3: -100})]


@pytest.mark.parametrize("kw", EDITS)
def test_the_fast_path_leaves_logit_edits_to_the_runner_without_its_filtered_graphs(kw):
    """The lone-sequence fast path (CUDA) applies penalties and biases in its filtered graphs
    only: where they are not captured, such a step is the runner's."""
    from nanovllm.step import SchedulerOutput

    fast = faked_fast_path(has_filtered=False)
    step = ScheduledSeq(0, [1], 3, [0], True, SamplingParams(temperature=0, **kw), None, None)
    assert fast.take(SchedulerOutput([step], 1, 1)) is None


@pytest.mark.parametrize("kw", EDITS)
def test_the_filtered_graphs_take_logit_edits_but_not_grammars_logprobs_or_bans(kw):
    """With its filtered graphs, the fast path takes a penalized or biased lone step (greedy or
    sampled), but not one with a grammar, logprobs or banned ids."""
    from nanovllm.sampling_params import StructuredOutputsParams
    from nanovllm.step import SchedulerOutput

    fast = faked_fast_path(has_filtered=True)

    def step(banned=None, **more):
        return ScheduledSeq(0, [1], 3, [0], True, SamplingParams(**kw, **more), None, banned)

    for temperature in (0, 0.6):
        assert fast._graph_filters(step(temperature=temperature))
        assert not fast._graph_picks_token(step(temperature=temperature))
        assert not fast._graph_filters(step(temperature=temperature, logprobs=1))
        assert not fast._graph_filters(step(banned=[2], temperature=temperature))
    grammar = step(temperature=0, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert not fast._graph_filters(grammar)
    assert fast.take(SchedulerOutput([grammar], 1, 1)) is None
    fast.penalties_match = False  # the runner counts tokens over another vocabulary
    assert fast._graph_filters(step(temperature=0)) == ("logit_bias" in kw)
