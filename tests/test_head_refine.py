"""A top-k stream's sample from the int8 head's bounds (fastpath/head_refine.py): after the
refine launch the logits buffer holds the exact logits of every row a top-k sample can keep and
only smaller values elsewhere, those rows are listed for the filtered sampler's pick, and the
pick draws the token the filtered sampler draws from every logit.

The bounds come from head_quant's torch reference (approximate_logits), the exact logits from a
float64 product rounded to the dtype; the Triton kernels run on the CPU under TRITON_INTERPRET=1
(set in conftest) at small shapes, on the GPU where there is one.
"""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.fastpath import head_quant  # noqa: E402
from nanovllm.fastpath.head_refine import HeadRefine  # noqa: E402
from nanovllm.layers.filtered_sampler import FilteredSampler  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, HIDDEN, PROGRAMS = 3001, 64, 16  # a vocabulary that is no multiple of the tiles or programs
SMALL_VOCAB = 1201  # the same, and more rows than the sampler's list holds (CAP)
# The Triton interpreter rounds fp32 to bf16 by truncation (the GPU to nearest, as torch does),
# so bf16 runs on the GPU only; fp16 checks the same on the CPU.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="the Triton interpreter truncates fp32 to bf16; bf16 runs on the GPU"))


def one(value, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype, device=DEV)


class Head:
    """A random LM head and input: the exact logits, their bounds (lo, hi) and the programs'
    largest lo, and a refine over a buffer that starts at lo for each call."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, vocab: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(seed)
        weight = (torch.randn(vocab, HIDDEN, generator=g) * 0.05).to(dtype)
        hidden = torch.randn(HIDDEN, generator=g).to(dtype)
        exact = (weight.double() @ hidden.double()).to(dtype)
        exponent = head_quant.input_exponent(torch.ones(HIDDEN), HIDDEN)
        q, meta = head_quant.quantize_head(weight, exponent)
        a, b = head_quant.approximate_logits(q, meta, hidden, exponent)
        lo, hi = (a - b).to(dtype), (a + b).to(dtype)
        assert bool((lo <= exact).all() and (exact <= hi).all())  # the reference's bounds hold
        rows = -(-vocab // PROGRAMS)
        parts = torch.stack([lo[i : i + rows].float().max() for i in range(0, vocab, rows)])
        self.weight, self.exact, self.lo, self.hi = (t.to(DEV) for t in (weight, exact, lo, hi))
        self.vocab = vocab
        self.logits = self.lo.clone().view(1, vocab)
        self.sampler = FilteredSampler(vocab, 1, DEV)
        self.refine = HeadRefine(self.logits, self.hi.view(1, vocab), hidden.to(DEV).view(1, HIDDEN), self.weight,
                                 parts.to(DEV), self.sampler)

    def refined(self, top_k: int, temperature: float = 0.6) -> torch.Tensor:
        self.logits.copy_(self.lo.view(1, self.vocab))
        self.refine(one(temperature), one(top_k, torch.int32))
        return self.logits.view(-1)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("top_k", [1, 5, 16])
def test_the_top_k_are_exact_listed_and_the_rest_below_them(dtype, top_k):
    head = Head(dtype)
    out, exact = head.refined(top_k, temperature=0.5), head.exact
    kth = exact.float().topk(top_k).values[-1]
    top = exact.float() >= kth  # the top k, with any ties at the k-th value
    assert torch.equal(out[top], exact[top])
    assert bool((out[~top].float() < kth).all())
    recomputed = out != head.lo
    assert recomputed.sum().item() < VOCAB // 4, "the bounds should leave most rows alone"
    count, values, ids, tau, row_max = head.sampler.listing()
    n = count.item()
    assert n >= top_k
    listed = ids[:n].long()
    assert set(torch.nonzero(top).flatten().tolist()) <= set(listed.tolist())
    assert bool((values[:n] >= tau).all()), "rows whose exact logit is below tau are not listed"
    torch.testing.assert_close(values[:n], exact[listed].float() * 2.0, atol=0.0, rtol=0.0)  # divided by 0.5
    assert row_max.item() == exact.float().max().item() * 2.0
    assert tau.item() <= kth.item() * 2.0


FILTERS = [(1.0, 0.0), (0.95, 0.0), (0.8, 0.05)]  # (top_p, min_p) beside the top k


def check_picks(head: Head, top_k: int, seeds_per_filter: int, filters=FILTERS) -> set[int]:
    """The pick from the refined list equals the filtered sampler's token from every logit,
    each filter under seeds of its own."""
    vocab = head.vocab
    full = FilteredSampler(vocab, 1, DEV)
    drawn = set()
    for i, (top_p, min_p) in enumerate(filters):
        for seed in range(i * seeds_per_filter, (i + 1) * seeds_per_filter):
            args = (one(0.6), one(top_k, torch.int32), one(top_p), one(min_p), one(seed, torch.int64))
            want = full(head.exact.view(1, vocab), *args).item()
            out = head.refined(top_k)
            got = head.sampler.pick_listed(out.view(1, vocab), *args, out=torch.zeros(1, dtype=torch.int64, device=DEV))
            assert got.item() == want, (top_p, min_p, seed)
            assert head.sampler.listing()[0].item() == 0 and head.sampler.listing()[4].item() == float("-inf")
            drawn.add(want)
    return drawn


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_the_pick_from_the_list_draws_the_tokens_of_every_logit(dtype):
    assert len(check_picks(Head(dtype, seed=1), 16, seeds_per_filter=2)) > 2


def test_a_top_k_beyond_the_programs_recomputes_every_row_and_the_pick_searches_them():
    head = Head(torch.float16, vocab=SMALL_VOCAB)
    out = head.refined(PROGRAMS + 1)
    assert bool((out != head.lo)[head.lo != head.exact].all())
    torch.testing.assert_close(out, head.exact, atol=0.0, rtol=2.0**-10)  # fp32 sums: at most an ulp apart
    assert head.sampler.listing()[0].item() == SMALL_VOCAB  # more than the list holds: the pick searches the row
    check_picks(head, PROGRAMS + 1, seeds_per_filter=1, filters=[(0.95, 0.0)])


def test_shapes_are_checked():
    weight = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="HeadRefine"):
        HeadRefine(torch.zeros(1, 9), torch.zeros(1, 10), torch.zeros(4), weight, torch.zeros(2), FilteredSampler(10, 1, "cpu"))
    with pytest.raises(ValueError, match="sampler's vocabulary"):
        HeadRefine(torch.zeros(1, 10), torch.zeros(1, 10), torch.zeros(4), weight, torch.zeros(2), FilteredSampler(11, 1, "cpu"))
