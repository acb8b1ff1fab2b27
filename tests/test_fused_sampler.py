"""The one-kernel temperature/greedy sampler (Gumbel-max) against the reference semantics.

Runs the Triton kernel on CPU under TRITON_INTERPRET=1 (set in conftest) at small shapes.
"""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.layers import fused_sampler  # noqa: E402
from nanovllm.layers.sampler import Sampler, SamplingTensors  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def fused_sampler_on(device=DEV):
    s = Sampler(fused=True)
    s.fused_devices = (torch.device(device).type,)
    s.fast_path_min_rows = 1
    return s


def test_greedy_rows_equal_argmax_with_ties_across_tiles():
    v = fused_sampler.BLOCK_V * 2 + 37  # three tiles
    logits = torch.randn(4, v, device=DEV)
    logits[1, 5] = logits[1, fused_sampler.BLOCK_V + 9] = 50.0  # tie across tiles: lowest id wins
    logits[2, v - 1] = 60.0  # the max in the ragged last tile
    logits[3, 100] = logits[3, 101] = 70.0  # tie inside a tile
    t = torch.zeros(4, device=DEV)
    got = fused_sampler.gumbel_argmax(logits, t, torch.tensor([123], device=DEV))
    assert got.tolist() == logits.argmax(-1).tolist() == [logits[0].argmax().item(), 5, v - 1, 100]


def test_bf16_logits_are_read_as_they_are():
    logits = torch.randn(3, 300, device=DEV).to(torch.bfloat16)
    got = fused_sampler.gumbel_argmax(logits, torch.zeros(3, device=DEV), torch.tensor([1], device=DEV))
    assert got.tolist() == logits.float().argmax(-1).tolist()


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0], device=DEV)
    # Far enough from 1 that ignoring it is caught in a few hundred draws, every token's
    # expected count above 5 (a sound chi-squared test).
    temperature = 2.0
    rows = 4000 if DEV == "cuda" else 200  # the interpreter runs programs one by one
    counts = torch.zeros(6)
    for _ in range(5 if DEV == "cuda" else 2):  # each call draws a new seed from torch's RNG
        st = SamplingTensors.from_params([SamplingParams(temperature=temperature)] * rows, None, 6, DEV)
        out = fused_sampler_on()(base.expand(rows, 6).contiguous(), st)
        counts += torch.bincount(out.token_ids.cpu(), minlength=6).float()
    expected = torch.softmax(base.cpu() / temperature, -1) * counts.sum()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0  # 5 degrees of freedom: p < 1e-4 for a correct sampler
    wrong = torch.softmax(base.cpu(), -1) * counts.sum()  # ignoring the temperature is caught
    assert (((counts - wrong) ** 2) / wrong).sum().item() > 50  # expected ~160 at 400 draws


def test_only_plain_batches_take_the_fast_path(monkeypatch):
    calls = []
    real = fused_sampler.gumbel_argmax
    monkeypatch.setattr(fused_sampler, "gumbel_argmax", lambda *a: calls.append(1) or real(*a))
    s = fused_sampler_on()
    logits = torch.randn(2, 50, device=DEV)
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=0)]
    s(logits, SamplingTensors.from_params(plain, None, 50, DEV))
    assert calls == [1]
    s.fast_path_min_rows = 3  # a batch smaller than this stays on torch's path
    s(logits, SamplingTensors.from_params(plain, None, 50, DEV))
    s.fast_path_min_rows = 1
    s(logits, SamplingTensors.from_params([plain[1], plain[1]], None, 50, DEV))  # all greedy: torch argmax
    gen = torch.Generator(device=DEV).manual_seed(3)
    for params, gens in [
        ([SamplingParams(temperature=0.8, top_p=0.9), plain[1]], None),
        ([SamplingParams(temperature=0.8, top_k=5), plain[1]], None),
        ([SamplingParams(temperature=0.8, min_p=0.1), plain[1]], None),
        ([SamplingParams(temperature=0.8, logprobs=1), plain[1]], None),
        ([SamplingParams(temperature=0.8, seed=3), plain[1]], [gen, None]),
    ]:
        s(logits, SamplingTensors.from_params(params, gens, 50, DEV))
    assert calls == [1]


