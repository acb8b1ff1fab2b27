"""Sampler tests: greedy, distributions under temperature and filters, seeds, logprobs.

Statistical checks use many rows of one small vocabulary in a single batch (cheap on CPU) and
a max-abs-deviation bound several standard deviations wide: a correct sampler passes with
overwhelming probability, and each test also checks that a plausible wrong answer (e.g. ignoring
temperature) is far outside the bound. Reference distributions are computed in plain Python.
"""
from __future__ import annotations

import math

import pytest
import torch

from nanovllm.layers.sampler import (
    Sampler,
    SamplingTensors,
    TOP_CANDIDATES,
    _apply_top_k_top_p,
    _apply_top_k_top_p_among_candidates,
    _exponential_race,
    _inverse_cdf_draw,
    make_generator,
)
from nanovllm.sampling_params import SamplingParams

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA])]

# Distinct logits, so top-k / top-p boundaries are unambiguous; deliberately not sorted and the
# maximum not at index 0 (a sampler that collapses a row to token 0 must not pass by accident).
LOGITS8 = [0.3, -0.9, 2.0, 1.1, -1.6, 1.5, -0.2, 0.6]
TOP = 2  # argmax of LOGITS8


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


def run(logits: torch.Tensor, params: list[SamplingParams], generators=None):
    st = SamplingTensors.from_params(params, generators, logits.shape[1], logits.device)
    return Sampler()(logits, st)


def ref_probs(logits: list[float], sp: SamplingParams) -> list[float]:
    """softmax(logits / T), then top-k, top-p, min-p, each renormalised; independent of the sampler."""
    m = max(logits)
    w = [math.exp((x - m) / sp.temperature) for x in logits]
    p = [v / sum(w) for v in w]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order if sp.top_k == -1 else order[: sp.top_k])
    mass = sum(p[i] for i in keep)
    cum, kept = 0.0, set()
    for i in order:
        if i in keep and cum < sp.top_p:
            kept.add(i)
            cum += p[i] / mass
    keep = kept
    top = max(p[i] for i in keep)
    keep = {i for i in keep if p[i] >= sp.min_p * top}
    mass = sum(p[i] for i in keep)
    return [p[i] / mass if i in keep else 0.0 for i in range(len(p))]


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    return (counts / counts.sum()).tolist()


def max_dev(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(64, 1000, device=device)
    logits[3, 10] = logits[3, 500] = logits[3].max() + 1.0  # tie: the first index wins
    out = run(logits, [SamplingParams(temperature=0.0)] * 64)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3].item() == 10
    assert out.sampled_logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_greedy_argmax_takes_the_first_maximum_and_a_nan_as_torch_does():
    """The CPU's greedy argmax (numpy's) against torch.argmax: ties, NaN, all -inf, bf16."""
    from nanovllm.layers.sampler import greedy_argmax

    inf, nan = float("inf"), float("nan")
    logits = torch.randn(6, 49152)
    logits[0, 7] = logits[0, 40000] = 1e4
    logits[1, 3] = logits[1, 9] = nan
    logits[2] = -inf
    logits[3, 12] = inf
    logits[4, -1] = 1e4
    for x in (logits, logits.bfloat16(), logits[:, ::2]):
        got = greedy_argmax(x)
        assert got.dtype == torch.int64 and got.tolist() == x.argmax(dim=-1).tolist()
    assert greedy_argmax(logits)[:5].tolist() == [7, 3, 0, 12, 49151]


def test_tiny_temperature_is_greedy():
    # One rule for the sampler and for the runner's lone-sequence graph (its in-graph argmax).
    assert SamplingParams(temperature=1e-7).greedy and not SamplingParams(temperature=1e-4).greedy
    st = SamplingTensors.from_params([SamplingParams(temperature=1e-7)], None, 10, "cpu")
    assert st.all_greedy and st.temperature is None  # greedy rows need no controls on the device
    logits = torch.randn(1, 10) * 100
    assert Sampler()(logits, st).token_ids.item() == logits.argmax().item()


