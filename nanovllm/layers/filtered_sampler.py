"""Top-k / top-p / min-p sampling on the device without a sort: four small launches, no host
sync, graph-capturable, one row per request with its own settings and its own seed.

The token is the Gumbel-max pick over the kept set: argmax over kept tokens i of
x_i + g_i, where x = logits / temperature and g_i is the Gumbel noise that
fused_sampler.gumbel_argmax (and the persistent kernel's LM head) add to column i under the
row's seed. That draws exactly from the filtered, renormalised softmax. The kept set is what
sampler.py's reference keeps: top-k (ties to the lower token id), then top-p over the top-k's
renormalised probabilities (keep a token while the mass strictly above it is < top_p), then
min-p (probability >= min_p times the largest). Every one of those sets is an upper set of the
row in (x descending, token id ascending) order, so it can be found among the row's largest
entries:

1. `_tile_stats_kernel`: per tile of TILE columns, the largest x and the sum of exp(x - it).
2. `_threshold_kernel`: per row, tau = the k0-th largest tile maximum (k0 = top_k, or
   CANDIDATE_TILES when top-k is off), the row maximum M and the softmax normaliser Z. At least
   k0 entries are >= tau, so {x >= tau} holds the whole top-k.
3. `_candidates_kernel`: every entry >= tau is appended to the row's candidate list (an atomic
   count, up to CAP entries).
4. `_pick_kernel`: per row, each candidate's rank and the mass above it by pairwise comparison
   (the list is short: ~k entries for top-k), the three filters, the Gumbel-max pick.

Where the candidates cannot decide (more than CAP of them, a top-k larger than the list, a
top-p nucleus or min-p set reaching below tau, or no filter at all), `_pick_kernel` finds the
cut by bisection over the whole row instead: exact, but ~two passes over the row per bit, so it
is the slow path (a top-p-only nucleus of thousands of tokens, a top-k in the thousands).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.layers.fused_sampler import BLOCK_V, gumbel_noise
from nanovllm.precompile import compiling_only, launch

TILE = 512
# Candidates kept per row; the pick compares them pairwise in blocks of PAIR_BLOCK.
CAP = 1024
SMALL_CAP = 64
PAIR_BLOCK = 32
# With top-k off, tau is the CANDIDATE_TILES-th largest tile maximum: at least that many
# candidates, enough for a typical top-p nucleus or min-p set.
CANDIDATE_TILES = 128
WIDE_BLOCK = 2048
# The threshold kernel ranks the tile maxima in a block of at least this many (padded with
# -inf): a block smaller than the program's threads gives wrong ranks on the GPU.
MIN_TILES_BLOCK = 128
_INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _scaled(x, t):
    """x / t in fp32 for t > 0 (a sampling row), x itself for t <= 0 (greedy), rounded as
    fused_sampler's Gumbel scores round it (x times 1 / t), so that a row without filters
    draws the token those draw."""
    return x.to(tl.float32) * (1.0 / tl.where(t > 0.0, t, 1.0))


@triton.jit(do_not_specialize=("num_tiles", "tiles_per_prog"))
def _tile_stats_kernel(logits_ptr, stride, temp_ptr, tile_max_ptr, tile_sum_ptr, vocab_size, num_tiles,
                       tiles_per_prog, TILE_: tl.constexpr):
    row = tl.program_id(0)
    prog = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    offs = tl.arange(0, TILE_)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    first = prog * tiles_per_prog
    for tile in range(first, tl.minimum(num_tiles, first + tiles_per_prog)):
        cols = tile * TILE_ + offs
        x = _scaled(tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")), t)
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(x - m_safe), axis=0)
        tl.store(tile_max_ptr + row * num_tiles + tile, m)
        tl.store(tile_sum_ptr + row * num_tiles + tile, s)


@triton.jit(do_not_specialize=("num_tiles",))
def _threshold_kernel(tile_max_ptr, tile_sum_ptr, top_k_ptr, tau_ptr, row_max_ptr, z_ptr, vocab_size, num_tiles,
                      TILES_P2: tl.constexpr, CANDIDATE_TILES_: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, TILES_P2)
    live = offs < num_tiles
    m = tl.load(tile_max_ptr + row * num_tiles + offs, mask=live, other=float("-inf"))
    s = tl.load(tile_sum_ptr + row * num_tiles + offs, mask=live, other=0.0)
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    z = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - big_safe), 0.0), axis=0)
    k = tl.load(top_k_ptr + row)
    k0 = tl.where((k > 0) & (k < vocab_size), k, CANDIDATE_TILES_)
    k0 = tl.minimum(k0, num_tiles)
    ranked = tl.sort(m, descending=True)
    tau = tl.max(tl.where(offs == k0 - 1, ranked, float("-inf")), axis=0)
    tl.store(tau_ptr + row, tau)
    tl.store(row_max_ptr + row, big)
    tl.store(z_ptr + row, z)


@triton.jit(do_not_specialize=("num_tiles", "tiles_per_prog"))
def _candidates_kernel(logits_ptr, stride, temp_ptr, tau_ptr, count_ptr, cand_val_ptr, cand_idx_ptr, vocab_size,
                       num_tiles, tiles_per_prog, TILE_: tl.constexpr, CAP_: tl.constexpr):
    row = tl.program_id(0)
    prog = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    tau = tl.load(tau_ptr + row)
    offs = tl.arange(0, TILE_)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    first = prog * tiles_per_prog
    for tile in range(first, tl.minimum(num_tiles, first + tiles_per_prog)):
        cols = tile * TILE_ + offs
        x = _scaled(tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")), t)
        hit = (x >= tau) & (cols < vocab_size)
        n = tl.sum(hit.to(tl.int32), axis=0)
        if n > 0:
            base = tl.atomic_add(count_ptr + row, n)
            pos = base + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            ok = hit & (pos < CAP_)
            tl.store(cand_val_ptr + row * CAP_ + pos, x, mask=ok)
            tl.store(cand_idx_ptr + row * CAP_ + pos, cols, mask=ok)


@triton.jit
def _pick_from_candidates(cand_val_ptr, cand_idx_ptr, row, n, t, k, top_p, min_p, seed, tau, big, z, vocab_size,
                          C: tl.constexpr, CAP_: tl.constexpr, PAIR: tl.constexpr, SAMPLE_BLOCK: tl.constexpr,
                          FAST: tl.constexpr):
    """(token, decided) from the row's n <= C candidates: decided is False where the kept set may
    reach below tau (the caller then searches the whole row)."""
    i = tl.arange(0, C)
    live = i < n
    xv = tl.load(cand_val_ptr + row * CAP_ + i, mask=live, other=float("-inf"))
    xi = tl.load(cand_idx_ptr + row * CAP_ + i, mask=live, other=_INT_MAX)
    e = tl.where(live, tl.exp(xv - big), 0.0)
    count_above = tl.zeros((C,), tl.int32)
    mass_above = tl.zeros((C,), tl.float32)
    for jb in range(0, n, PAIR):
        j = jb + tl.arange(0, PAIR)
        lj = j < n
        xj = tl.load(cand_val_ptr + row * CAP_ + j, mask=lj, other=float("-inf"))
        ij = tl.load(cand_idx_ptr + row * CAP_ + j, mask=lj, other=_INT_MAX)
        ej = tl.where(lj, tl.exp(xj - big), 0.0)
        above = (xj[None, :] > xv[:, None]) | ((xj[None, :] == xv[:, None]) & (ij[None, :] < xi[:, None]))
        above = above & lj[None, :]
        count_above += tl.sum(above.to(tl.int32), axis=1)
        mass_above += tl.sum(tl.where(above, ej[None, :], 0.0), axis=1)
    k_on = (k > 0) & (k < vocab_size)
    keep = live & (count_above < tl.where(k_on, k, _INT_MAX))
    z_kept = tl.sum(tl.where(keep, e, 0.0), axis=0)
    norm = tl.where(k_on, z_kept, z)
    p_on = top_p < 1.0
    keep = keep & (mass_above < tl.where(p_on, top_p * norm, float("inf")))
    m_on = min_p > 0.0
    keep = keep & (e >= tl.where(m_on, min_p, -1.0))
    greedy = t <= 0.0
    # The candidates decide when they hold the whole kept set.
    nucleus_inside = p_on & (tl.sum(e, axis=0) >= top_p * z)
    min_p_inside = m_on & (tl.exp(tau - big) <= min_p)
    decided = greedy | tl.where(k_on, n >= k, nucleus_inside | min_p_inside)
    noise = gumbel_noise(xi, seed, SAMPLE_BLOCK, FAST)
    score = tl.where(keep, xv + tl.where(greedy, 0.0, noise), float("-inf"))
    best = tl.max(score, axis=0)
    token = tl.min(tl.where(keep & (score == best), xi, _INT_MAX), axis=0)
    return token, decided


@triton.jit
def _ordered(x):
    """fp32 -> int32 in the same order (for a bisection over the values of a row)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _count_mass_at_least(row_ptr, t, vocab_size, key, big, BLOCK: tl.constexpr):
    """(how many entries of the row have ordered key >= `key`, the sum of their exp(x - big))."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), tl.int32)
    mass = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offs
        x = _scaled(tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")), t)
        hit = (_ordered(x) >= key) & (cols < vocab_size)
        count += hit.to(tl.int32)
        mass += tl.where(hit, tl.exp(x - big), 0.0)
    return tl.sum(count, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _bisect(row_ptr, t, vocab_size, big, floor_key, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest ordered key >= floor_key whose entries at or above number >= target (BY_MASS:
    hold exp(x - big) mass >= target). With a count target k from the lowest key, the key of the
    k-th largest entry."""
    lo = floor_key.to(tl.int64)  # the caller's floor satisfies the target
    hi = _ordered(big).to(tl.int64) + 1  # no entry is at or above
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        count, mass = _count_mass_at_least(row_ptr, t, vocab_size, mid.to(tl.int32), big, BLOCK)
        if (mass if BY_MASS else count) >= target:
            lo = mid
        else:
            hi = mid
    return lo.to(tl.int32)


