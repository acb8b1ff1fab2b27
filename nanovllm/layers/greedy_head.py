"""The LM head and the greedy argmax of one row in one kernel (the lone-sequence graphs).

Why: a lone greedy stream's step ends with the LM head (for Qwen3-0.6B a [151,936 x 1,024]
weight, 311 MB, read once per token: cuBLAS took 74.8 us on an H200, 4.2 TB/s), then an argmax
over the logits (fused_sampler.GreedyRow, 3.3 us) and, inside cuBLAS's call, a memset (0.7 us):
three launches in a row on the critical path of every token. Here each program multiplies a
block of BLOCK_V vocabulary rows with the hidden state, stores those logits (the sampler still
reads them for rows that are not plain greedy) and folds its best (value, row) into one 64-bit
key with an atomic max; the last program to arrive (an acq_rel count) writes the token and puts
the key and the count back for the next launch.

The key orders by the logit as the graph stores it (rounded to the logits' dtype), then by the
lower row: a float's bits, with the non-sign bits of negative values flipped, compare as signed
integers in the order of the floats; the low 32 bits hold 2**32 - 1 - row. So the token is
torch.argmax of the stored logits, lowest id on ties (-0.0 counts as +0.0, as == does; NaN
logits are not handled as torch does). The logits themselves agree with cuBLAS's to fp32
rounding of the sums (another order of the same products).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.precompile import launch

KEY_EMPTY = -(2**63)  # below every key


@triton.jit
def _greedy_head_kernel(h_ptr, w_ptr, logits_ptr, key_ptr, count_ptr, out_ptr, V,
                        K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < V
    acc = tl.zeros([BLOCK_V, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every chunk's loads issue at once
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        x = tl.load(h_ptr + cols, mask=cmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    logit = tl.sum(acc, axis=1).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + rows, logit, mask=rmask)
    v = tl.where(rmask, logit.to(tl.float32), float("-inf"))
    best = tl.max(v, axis=0)
    best_row = tl.min(tl.where(v == best, rows, 2**31 - 1), axis=0)
    best = tl.where(best == 0.0, 0.0, best)  # -0.0 -> +0.0
    bits = best.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (4294967295 - best_row.to(tl.int64))
    tl.atomic_max(key_ptr, key, sem="relaxed", scope="gpu")
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")  # releases the max above
    if arrived == n - 1:
        final = tl.atomic_xchg(key_ptr, -9223372036854775808, sem="relaxed", scope="gpu")
        tl.store(out_ptr, 4294967295 - (final & 4294967295))
        tl.store(count_ptr, 0)


class GreedyHead:
    """`head(hidden [1, K], out [1] int64) -> logits [1, V]`: logits = hidden @ weight.T (in
    hidden's dtype), and out = their argmax, lowest id on ties. One launch, graph-capturable:
    the key and the count live here and are reset by each launch's last program, so one
    instance serves one stream of launches at a time."""

    def __init__(self, weight: torch.Tensor, block_v: int = 16, block_k: int = 256, num_warps: int = 4) -> None:
        v, k = weight.shape
        if v >= 2**31 - block_v:
            raise ValueError(f"GreedyHead: a vocabulary of {v} rows does not fit 31-bit ids")
        if weight.stride(1) != 1 or weight.stride(0) != k:
            raise ValueError("GreedyHead: the weight must be contiguous")
        self.weight = weight
        self.vocab_size, self.hidden = v, k
        self.block_v, self.block_k, self.num_warps = block_v, min(block_k, triton.next_power_of_2(k)), num_warps
        self.programs = triton.cdiv(v, block_v)
        self.key = torch.full((1,), KEY_EMPTY, dtype=torch.int64, device=weight.device)
        self.count = torch.zeros(1, dtype=torch.int32, device=weight.device)

    def __call__(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if hidden.shape != (1, self.hidden) or hidden.stride(-1) != 1 or hidden.dtype != self.weight.dtype:
            raise ValueError(f"GreedyHead: hidden must be [1, {self.hidden}] {self.weight.dtype}, contiguous; "
                             f"got {tuple(hidden.shape)} {hidden.dtype}")
        logits = torch.empty((1, self.vocab_size), dtype=hidden.dtype, device=hidden.device)
        launch(_greedy_head_kernel, (self.programs,), hidden, self.weight, logits, self.key, self.count, out,
               self.vocab_size, K=self.hidden, BLOCK_V=self.block_v, BLOCK_K=self.block_k, num_warps=self.num_warps)
        return logits