def test_mixed_greedy_and_sampled_rows():
    vocab, reps = 8, 2000
    base = torch.tensor(LOGITS8)
    # Greedy rows carry filters too: they must be ignored (and must not trigger the sort path).
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=5)
    hot = SamplingParams(temperature=1.0)
    params = [greedy, hot] * reps
    logits = base.repeat(2 * reps, 1)
    gens = [make_generator(5, "cpu") if p.seed else None for p in params]
    st = SamplingTensors.from_params(params, gens, vocab, "cpu")
    assert not st.any_top_k and not st.any_top_p and not st.all_greedy and not st.all_random
    assert all(g is None for g in st.generators)  # greedy rows draw no noise
    tokens = Sampler()(logits, st).token_ids
    assert torch.all(tokens[0::2] == TOP)
    assert max_dev(frequencies(tokens[1::2], vocab), ref_probs(LOGITS8, hot)) < 0.05
    assert tokens[1::2].unique().numel() == vocab


# -------------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_softmax(temperature):
    vocab, n = 8, 200_000
    sp = SamplingParams(temperature=temperature)
    tokens = run(torch.tensor(LOGITS8).repeat(n, 1), [sp] * n).token_ids
    expected = ref_probs(LOGITS8, sp)
    bound = 6 * math.sqrt(0.25 / n)  # six standard deviations of the worst-case frequency
    assert max_dev(frequencies(tokens, vocab), expected) < bound
    # A sampler ignoring temperature would be far outside the bound.
    assert max_dev(expected, ref_probs(LOGITS8, SamplingParams(temperature=1.0))) > 10 * bound


def test_bf16_logits_sampled_distribution():
    vocab, n = 8, 100_000
    sp = SamplingParams(temperature=0.8, top_k=5)
    logits = torch.tensor(LOGITS8).repeat(n, 1).bfloat16()
    out = run(logits, [sp] * n)
    expected = ref_probs(logits[0].float().tolist(), sp)
    assert max_dev(frequencies(out.token_ids, vocab), expected) < 6 * math.sqrt(0.25 / n)


FILTERS = [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.62),
    SamplingParams(temperature=1.3, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.12),
    SamplingParams(temperature=1.0, top_p=1e-6),  # always at least one token
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1.0),  # unfiltered row in a batch that sorts
]


@pytest.mark.parametrize("device", DEVICES)
def test_filters_exclude_and_include_the_right_tokens(device):
    """All filter kinds in one batch, each row kind repeated; every row kind checked against an
    independent reference: excluded tokens never appear, each allowed token does, at the right rate."""
    vocab, reps = 8, 30_000
    params = [sp for sp in FILTERS for _ in range(reps)]
    logits = torch.tensor(LOGITS8, device=device).repeat(len(params), 1)
    tokens = run(logits, params).token_ids
    for j, sp in enumerate(FILTERS):
        expected = ref_probs(LOGITS8, sp)
        allowed = {i for i, p in enumerate(expected) if p > 0}
        freq = frequencies(tokens[j * reps : (j + 1) * reps], vocab)
        emitted = {i for i, f in enumerate(freq) if f > 0}
        assert emitted == allowed, (sp, expected, freq)
        assert max_dev(freq, expected) < 6 * math.sqrt(0.25 / reps), (sp, expected, freq)


def test_reference_filter_sets():
    """Pins the reference itself, so the filter test is not checking the sampler against a copy of it."""

    def allowed(sp):
        return {i for i, p in enumerate(ref_probs(LOGITS8, sp)) if p > 0}

    assert allowed(FILTERS[0]) == {2, 5, 3}
    assert allowed(FILTERS[4]) == allowed(FILTERS[5]) == allowed(FILTERS[6]) == {TOP}
    assert allowed(FILTERS[7]) == set(range(8))
    # top-p: the smallest prefix whose mass reaches top_p.
    p = sorted(ref_probs(LOGITS8, SamplingParams(temperature=0.7)), reverse=True)
    k = len(allowed(FILTERS[1]))
    assert 1 < k < 8 and sum(p[:k]) >= 0.62 > sum(p[: k - 1])
    # min-p: prob >= min_p * max prob.
    p = ref_probs(LOGITS8, SamplingParams(temperature=1.3))
    assert 1 < len(allowed(FILTERS[2])) < 8
    assert allowed(FILTERS[2]) == {i for i in range(8) if p[i] >= 0.3 * max(p)}


CANDIDATE_ROWS = [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES // 2, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0),  # unfiltered: left as it is
    SamplingParams(temperature=0.0, top_p=0.5),  # greedy, filtered anyway (as the reference does)
]