@triton.jit
def _pick_from_row(row_ptr, t, k, top_p, min_p, seed, big, z, vocab_size, BLOCK: tl.constexpr,
                   SAMPLE_BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The same pick over the whole row (one program): the cut by bisection, then one scan."""
    k_on = (k > 0) & (k < vocab_size)
    # The cut: entries with key > cut_key are kept, and the first `ties` entries (by token id)
    # with key == cut_key. Start with everything.
    cut_key = tl.full((), -_INT_MAX - 1, tl.int32)
    ties = tl.full((), 0, tl.int32) + vocab_size
    norm = z
    if k_on:
        cut_key = _bisect(row_ptr, t, vocab_size, big, cut_key, k, False, BLOCK)
        above, mass_above = _count_mass_at_least(row_ptr, t, vocab_size, cut_key + 1, big, BLOCK)
        ties = k - above
        cut_x = tl.exp(tl.where(cut_key >= 0, cut_key, cut_key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True) - big)
        norm = mass_above + ties * cut_x
    if top_p < 1.0:
        target = top_p * norm
        p_key = _bisect(row_ptr, t, vocab_size, big, cut_key, target, True, BLOCK)
        if p_key > cut_key:
            cut_key = p_key
            ties = vocab_size
        p_above, p_mass_above = _count_mass_at_least(row_ptr, t, vocab_size, p_key + 1, big, BLOCK)
        p_x = tl.exp(tl.where(p_key >= 0, p_key, p_key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True) - big)
        # Tied entries at the cut are kept while the mass above them is < target.
        p_ties = tl.where(p_x > 0.0, tl.minimum(tl.maximum(tl.ceil((target - p_mass_above) / p_x), 1.0), 1e9), 1e9)
        p_ties = p_ties.to(tl.int32)
        if p_key == cut_key:
            ties = tl.minimum(ties, p_ties)
    floor_e = tl.where(min_p > 0.0, min_p, 0.0)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), _INT_MAX, tl.int32)
    seen_ties = tl.zeros((), tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offs
        valid = cols < vocab_size
        x = _scaled(tl.load(row_ptr + cols, mask=valid, other=float("-inf")), t)
        key = _ordered(x)
        tie = valid & (key == cut_key)
        tie_rank = seen_ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        seen_ties += tl.sum(tie.to(tl.int32), axis=0)
        keep = valid & ((key > cut_key) | (tie & (tie_rank < ties))) & (tl.exp(x - big) >= floor_e)
        score = tl.where(keep, x + tl.where(t <= 0.0, 0.0, gumbel_noise(cols, seed, SAMPLE_BLOCK, FAST)), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_idx, _INT_MAX), axis=0)


@triton.jit
def _pick_kernel(logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, tau_ptr, row_max_ptr, z_ptr,
                 count_ptr, cand_val_ptr, cand_idx_ptr, out_ptr, vocab_size, CAP_: tl.constexpr,
                 SMALL: tl.constexpr, PAIR: tl.constexpr, WIDE: tl.constexpr, SAMPLE_BLOCK: tl.constexpr,
                 FAST: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(count_ptr + row)
    t = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    tau = tl.load(tau_ptr + row)
    big = tl.load(row_max_ptr + row)
    z = tl.load(z_ptr + row)
    if n <= SMALL:
        token, decided = _pick_from_candidates(cand_val_ptr, cand_idx_ptr, row, n, t, k, top_p, min_p, seed, tau, big, z,
                                               vocab_size, SMALL, CAP_, PAIR, SAMPLE_BLOCK, FAST)
    elif n <= CAP_:
        token, decided = _pick_from_candidates(cand_val_ptr, cand_idx_ptr, row, n, t, k, top_p, min_p, seed, tau, big, z,
                                               vocab_size, CAP_, CAP_, PAIR, SAMPLE_BLOCK, FAST)
    else:
        token = n * 0
        decided = n < 0
    if not decided:
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        # A greedy row's argmax is in every kept set: its search is a plain scan.
        greedy = t <= 0.0
        token = _pick_from_row(row_ptr, t, tl.where(greedy, 0, k), tl.where(greedy, 1.0, top_p),
                               tl.where(greedy, 0.0, min_p), seed, big, z, vocab_size, WIDE, SAMPLE_BLOCK, FAST)
    # Nothing is kept only where the row has no finite score (NaN logits): still a token id the
    # embedding can read, so a broken row cannot take the device down with it.
    token = tl.minimum(token, vocab_size - 1)
    tl.store(out_ptr + row, token.to(tl.int64))
    # Ready for the next launch: the count back to 0 and the row maximum to -inf (a lister's
    # running maximum starts there: pick_listed). After a barrier: every warp loads them, and
    # one that had not yet would read the reset values.
    tl.debug_barrier()
    tl.store(count_ptr + row, 0)
    tl.store(row_max_ptr + row, float("-inf"))


class FilteredSampler:
    """`sampler(logits [B, V], temperature, top_k, top_p, min_p, seeds, out) -> out`: one token per
    row (see the module docstring). Per-row controls, all [B] on the logits' device:
    temperature float32 (<= 0: greedy), top_k int32 (<= 0 or >= V: off), top_p float32 (1: off),
    min_p float32 (0: off), seeds int64 (the Philox key of the row's Gumbel noise). out: [B]
    int64. The workspace is allocated here for up to `max_rows` rows, so one instance serves
    one stream of launches at a time (and its launches can be captured in a CUDA graph)."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str) -> None:
        if vocab_size < 1 or vocab_size >= 2**31 - WIDE_BLOCK:
            raise ValueError(f"FilteredSampler: vocab_size must be in [1, 2**31 - {WIDE_BLOCK}), got {vocab_size}")
        if max_rows < 1:
            raise ValueError(f"FilteredSampler: max_rows must be >= 1, got {max_rows}")
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.num_tiles = triton.cdiv(vocab_size, TILE)
        device = torch.device(device)
        self.fast_log = device.type == "cuda"
        f32 = dict(dtype=torch.float32, device=device)
        self.tile_max = torch.empty((max_rows, self.num_tiles), **f32)
        self.tile_sum = torch.empty((max_rows, self.num_tiles), **f32)
        self.tau = torch.empty(max_rows, **f32)
        self.row_max = torch.full((max_rows,), float("-inf"), **f32)  # the pick puts it back to -inf
        self.z = torch.ones(max_rows, **f32)
        self.count = torch.zeros(max_rows, dtype=torch.int32, device=device)  # the pick puts it back to 0
        self.cand_val = torch.empty((max_rows, CAP), **f32)
        self.cand_idx = torch.empty((max_rows, CAP), dtype=torch.int32, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self._programs = 4 * sms  # programs per scan launch, spread over the rows

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows, vocab = logits.shape
        if vocab != self.vocab_size or logits.stride(1) != 1:
            raise ValueError(f"FilteredSampler: logits must be [B, {self.vocab_size}] with contiguous rows, got {tuple(logits.shape)}")
        if rows > self.max_rows:
            raise ValueError(f"FilteredSampler: {rows} rows, at most {self.max_rows}")
        if out is None:
            out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if not rows:
            return out
        if compiling_only():  # a dry pass only compiles the kernels: still valid ids for what reads them
            out.zero_()
        per_row = max(1, self._programs // rows)
        tiles_per_prog = triton.cdiv(self.num_tiles, min(per_row, self.num_tiles))
        grid = (rows, triton.cdiv(self.num_tiles, tiles_per_prog))
        launch(_tile_stats_kernel, grid, logits, logits.stride(0), temperature, self.tile_max, self.tile_sum, vocab,
               self.num_tiles, tiles_per_prog, TILE_=TILE, num_warps=4)
        launch(_threshold_kernel, (rows,), self.tile_max, self.tile_sum, top_k, self.tau, self.row_max, self.z, vocab,
               self.num_tiles, TILES_P2=max(MIN_TILES_BLOCK, triton.next_power_of_2(self.num_tiles)),
               CANDIDATE_TILES_=CANDIDATE_TILES,
               num_warps=4)
        launch(_candidates_kernel, grid, logits, logits.stride(0), temperature, self.tau, self.count, self.cand_val,
               self.cand_idx, vocab, self.num_tiles, tiles_per_prog, TILE_=TILE, CAP_=CAP, num_warps=4)
        return self.pick_listed(logits, temperature, top_k, top_p, min_p, seeds, out)

    def pick_listed(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The last launch of a call (`_pick_kernel`) alone, over candidates another launch has
        listed in this sampler's workspace (`listing`), as `__call__` takes its arguments. The
        lister must have counted and stored every entry >= the row's tau (as x / temperature,
        at most CAP of them, the count past CAP where there are more), kept the row's maximum
        and a tau such that, with top-k on, the list holds the whole top k; the pick then
        searches `logits` only where the list overflowed."""
        rows, vocab = logits.shape
        launch(_pick_kernel, (rows,), logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, self.tau,
               self.row_max, self.z, self.count, self.cand_val, self.cand_idx, out, vocab, CAP_=CAP, SMALL=SMALL_CAP,
               PAIR=PAIR_BLOCK, WIDE=WIDE_BLOCK, SAMPLE_BLOCK=BLOCK_V, FAST=self.fast_log, num_warps=8)
        return out

    def listing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The workspace a lister fills for `pick_listed` (row 0's view of each): count ([1] int32,
        0 between picks), candidate values ([CAP] fp32) and ids ([CAP] int32), tau ([1] fp32) and
        the running row maximum ([1] fp32, -inf between picks)."""
        return self.count[:1], self.cand_val[0], self.cand_idx[0], self.tau[:1], self.row_max[:1]
