"""The sort-free top-k / top-p / min-p sampler (layers/filtered_sampler.py) against an
independent reference of the filters: each token must be the Gumbel-max pick over the
reference's kept set, on both of its paths (the candidate list and the whole-row search), and
its draws must follow the filtered softmax.

Runs the Triton kernels on CPU under TRITON_INTERPRET=1 (set in conftest) at small shapes.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.layers import filtered_sampler  # noqa: E402
from nanovllm.layers.filtered_sampler import FilteredSampler  # noqa: E402
from nanovllm.layers.fused_sampler import BLOCK_V, gumbel_noise  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _noise_rows_kernel(seed_ptr, out_ptr, vocab, BLOCK: tl.constexpr, SAMPLE_BLOCK: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + cols, gumbel_noise(cols, seed, SAMPLE_BLOCK, FAST), mask=cols < vocab)


def noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.empty((len(seeds), vocab), dtype=torch.float32, device=seeds.device)
    _noise_rows_kernel[(len(seeds),)](seeds, out, vocab, BLOCK=1024, SAMPLE_BLOCK=BLOCK_V, FAST=seeds.is_cuda)
    return out


def reference_kept(x: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """The kept set of one row of x = logits / T, in float64 after a stable sort: top-k (ties to
    the lower id), then top-p over the top-k's renormalised probabilities (keep while the mass
    strictly above is < p), then min-p (prob >= min_p * max prob)."""
    x = x.double()
    order = torch.sort(-x, stable=True).indices
    if 0 < k < len(x):
        order = order[:k]
    probs = torch.softmax(x[order], dim=0)
    above = torch.cumsum(probs, 0) - probs
    if p < 1.0:
        order = order[above < p]
    if min_p > 0:
        order = order[torch.exp(x[order] - x[order[0]]) >= min_p]
    keep = torch.zeros(len(x), dtype=torch.bool)
    keep[order] = True
    return keep


def sample(sampler, logits, rows):
    """rows: (temperature, top_k, top_p, min_p, seed) per row."""
    t, k, p, m, s = zip(*rows)
    dev = logits.device
    return sampler(logits, torch.tensor(t, device=dev), torch.tensor(k, dtype=torch.int32, device=dev),
                   torch.tensor(p, device=dev), torch.tensor(m, device=dev),
                   torch.tensor(s, dtype=torch.int64, device=dev))


ROWS = [  # (temperature, top_k, top_p, min_p): each path and filter
    (0.7, 20, 1.0, 0.0),  # top-k from the candidates
    (1.0, 5, 0.8, 0.0),  # top-k then top-p
    (0.6, 20, 0.95, 0.1),  # all three
    (0.5, -1, 0.9, 0.0),  # top-p alone: a small nucleus on the peaked rows, a wide one on flat rows
    (1.3, -1, 1.0, 0.2),  # min-p alone
    (0.8, 3000, 1.0, 0.0),  # top-k larger than the tiles: the whole-row search
    (1.0, -1, 1.0, 0.0),  # nothing but a temperature: the whole-row scan
    (0.0, 20, 0.9, 0.0),  # greedy
]


@pytest.mark.parametrize("whole_row", [False, True], ids=["candidates", "whole-row"])
def test_token_is_the_gumbel_max_of_the_reference_kept_set(monkeypatch, whole_row):
    vocab = 5000  # 10 tiles
    torch.manual_seed(0)
    flat = torch.randn(len(ROWS), vocab) * 0.5
    peaked = torch.randn(len(ROWS), vocab) * 4.0
    peaked[:, 17] = peaked[:, 4000] = 30.0  # a tie at the top, across tiles: the lower id ranks first
    logits = torch.cat([flat, peaked]).to(torch.bfloat16).to(DEV)
    rows = [(*r, 1000 + i) for i, r in enumerate(ROWS + ROWS)]
    attempts = 2 if DEV == "cuda" else 1  # a second launch: the candidate counter was reset by the first
    if whole_row:  # the candidates are the top tile's largest entries: every row that needs
        # more than that (all but some top-k rows) takes the whole-row search
        monkeypatch.setattr(filtered_sampler, "CANDIDATE_TILES", 1)
        if DEV == "cpu":  # the interpreter runs that search slowly: half the rows, once
            logits, rows, attempts = logits[::2], rows[::2], 1
    sampler = FilteredSampler(vocab, len(rows), DEV)
    for _ in range(attempts):
        got = sample(sampler, logits, rows).cpu()
        g = noise(torch.tensor([r[4] for r in rows], device=DEV), vocab).cpu()
        for i, (t, k, p, m, _) in enumerate(rows):
            x = logits[i].float().cpu() * (1.0 / t if t > 0 else 1.0)
            keep = reference_kept(x, k, p, m)
            score = torch.where(keep, x + (g[i] if t > 0 else 0.0), float("-inf"))
            want = int(torch.nonzero(score == score.max())[0])
            assert got[i].item() == want, (i, rows[i], got[i].item(), want, int(keep.sum()))


DRAW_ROWS = [(0.8, 4, 1.0, 0.0), (0.7, -1, 0.62, 0.0), (1.3, -1, 1.0, 0.3), (0.7, 6, 0.8, 0.05), (1.0, -1, 1.0, 0.0)]
LOGITS8 = [1.0, -0.5, 2.0, 0.3, -2.0, 1.7, 0.0, -1.0]


@pytest.mark.gpu
@pytest.mark.skipif(DEV == "cpu", reason="100k draws per case need a CUDA device (the interpreter runs a few per second); "
                    "on the CPU the exact test above checks each token against the reference's kept set")
@pytest.mark.parametrize("row", DRAW_ROWS)
@pytest.mark.parametrize("whole_row", [False, True], ids=["candidates", "whole-row"])
def test_draws_follow_the_filtered_softmax(monkeypatch, row, whole_row):
    """Rows that differ only in their seed sample the reference's renormalised distribution
    (100k draws per case). Eight finite logits, one per tile of a 1,024-token row (the rest
    -inf), so the tile maxima let the candidate list decide; with the top tile's entries as the
    only candidates, the whole-row search decides the rows without top-k."""
    if whole_row:
        monkeypatch.setattr(filtered_sampler, "CANDIDATE_TILES", 1)
    monkeypatch.setattr(filtered_sampler, "TILE", 128)
    vocab, n = 1024, 100_000
    cols = torch.arange(8) * 128 + 3
    logits = torch.full((vocab,), float("-inf"))
    logits[cols] = torch.tensor(LOGITS8)
    sampler = FilteredSampler(vocab, n, DEV)
    t, k, p, m = row
    tokens = sample(sampler, logits.repeat(n, 1).to(DEV), [(t, k, p, m, s) for s in range(n)]).cpu()
    x = torch.tensor(LOGITS8) / t
    keep = reference_kept(x, k, p, m)
    want = torch.where(keep, torch.softmax(x.double(), 0), 0.0)
    want = want / want.sum()
    assert torch.isin(tokens, cols).all()
    freq = torch.bincount(tokens // 128, minlength=8).double() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(keep).flatten().tolist())
    # Chi-square over the kept tokens, below the 99.9% quantile for 7 degrees of freedom (24.3).
    kept = torch.nonzero(keep).flatten()
    chi2 = float((((freq[kept] - want[kept]) * n) ** 2 / (want[kept] * n)).sum())
    assert chi2 < 24.3, (row, freq.tolist(), want.tolist())


def test_seed_decides_the_token_whatever_the_row():
    """A row's token depends on its logits, settings and seed only, not on its place or batch."""
    vocab = 1000
    torch.manual_seed(3)
    logits = torch.randn(5, vocab, device=DEV)
    rows = [(0.9, 20, 0.9, 0.0, 77 + i) for i in range(5)]
    whole = sample(FilteredSampler(vocab, 5, DEV), logits, rows).cpu()
    alone = [sample(FilteredSampler(vocab, 1, DEV), logits[i : i + 1], rows[i : i + 1]).item() for i in (4, 1)]
    assert alone == [whole[4].item(), whole[1].item()]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on an all-NaN row
