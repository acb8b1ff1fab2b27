"""A top-k stream's logits from the int8 head's bounds (fastpath/head_refine.py): after the
refine launch the buffer holds the exact logits of every row a top-k sample can keep and only
smaller values elsewhere, so the filtered sampler draws the token it draws from every logit.

The bounds come from head_quant's torch reference (approximate_logits), the exact logits from a
float64 product rounded to the dtype; the Triton kernels run on the CPU under TRITON_INTERPRET=1
(set in conftest) at small shapes, on the GPU where there is one.
"""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.fastpath import head_quant  # noqa: E402
from nanovllm.fastpath.head_refine import BOUNDS_TEMPERATURE, HeadRefine  # noqa: E402
from nanovllm.layers.filtered_sampler import FilteredSampler  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, HIDDEN, PROGRAMS = 3001, 64, 16  # a vocabulary that is no multiple of the tiles or programs


def make_head(dtype: torch.dtype, seed: int = 0):
    """(weight [V, H], hidden [H], exact logits [V], lo [V], hi [V], the programs' largest lo [P])."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.05).to(dtype)
    hidden = torch.randn(HIDDEN, generator=g).to(dtype)
    exact = (weight.double() @ hidden.double()).to(dtype)
    exponent = head_quant.input_exponent(torch.ones(HIDDEN), HIDDEN)
    q, meta = head_quant.quantize_head(weight, exponent)
    a, b = head_quant.approximate_logits(q, meta, hidden, exponent)
    lo, hi = (a - b).to(dtype), (a + b).to(dtype)
    assert bool((lo <= exact).all() and (exact <= hi).all())  # the reference's bounds hold
    rows = -(-VOCAB // PROGRAMS)
    parts = torch.stack([lo[i : i + rows].float().max() for i in range(0, VOCAB, rows)])
    return [t.to(DEV) for t in (weight, hidden, exact, lo, hi, parts)]


def refined(dtype: torch.dtype, top_k: int, word: float = BOUNDS_TEMPERATURE, seed: int = 0):
    weight, hidden, exact, lo, hi, parts = make_head(dtype, seed)
    logits = lo.clone().view(1, VOCAB)
    refine = HeadRefine(logits, hi.view(1, VOCAB), hidden.view(1, HIDDEN), weight, parts)
    refine(torch.tensor([word], device=DEV), torch.tensor([top_k], dtype=torch.int32, device=DEV))
    return logits.view(-1), exact, lo


# The Triton interpreter rounds fp32 to bf16 by truncation (the GPU to nearest, as torch does),
# so bf16 runs on the GPU only; fp16 checks the same on the CPU.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="the Triton interpreter truncates fp32 to bf16; bf16 runs on the GPU"))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("top_k", [1, 5, 16])
def test_the_top_k_are_exact_and_the_rest_below_them(dtype, top_k):
    out, exact, lo = refined(dtype, top_k)
    kth = exact.float().topk(top_k).values[-1]
    top = exact.float() >= kth  # the top k, with any ties at the k-th value
    assert torch.equal(out[top], exact[top])
    assert bool((out[~top].float() < kth).all())
    recomputed = (out != lo).sum().item()
    assert recomputed < VOCAB // 4, "the bounds should leave most rows alone"


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("top_k", [16])
def test_the_sampler_draws_the_same_tokens_from_refined_logits(dtype, top_k):
    out, exact, _ = refined(dtype, top_k, seed=1)
    sampler = FilteredSampler(VOCAB, 1, DEV)
    rows = lambda value, dtype=torch.float32: torch.tensor([value], dtype=dtype, device=DEV)  # noqa: E731
    for top_p, min_p in [(1.0, 0.0), (0.95, 0.0), (0.8, 0.05)]:
        for seed in range(4):
            args = (rows(0.6), rows(top_k, torch.int32), rows(top_p), rows(min_p), rows(seed, torch.int64))
            want = sampler(exact.view(1, VOCAB), *args).item()
            assert sampler(out.view(1, VOCAB), *args).item() == want, (top_p, min_p, seed)


def test_a_top_k_beyond_the_programs_recomputes_every_row():
    out, exact, lo = refined(torch.float16, PROGRAMS + 1)
    assert bool((out != lo)[lo != exact].all())
    torch.testing.assert_close(out, exact, atol=0.0, rtol=2.0**-10)  # fp32 sums: at most an ulp apart


def test_a_step_without_the_bounds_flag_is_left_alone():
    out, _, lo = refined(torch.float16, 5, word=-1.0)
    assert torch.equal(out, lo)


def test_shapes_are_checked():
    weight = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="HeadRefine"):
        HeadRefine(torch.zeros(1, 9), torch.zeros(1, 10), torch.zeros(4), weight, torch.zeros(2))