def candidate_logits(rows: int, vocab: int = 4 * TOP_CANDIDATES, seed: int = 0) -> torch.Tensor:
    """Peaked rows (as a trained model's are): the top-p sets fit among the candidates."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 4


def test_top_k_top_p_among_candidates_equals_the_full_sort():
    params = CANDIDATE_ROWS * 3
    x = candidate_logits(len(params))
    x[0, 5], x[0, 9] = 30.0, 30.0  # a tie at the top: kept in token-id order
    x[1, 100:160] = 25.0  # 60 tied at the top of a top-40 row: the 40 lowest ids are kept
    st = SamplingTensors.from_params(params, None, x.shape[1], "cpu")
    among = _apply_top_k_top_p_among_candidates(x, st)
    assert among is not None
    assert torch.equal(among, _apply_top_k_top_p(x.clone(), st))
    assert torch.isfinite(among[1]).nonzero().flatten().tolist() == list(range(100, 140))
    assert torch.equal(among[5], x[5])  # the unfiltered row is untouched
    assert 1 < int(torch.isfinite(among[0]).sum()) < TOP_CANDIDATES  # top-p cut among the candidates


@pytest.mark.parametrize("case", ["flat top-p", "top-k beyond the candidates", "tie at the cut"])
def test_top_k_top_p_among_candidates_leaves_what_it_cannot_decide_to_the_reference(case):
    vocab = 4 * TOP_CANDIDATES
    x = candidate_logits(2, vocab)
    params = [SamplingParams(temperature=1.0, top_k=40)] * 2
    if case == "flat top-p":  # 0.9 of the mass needs most of the vocabulary
        x[1] = torch.linspace(0, 0.01, vocab)
        params = [params[0], SamplingParams(temperature=1.0, top_p=0.9)]
    elif case == "top-k beyond the candidates":
        params = [params[0], SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES + 1)]
    else:  # the 40th largest equals every entry from there past the candidates
        x[1] = torch.cat([torch.full((39,), 20.0), torch.full((vocab - 39,), 10.0)])
    st = SamplingTensors.from_params(params, None, vocab, "cpu")
    assert _apply_top_k_top_p_among_candidates(x, st) is None


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 5e-324 is valid but is 0 in float32: the top token must stay, on the reference
    path (8 tokens) and among the candidates (4,096) (on CUDA: tests/test_filtered_sampler.py)."""
    for logits in (torch.tensor(LOGITS8).repeat(3, 1), candidate_logits(3)):
        out = run(logits, [SamplingParams(temperature=1.0, top_p=5e-324)] * 3).token_ids
        assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_top_p_one_keeps_every_token():
    """A top_p = 1 row in a batch that applies top-p must keep its whole vocabulary, even tokens
    whose mass above (1.0 after fp32 rounding) reaches top_p. Too rare to see by sampling."""
    logits = torch.tensor([[0.0, -30.0, -31.0, 5.0], [0.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    st = SamplingTensors.from_params(params, None, 4, "cpu")
    out = _apply_top_k_top_p(logits.clone(), st)
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1]).tolist() == [True, True, True, False]  # 0.64 alone reaches 0.5


def test_seeded_rows_follow_the_distribution():
    """Seeded draws are the same draws: many independently seeded rows sample softmax(logits / T)."""
    vocab, n = 8, 20_000
    sp = SamplingParams(temperature=0.9, seed=0)
    gens = [make_generator(s, "cpu") for s in range(n)]
    tokens = run(torch.tensor(LOGITS8).repeat(n, 1), [sp] * n, gens).token_ids
    assert max_dev(frequencies(tokens, vocab), ref_probs(LOGITS8, sp)) < 6 * math.sqrt(0.25 / n)


@pytest.mark.parametrize("draw", [_exponential_race, _inverse_cdf_draw])
def test_both_draws_sample_categorical_p_and_never_a_zero(draw):
    """The exponential race (the reference, and CUDA's) and the inverse-CDF draw (the CPU's)
    both sample Categorical(p) from unnormalised p; a zero, first, last or between, is never drawn."""
    p = [0.0, 0.5, 0.0, 2.0, 1.0, 0.25, 0.0, 0.0]
    n = 100_000
    freq = frequencies(draw(torch.tensor(p).repeat(n, 1), [None] * n), len(p))
    expected = [x / sum(p) for x in p]
    assert max_dev(freq, expected) < 6 * math.sqrt(0.25 / n)
    assert [f for f, x in zip(freq, p) if x == 0] == [0.0] * 4
    # A row whose only token left is the first or the last, with a tiny mass, always gives it.
    for only in (0, 7):
        row = torch.zeros(1000, 8)
        row[:, only] = 1e-30
        assert draw(row, [None] * 1000).tolist() == [only] * 1000


def test_inverse_cdf_draw_of_a_seeded_row_ignores_its_batch():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    alone = [_inverse_cdf_draw(p, [make_generator(s, "cpu")]).item() for s in range(200)]
    in_batch = [_inverse_cdf_draw(torch.cat([torch.rand(2, 4), p]), [None, make_generator(99, "cpu"),
                                  make_generator(s, "cpu")])[2].item() for s in range(200)]
    assert alone == in_batch
    assert set(alone) == {0, 1, 2, 3}  # the seeds give different draws


# -------------------------------------------------------------------------------------- seeding


def _seeded_run(device, row_logits, seed, batch_size, position, others, steps=12):
    """Tokens of one seeded row over several steps, embedded at `position` in a batch of `others`."""
    gen = make_generator(seed, device)
    target = SamplingParams(temperature=0.8, seed=seed)
    tokens = []
    for step in range(steps):
        torch.manual_seed(1000 * batch_size + step)  # the global RNG must not matter
        params = [others[i % len(others)] for i in range(batch_size)]
        gens = [make_generator(99 + i, device) if params[i].seed is not None else None for i in range(batch_size)]
        params[position], gens[position] = target, gen
        logits = torch.randn(batch_size, row_logits.shape[0], device=device) * 3
        logits[position] = row_logits
        tokens.append(run(logits, params, gens).token_ids[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    vocab = 1000
    row = torch.randn(vocab, device=device)
    plain = [SamplingParams(temperature=1.0)]
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.7, seed=3),
        SamplingParams(temperature=1.2, min_p=0.1, logprobs=3),
    ]
    alone = _seeded_run(device, row, 7, 1, 0, plain)
    assert alone == _seeded_run(device, row, 7, 1, 0, plain)
    assert alone == _seeded_run(device, row, 7, 5, 3, plain)
    assert alone == _seeded_run(device, row, 7, 9, 6, mixed)  # sort path, other seeds, greedy rows
    assert alone == _seeded_run(device, row, 7, 17, 0, mixed)
    assert alone != _seeded_run(device, row, 8, 1, 0, plain)  # a different seed differs
    assert len(set(alone)) > 1  # the row really samples


def test_unseeded_rows_use_the_global_rng():
    logits = torch.randn(16, 1000)
    params = [SamplingParams(temperature=1.0)] * 16
    torch.manual_seed(0)
    a = run(logits, params).token_ids
    torch.manual_seed(0)
    b = run(logits, params).token_ids
    c = run(logits, params).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_make_generator_accepts_any_int_seed():
    for seed in (0, -1, 2**70 + 3):
        a = torch.rand(4, generator=make_generator(seed, "cpu"))
        assert torch.equal(a, torch.rand(4, generator=make_generator(seed, "cpu")))


# ------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(device, dtype):
    vocab = 300
    logits = (torch.randn(6, vocab, device=device) * 4).to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.6, top_k=4, logprobs=5),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=0),
        SamplingParams(temperature=0.3, seed=1, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    gens = [make_generator(1, device) if p.seed is not None else None for p in params]
    out = run(logits, params, gens)
    ref = torch.log_softmax(logits.float(), dim=-1)  # raw: no temperature, no filters
    assert out.sampled_logprobs.dtype == out.top_logprobs.dtype == torch.float32
    assert out.top_token_ids.shape == out.top_logprobs.shape == (6, 5)
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_token_ids))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])  # sorted, descending
    expected_ids = ref.argsort(dim=-1, descending=True, stable=True)[:, :5]
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, expected_ids))
    assert torch.equal(out.token_ids[[0, 5]], logits.float().argmax(dim=-1)[[0, 5]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logprobs", [None, 3])
def test_a_logit_bias_moves_the_token_not_the_logprobs_or_the_callers_logits(device, dtype, logprobs):
    """The bias edits a copy of the logits: the caller's tensor is unchanged, logprobs are
    those of the raw logits, and the greedy token is the biased argmax."""
    vocab = 300
    logits = (torch.randn(3, vocab, device=device) * 4).to(dtype)
    before = logits.clone()
    low = logits.float().argmin(dim=-1).tolist()  # each row's least likely token, lifted to the top
    params = [SamplingParams(temperature=0.0, logprobs=logprobs, logit_bias={low[r]: 100.0}) for r in range(3)]
    out = run(logits, params)
    assert out.token_ids.tolist() == low
    assert torch.equal(logits, before)
    if logprobs is None:
        assert out.sampled_logprobs is None
    else:
        ref = torch.log_softmax(logits.float(), dim=-1)
        torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))