def test_a_row_of_nan_logits_still_gives_a_token_id():
    """No score is finite, so nothing is kept: the token is still inside the vocabulary (the next
    step embeds it), and the other rows are sampled as usual."""
    logits = torch.randn(2, 700, device=DEV)
    logits[0] = float("nan")
    got = sample(FilteredSampler(700, 2, DEV), logits, [(0.8, 20, 0.9, 0.0, 1), (0.0, 20, 0.9, 0.0, 2)]).cpu()
    assert 0 <= got[0].item() < 700 and got[1].item() == int(logits[1].argmax())


def test_the_smallest_top_p_keeps_the_most_likely_token():
    """SamplingTensors raises a positive top_p below float32's range (5e-324 is valid) to its
    smallest normal number; there, as for any top_p > 0, the most likely token is kept."""
    logits = torch.randn(3, 700, device=DEV) * 3
    tiny = torch.finfo(torch.float32).tiny
    got = sample(FilteredSampler(700, 3, DEV), logits, [(1.0, -1, tiny, 0.0, s) for s in (1, 2, 3)]).cpu()
    assert got.tolist() == logits.argmax(dim=-1).cpu().tolist()


def test_bad_shapes_raise():
    sampler = FilteredSampler(100, 2, "cpu")
    with pytest.raises(ValueError, match="logits must be"):
        sample(sampler, torch.zeros(1, 99), [(1.0, 5, 1.0, 0.0, 0)])
    with pytest.raises(ValueError, match="at most 2"):
        sample(sampler, torch.zeros(3, 100), [(1.0, 5, 1.0, 0.0, 0)] * 3)
    with pytest.raises(ValueError, match="max_rows"):
        FilteredSampler(100, 0, "cpu")