def test_vocabulary_splits_give_the_same_tokens():
    """Each row's vocabulary is cut into chunks, one program each; the noise depends only on the
    element's position, so every split count samples the same tokens, ties go to the lowest id
    across chunk boundaries, and chunks past the vocabulary's end are harmless."""
    v = fused_sampler.BLOCK_V * 4 + 37
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, v, generator=gen) * 3).to(DEV)
    logits[4, 7] = logits[4, 2 * fused_sampler.BLOCK_V + 1] = 80.0  # greedy tie across chunks
    logits[5, v - 2] = 90.0  # the max in the last, ragged chunk
    t = torch.tensor([0.7, 1.0, 1.3, 0.5, 0.0, 0.0], device=DEV)
    seed = torch.tensor([42], device=DEV)
    results = [fused_sampler.gumbel_argmax(logits, t, seed, num_splits=s).tolist() for s in (1, 2, 4, 8)]
    assert all(r == results[0] for r in results)
    assert results[0][4:] == [7, v - 2]
    other = fused_sampler.gumbel_argmax(logits, t, torch.tensor([43], device=DEV), num_splits=4).tolist()
    assert other[:4] != results[0][:4]  # the seed matters (4 rows agreeing by chance: ~impossible)
    for bad in (3, 0, 2 * fused_sampler.MAX_SPLITS):
        with pytest.raises(ValueError, match="power of two"):
            fused_sampler.gumbel_argmax(logits, t, seed, num_splits=bad)


def random_masks(rows_masked: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, list[set[int]]]:
    """int32 [rows_masked, ceil(vocab / 32)] bitmask rows and the token sets they allow (about
    a third of the vocabulary each, always the last token and bit 31 of some word)."""
    allowed = []
    for _ in range(rows_masked):
        keep = set(torch.nonzero(torch.rand(vocab, generator=gen) < 0.3).flatten().tolist()) | {vocab - 1, 31}
        allowed.append(keep)
    words = torch.zeros(rows_masked, (vocab + 31) // 32, dtype=torch.int64)
    for r, keep in enumerate(allowed):
        for t in keep:
            words[r, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words, allowed


def test_grammar_masks_are_read_in_the_scan():
    """A masked row samples what the kernel samples from its logits with every disallowed
    token at -inf (the same noise), greedy or not, for every split count; rows whose row_of is
    -1 are left alone; each sampled token is allowed; the masked rows' order in `words` is the
    caller's (row_of names them)."""
    v = fused_sampler.BLOCK_V * 2 + 45
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, v, generator=gen) * 3).to(DEV)
    words, allowed = random_masks(3, v, gen)
    row_of = torch.tensor([2, -1, 0, -1, 1, 0], dtype=torch.int32)
    masked_logits = logits.clone()
    for b, r in enumerate(row_of.tolist()):
        if r >= 0:
            banned = [t for t in range(v) if t not in allowed[r]]
            masked_logits[b, banned] = float("-inf")
    t = torch.tensor([0.0, 0.0, 0.8, 1.0, 0.0, 1.3], device=DEV)
    seed = torch.tensor([7], device=DEV)
    expected = fused_sampler.gumbel_argmax(masked_logits, t, seed, 2).tolist()
    assert expected[0] == masked_logits[0].argmax().item() and expected[4] == masked_logits[4].argmax().item()
    mask = (words.to(DEV), row_of.to(DEV))
    for splits in (1, 2, 4):
        assert fused_sampler.gumbel_argmax(logits, t, seed, splits, mask).tolist() == expected
    for b, r in enumerate(row_of.tolist()):
        if r >= 0:
            assert expected[b] in allowed[r]
    assert expected[1] == logits[1].argmax().item()  # unmasked, greedy: its own argmax
    with pytest.raises(ValueError, match="row_of"):
        fused_sampler.gumbel_argmax(logits, t, seed, 2, (words.to(DEV), row_of[:5].to(DEV)))