def test_logprobs_zero_gives_sampled_only_and_k_is_capped():
    logits = torch.randn(2, 4)
    out = run(logits, [SamplingParams(logprobs=0), SamplingParams(temperature=0.0)])
    assert out.sampled_logprobs.shape == (2,) and out.top_token_ids is None and out.top_logprobs is None
    out = run(logits, [SamplingParams(logprobs=20), SamplingParams()])
    assert out.top_token_ids.shape == (2, 4)


# -------------------------------------------------------------------------------- construction


def test_from_params_tensors_and_flags():
    params = [
        SamplingParams(temperature=0.0, top_k=2),
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, min_p=0.05, logprobs=3),
    ]
    st = SamplingTensors.from_params(params, [None, None, None], 32, "cpu")
    assert st.temperature.dtype == st.top_p.dtype == st.min_p.dtype == torch.float32
    assert st.top_k is None  # only the greedy row asks for top-k; 50 > vocab means "off"
    assert st.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert st.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0]) and st.min_p.tolist() == pytest.approx([0.0, 0.0, 0.05])
    assert (st.all_greedy, st.all_random, st.any_top_k, st.any_top_p, st.any_min_p) == (False, False, False, True, True)
    assert st.max_num_logprobs == 3
    params[1] = SamplingParams(temperature=0.7, top_k=-1)
    params[2] = SamplingParams(temperature=1.0, top_k=5)
    st = SamplingTensors.from_params(params, None, 32, "cpu")
    assert st.top_k.dtype == torch.int64 and st.top_k.tolist() == [2, 32, 5]  # -1 means "off": the vocab size
    assert st.top_p is None and st.min_p is None and st.any_top_k
    st = SamplingTensors.from_params([SamplingParams()], None, 32, "cpu")
    assert st.all_random and not (st.any_top_k or st.any_top_p or st.any_min_p) and st.max_num_logprobs is None


