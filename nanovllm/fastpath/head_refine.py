"""A top-k stream's sample from the int8 LM head: the top rows' logits recomputed exactly and
listed for the filtered sampler's pick (the persistent kernel's bounds step, head.py's
_stage_head_q at BOUNDS_TEMPERATURE).

Why: a stream sampling with top-k (Qwen3's defaults: top_k 20, top_p 0.95, temperature 0.6)
needs its k largest logits exactly, not every logit, and the 16-bit LM head is the largest read
of a lone decode step (Qwen3-0.6B: 311 MB; the int8 copy is half). So a bounds step streams the
int8 copy and stores each row's lo <= logit <= hi (the logit rounded to the model's dtype, as the
16-bit head stores it; head_quant.py), lo in the logits buffer and hi beside it, and leaves each
program's largest lo in the kernel's per-program values. `HeadRefine` then takes

    tau = the k-th largest of the programs' largest lo (k = top_k, at most the programs): k
          rows have lo >= tau, so the k-th largest logit is >= tau;

recomputes from the 16-bit weight the logit of every row with hi >= tau, writes it over its lo,
and lists those whose logit is >= tau (divided by the temperature: a few more than k) for
FilteredSampler.pick_listed, with tau and the largest of them.

A row left at lo has lo <= hi < tau <= the k-th largest logit, and every row of the top k was
recomputed and listed: the list holds the logits' top k with their values, and the buffer's k
largest entries are the same. The filtered sampler keeps the top k first and takes top-p and
min-p within the top k's renormalised probabilities (its row maximum is the top one's), so it
draws from the list (or, where more rows than its list holds were recomputed, from the buffer)
the token it would draw from every logit. A top_k that is off or beyond the programs gives
tau = -inf: every row recomputed, exact but slow (the fast path sends such a stream to the
16-bit head instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.layers.filtered_sampler import CAP, FilteredSampler
from nanovllm.precompile import launch

# The record's temperature word that asks the persistent kernel for bounds (fastpath/graphs.py
# writes it; head.py reads it as "below -1.5").
BOUNDS_TEMPERATURE = -2.0
TILE = 512
# The programs' values are ranked in a block of at least this many (a block smaller than the
# program's threads ranks wrongly on the GPU).
MIN_BLOCK = 128
PROGRAMS_PER_SM = 4


@triton.jit(do_not_specialize=("num_parts", "num_tiles", "tiles_per_prog"))
def _refine_kernel(logits_ptr, hi_ptr, hidden_ptr, weight_ptr, part_ptr, temp_ptr, top_k_ptr, count_ptr, cand_val_ptr,
                   cand_idx_ptr, tau_ptr, row_max_ptr, vocab, num_parts, num_tiles, tiles_per_prog, H: tl.constexpr,
                   BLOCK_H: tl.constexpr, PARTS: tl.constexpr, TILE_: tl.constexpr, CAP_: tl.constexpr):
    k = tl.load(top_k_ptr)
    p = tl.arange(0, PARTS)
    ranked = tl.sort(tl.load(part_ptr + p, mask=p < num_parts, other=float("-inf")), descending=True)
    tau = tl.max(tl.where(p == k - 1, ranked, float("-inf")), axis=0)
    tau = tl.where((k >= 1) & (k <= num_parts), tau, float("-inf"))
    t = tl.load(temp_ptr)
    inv_t = 1.0 / tl.where(t > 0.0, t, 1.0)  # (filtered_sampler._scaled's rounding)
    prog = tl.program_id(0)
    if prog == 0:
        tl.store(tau_ptr, tau * inv_t)
    offs = tl.arange(0, BLOCK_H)
    hmask = offs < H
    x = tl.load(hidden_ptr + offs, mask=hmask, other=0.0).to(tl.float32)
    lanes = tl.arange(0, TILE_)
    first = prog * tiles_per_prog
    for tile in range(first, tl.minimum(num_tiles, first + tiles_per_prog)):
        cols = tile * TILE_ + lanes
        live = cols < vocab
        hit = live & (tl.load(hi_ptr + cols, mask=live, other=float("-inf")).to(tl.float32) >= tau)
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        for j in range(0, tl.sum(hit.to(tl.int32), axis=0)):
            row = tl.sum(tl.where(hit & (rank == j), cols, 0), axis=0)
            w = tl.load(weight_ptr + row.to(tl.int64) * H + offs, mask=hmask, other=0.0)
            logit = tl.sum(w.to(tl.float32) * x, axis=0).to(logits_ptr.dtype.element_ty)
            tl.store(logits_ptr + row, logit)
            if logit.to(tl.float32) >= tau:  # (below tau: not in the top k, whatever its bound said)
                scaled = logit.to(tl.float32) * inv_t
                pos = tl.atomic_add(count_ptr, 1)
                tl.store(cand_val_ptr + pos, scaled, mask=pos < CAP_)
                tl.store(cand_idx_ptr + pos, row, mask=pos < CAP_)
                tl.atomic_max(row_max_ptr, scaled)


class HeadRefine:
    """`refine(temperature, top_k)` after a bounds step: `logits` ([1, V], each row's lower bound)
    made exact where a top-k sample can look, and those rows listed in `sampler`'s workspace for
    its pick_listed (the module docstring). From the upper bounds `hi` ([1, V]), the head's
    input `hidden` ([1, H] or [H], the final norm's output), the 16-bit head `weight` ([V, H])
    and the programs' largest lower bounds `parts` ([P] fp32); temperature: [1] fp32 (the
    stream's), top_k: [1] int32. One graph-capturable launch, no host sync."""

    def __init__(self, logits: torch.Tensor, hi: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                 parts: torch.Tensor, sampler: FilteredSampler) -> None:
        vocab, h = weight.shape
        if logits.numel() != vocab or hi.numel() != vocab or hidden.numel() != h or not weight.is_contiguous():
            raise ValueError(f"HeadRefine: logits and hi of {vocab}, hidden of {h} and a contiguous [{vocab}, {h}] "
                             f"weight, got {tuple(logits.shape)}, {tuple(hi.shape)}, {tuple(hidden.shape)}")
        if sampler.vocab_size != vocab:
            raise ValueError(f"HeadRefine: the sampler's vocabulary is {sampler.vocab_size}, the head's {vocab}")
        self.logits, self.hi, self.hidden, self.weight, self.parts = logits, hi, hidden, weight, parts
        self.listing = sampler.listing()
        self.vocab, self.h = vocab, h
        self.num_tiles = triton.cdiv(vocab, TILE)
        device = weight.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        # Several programs per SM, so that a tile's serial recomputes are the launch's whole wait.
        self.tiles_per_prog = triton.cdiv(self.num_tiles, min(PROGRAMS_PER_SM * sms, self.num_tiles))

    def __call__(self, temperature: torch.Tensor, top_k: torch.Tensor) -> None:
        grid = (triton.cdiv(self.num_tiles, self.tiles_per_prog),)
        launch(_refine_kernel, grid, self.logits, self.hi, self.hidden, self.weight, self.parts, temperature, top_k,
               *self.listing, self.vocab, self.parts.numel(), self.num_tiles, self.tiles_per_prog, H=self.h,
               BLOCK_H=max(MIN_BLOCK, triton.next_power_of_2(self.h)),
               PARTS=max(MIN_BLOCK, triton.next_power_of_2(self.parts.numel())), TILE_=TILE, CAP_=CAP, num_warps=4)