def test_greedy_batches_under_grammar_masks_take_the_kernel_and_match_the_reference(monkeypatch):
    """Greedy rows with grammar masks (structured/bitmask.py TokenBitmask) sample in the kernel,
    and give the reference sampler's masked argmax, beside unmasked rows; one sampler serves
    batches of several sizes in turn (a larger one after a smaller one, and back)."""
    pytest.importorskip("xgrammar", reason="xgrammar is not installed")
    from nanovllm.structured.bitmask import TokenBitmask

    v = 300
    gen = torch.Generator().manual_seed(3)
    calls = []
    real = fused_sampler.gumbel_argmax
    monkeypatch.setattr(fused_sampler, "gumbel_argmax", lambda *a: calls.append(1) or real(*a))
    fused, reference = fused_sampler_on(), Sampler(fused=False)
    for rows in (5, 70, 5):
        logits = (torch.randn(rows, v, generator=gen) * 2).to(DEV)
        words, allowed = random_masks(3, v, gen)
        masks = [(0, words[1:2]), (2, words[0:1]), (3, words[2:3])]
        params = [SamplingParams(temperature=0)] * rows
        st = SamplingTensors.from_params(params, None, v, DEV)
        st.token_mask = TokenBitmask.from_rows(rows, masks, DEV)
        got = fused(logits, st).token_ids.tolist()
        st = SamplingTensors.from_params(params, None, v, DEV)
        st.token_mask = TokenBitmask.from_rows(rows, masks, DEV)
        assert got == reference(logits, st).token_ids.tolist()
        assert got[0] in allowed[1] and got[2] in allowed[0] and got[3] in allowed[2]
    assert len(calls) == 3


def _masked_argmax(logits, words_allowed, row_of):
    """The reference: each row's disallowed logits at -inf, then torch.argmax (fp32)."""
    x = logits.float().cpu().clone()
    for b, r in enumerate(row_of):
        if r >= 0:
            banned = [t for t in range(x.shape[1]) if t not in words_allowed[r]]
            x[b, banned] = float("-inf")
    return x.argmax(-1).tolist()


def test_masked_greedy_is_the_argmax_among_allowed_tokens():
    """MaskedGreedy against masking then torch.argmax: rows without a grammar (row_of -1),
    a row's max in the ragged last tile, ties inside a tile, between tiles and across chunks (the lowest id
    wins), bf16 logits, a mask row shared by two batch rows; launches of other batch sizes in
    between reuse and grow the workspace, whose arrival counts are back at 0 after each."""
    v = 4 * fused_sampler.MASKED_GREEDY_BLOCK + 45  # two chunks a row on the interpreter's 4 "SMs"
    assert fused_sampler.choose_num_splits(6, v, 4) == 2
    gen = torch.Generator().manual_seed(5)
    greedy = fused_sampler.MaskedGreedy(DEV)
    for rows in (6, 70, 6):
        logits = torch.randn(rows, v, generator=gen) * 3
        words, allowed = random_masks(3, v, gen)
        row_of = [(b % 4) - 1 for b in range(rows)]  # -1, 0, 1, 2, -1, ...
        top = sorted(allowed[0])[-1]  # row 1 (mask row 0): its max in the ragged last tile
        assert top >= 4 * fused_sampler.MASKED_GREEDY_BLOCK
        logits[1, top] = 40.0
        tie = sorted(allowed[1])
        logits[2, tie[1]] = logits[2, tie[-2]] = 50.0  # across chunks: the lower id
        # No grammar: ties inside a tile and in one lane of the chunk's next tile.
        logits[4, 7] = logits[4, 9] = logits[4, 7 + fused_sampler.MASKED_GREEDY_BLOCK] = 60.0
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            got = greedy(x.to(DEV), words.to(DEV), torch.tensor(row_of, dtype=torch.int32, device=DEV)).tolist()
            assert got == _masked_argmax(x, allowed, row_of)
            assert got[1] == top and got[2] == tie[1] and got[4] == 7
            assert greedy.count.cpu().eq(0).all()