def test_invalid_inputs_raise_value_error():
    with pytest.raises(ValueError, match="generators"):
        SamplingTensors.from_params([SamplingParams()] * 2, [None], 8, "cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingTensors.from_params([SamplingParams()], None, 0, "cpu")
    st = SamplingTensors.from_params([SamplingParams()] * 2, None, 8, "cpu")
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(3, 8), st)


def test_empty_batch():
    out = run(torch.randn(0, 8), [])
    assert out.token_ids.shape == (0,)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_cuda_sampling_does_not_sync():
    vocab = 4096
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=4),
        SamplingParams(temperature=1.0),
    ]
    gens = [make_generator(4, "cuda") if p.seed is not None else None for p in params]
    logits = torch.randn(3, vocab, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = SamplingTensors.from_params(params, gens, vocab, "cuda")
        out = Sampler()(logits, st)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.is_cuda and out.top_token_ids.shape == (3, 3)


def test_plain_temperature_is_sampling_with_nothing_else():
    """The rows the persistent kernel's LM head may sample (a lone stream's decode bursts)."""
    assert SamplingParams(temperature=0.7).plain_temperature
    assert not SamplingParams(temperature=0).plain_temperature  # greedy
    assert SamplingParams(temperature=0.7, seed=3).plain_temperature  # a seed keys the noise
    for kw in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(presence_penalty=0.5), dict(logit_bias={1: 2.0})):
        assert not SamplingParams(temperature=0.7, **kw).plain_temperature, kw