def test_masked_greedy_edge_rows():
    """A row whose allowed logits are all -inf gets its lowest allowed token; a row whose mask
    allows nothing gets 0, as torch.argmax of a row of -inf; a single allowed token is taken
    whatever the logits; one row alone; bad shapes are a ValueError naming the argument."""
    v = 3 * fused_sampler.MASKED_GREEDY_BLOCK + 11
    logits = torch.randn(3, v)
    words = torch.zeros((3, (v + 31) // 32), dtype=torch.int32)
    words[0, 3] = 0b1010  # tokens 97 and 99
    logits[0, 97] = logits[0, 99] = float("-inf")
    words[2, (v - 1) // 32] = 1 << ((v - 1) % 32)  # only the last token
    logits[2, v - 1] = -1e30
    greedy = fused_sampler.MaskedGreedy(DEV)
    row_of = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    assert greedy(logits.to(DEV), words.to(DEV), row_of).tolist() == [97, 0, v - 1]
    one = greedy(logits[:1].to(DEV), words[2:].to(DEV), torch.zeros(1, dtype=torch.int32, device=DEV))
    assert one.tolist() == [v - 1]
    with pytest.raises(ValueError, match="row_of"):
        greedy(logits.to(DEV), words.to(DEV), row_of[:2])
    with pytest.raises(ValueError, match="mask words"):
        greedy(logits.to(DEV), words[:, :3].to(DEV), row_of)


def test_sampler_greedy_batches_match_the_reference_pipeline():
    """Sampler.greedy (greedy rows and nothing else: no SamplingTensors) gives what the
    reference pipeline gives for the same rows, with and without grammar masks, on the fused
    path (MaskedGreedy) and on the reference one."""
    pytest.importorskip("xgrammar", reason="xgrammar is not installed")
    from nanovllm.structured.bitmask import TokenBitmask

    v = 300
    gen = torch.Generator().manual_seed(8)
    rows = 9
    logits = (torch.randn(rows, v, generator=gen) * 2).to(DEV)
    words, allowed = random_masks(3, v, gen)
    masks = [(0, words[1:2]), (4, words[0:1]), (8, words[2:3])]
    params = [SamplingParams(temperature=0)] * rows
    reference = Sampler(fused=False)
    st = SamplingTensors.from_params(params, None, v, DEV)
    st.token_mask = TokenBitmask.from_rows(rows, masks, DEV)
    expected = reference(logits, st).token_ids.tolist()
    assert expected[0] in allowed[1] and expected[4] in allowed[0] and expected[8] in allowed[2]
    for sampler in (fused_sampler_on(), reference):
        assert sampler.greedy(logits, TokenBitmask.from_rows(rows, masks, DEV)).token_ids.tolist() == expected
        assert sampler.greedy(logits).token_ids.tolist() == logits.argmax(-1).tolist()


def test_choose_num_splits():
    # Enough 8-warp programs to fill 132 SMs 8 times over, each chunk at least two tiles.
    assert fused_sampler.choose_num_splits(256, 151936, 132) == 8
    assert fused_sampler.choose_num_splits(32, 151936, 132) == 32
    assert fused_sampler.choose_num_splits(2048, 151936, 132) == 1
    assert fused_sampler.choose_num_splits(32, 5000, 132) == 1
    assert fused_sampler.choose_num_splits(0, 151936, 132) == 1
    for rows in (1, 7, 32, 100, 256, 1000):
        for vocab in (1000, 30000, 49152, 151936):
            s = fused_sampler.choose_num_splits(rows, vocab, 132)
            assert s & (s - 1) == 0 and (s == 1 or vocab // s >= 2 * fused_sampler.BLOCK_V)



@triton.jit
def _noise_kernel(u_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(out_ptr + offs, fused_sampler._gumbel(u, FAST), mask=offs < n)


def test_gumbel_noise_is_accurate_in_its_upper_tail():
    """The sampled token comes from the noise's upper tail (u near 1, where -ln u is tiny): a
    fast log's absolute error there would distort it. On the GPU the kernel's fast path (MUFU
    lg2), on the CPU the interpreter's precise one; both against float64."""
    u = torch.tensor(
        [0.0, 1e-20, 1e-10, 1e-3, 0.1, 0.3, 0.5, 0.7, 0.9, 0.98, 1 - 1 / 64 - 1e-6, 1 - 1 / 64 + 1e-6]
        + [1 - k * 2.0**-24 for k in (2, 3, 5, 16, 100, 1000, 10000)],
        dtype=torch.float32,
    )
    out = torch.empty_like(u, device=DEV)
    _noise_kernel[(1,)](u.to(DEV), out, u.numel(), FAST=DEV == "cuda", BLOCK=32)
    exact = -torch.log(-torch.log(u.double().clamp(min=1e-20)))
    assert torch.allclose(out.cpu().double(), exact, rtol=0, atol=2e-5), (out.cpu(), exact)
    assert out.max().item() > 15.0  # the largest u Triton draws (1 - 2^-23) is in the list


@pytest.mark.parametrize("vocab", [1, 300, fused_sampler.GREEDY_BLOCK, 3 * fused_sampler.GREEDY_BLOCK + 37])
def test_greedy_row_equals_torch_argmax(vocab):
    """The one-row greedy kernel (the lone-sequence graph's argmax) against torch.argmax: a max
    in the ragged last block, ties inside a block and across blocks (lowest id wins), all -inf,
    bf16; repeated launches reuse the workspace (the last program resets the count)."""
    greedy = fused_sampler.GreedyRow(vocab, torch.device(DEV))
    out = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    cases = [torch.randn(1, vocab, device=DEV), torch.full((1, vocab), float("-inf"), device=DEV)]
    ragged = torch.randn(1, vocab, device=DEV)
    ragged[0, -1] = 9.0
    cases.append(ragged)
    if vocab > 200:
        tie = torch.randn(1, vocab, device=DEV)
        tie[0, 150] = tie[0, 170] = tie[0, vocab - 2] = 9.0
        cases += [tie, tie.to(torch.bfloat16)]
    for logits in cases:
        greedy(logits, out)
        assert out.item() == logits.float().argmax(-1).item()
    assert greedy.count.item() == 0
    with pytest.raises(ValueError, match="must be"):
        greedy(torch.zeros(2, vocab, device=DEV), out)


@triton.jit
def _score_best_kernel(logits_ptr, temp_ptr, seed_ptr, out_ptr, vocab, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       FAST: tl.constexpr):
    """The best column of gumbel_score over one row, CHUNK columns at a time (as the persistent
    decode kernel's LM head keeps its best of each chunk of rows): the same draw as
    gumbel_argmax is the claim under test."""
    t = tl.load(temp_ptr)
    seed = tl.load(seed_ptr)
    best_val = tl.full([CHUNK], float("-inf"), tl.float32)
    best_col = tl.zeros([CHUNK], tl.int32)
    for start in range(0, vocab, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < vocab
        x = tl.load(logits_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        v = tl.where(valid, fused_sampler.gumbel_score(x, cols, 1.0 / t, seed, BLOCK, FAST), float("-inf"))
        better = v > best_val
        best_val = tl.where(better, v, best_val)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best_val, axis=0)
    tl.store(out_ptr, tl.min(tl.where(best_val == top, best_col, 2**31 - 1), axis=0).to(tl.int64))


@pytest.mark.parametrize("vocab", [300, fused_sampler.BLOCK_V * 2 + 37])
def test_gumbel_score_draws_what_gumbel_argmax_draws(vocab):
    """gumbel_score (the noise of one column of row 0, which the persistent kernel's LM head adds
    to its logits to sample) picks, over chunks of another width, the very token gumbel_argmax
    samples from the same logits, temperature and seed; and the draws vary with the seed."""
    torch.manual_seed(1)
    logits = torch.randn(1, vocab, device=DEV).to(torch.bfloat16)
    seen = set()
    for seed in (0, 12345, 2**31 - 2):
        for temperature in (0.3, 1.0, 2.5):
            t = torch.tensor([temperature], device=DEV)
            s = torch.tensor([seed], dtype=torch.int64, device=DEV)
            want = fused_sampler.gumbel_argmax(logits, t, s)
            got = torch.zeros(1, dtype=torch.int64, device=DEV)
            _score_best_kernel[(1,)](logits, t, s, got, vocab, BLOCK=fused_sampler.BLOCK_V, CHUNK=128,
                                     FAST=DEV == "cuda")
            assert got.item() == want.item()
            seen.add(want.item())
    assert len(seen) > 3
