"""The persistent decode kernel's last stage (runner/persistent_decode.py, FUSED_HEAD): the LM
head and the greedy argmax of the step, after the last layer, or a temperature sample.

Why in the kernel: after the layers, a lone greedy stream's step was three more launches on its
critical path, cuBLAS's LM head (for Qwen3-0.6B a [151,936 x 1,024] weight, 311 MB: 74.8 us on
an H200), a memset inside it and the argmax (fused_sampler.GreedyRow, 3.3 us). Here the
programs that just finished the last layer stream the head's rows through the same
shared-memory slots the layers' weights came through (the first chunks copied during the last
layer's barrier) and multiply them on the tensor cores with the layers' program; the argmax is
a count whose last arrival picks the best part. W5 1,855 -> 1,871-1,877 tok/s (H200, session 16,
docs/benchmarks.md); eager launches at context 384: 472 us without the head, 533-537 with it
(the weight's bytes alone take 65 us at 4.8 TB/s).

Sampling here too (a temperature above 0 in the step's input record): each row's score is its
logit / temperature plus the Gumbel noise fused_sampler.gumbel_argmax would add to it
(`gumbel_score`: the same Philox counter per column), so the best score is the token that
sampler draws from these logits. A stream with only a temperature then decodes in bursts of
steps in one graph, as a greedy one does: at temperature 0.7 on an H200, 1,579 -> 1,859 tok/s
(it sampled after each step's graph, from the logits, with ~6 small launches; session 17).

Why a module of its own: as runner/persistent_attention.py, one stage of the kernel; Triton
inlines every jit function into the one kernel, so the split costs nothing at run time.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.layers.fused_sampler import best_part, gumbel_score
from nanovllm.runner.persistent_common import _normed_to_shared
from nanovllm.runner.ptx import bulk_copy, mbarrier_wait, mma_rows


@triton.jit
def _issue_head_chunk(c, base_ptr, head_off, slot, bar, pid, rows_per_program, V, CR: tl.constexpr, H: tl.constexpr):
    """FUSED_HEAD: copy chunk c (CR vocabulary rows) of this program's rows of the LM head weight
    into `slot`, counted at `bar`; past the program's rows the copy is empty (the phase still
    completes)."""
    ESIZE: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    first = pid * rows_per_program
    row0 = first + c * CR
    end = tl.minimum(first + rows_per_program, V)
    nbytes = tl.maximum(tl.minimum(end - row0, CR), 0) * (H * ESIZE)
    src = base_ptr + tl.multiple_of(head_off, 16) + row0.to(tl.int64) * H
    bulk_copy(bar, slot, src, nbytes, slot, src, 0)


@triton.jit
def _head_buffer(c, slot_x, slot_y, bar_x, bar_y, PX: tl.constexpr, PY: tl.constexpr):
    """FUSED_HEAD: (shared address, mbarrier, phase parity) of the slot that holds the LM head's
    chunk c: X and Y in turn. PX, PY: the parity of the first head phase of X's and Y's
    mbarriers (one phase per copy the layers made before). (A third buffer, X's second half with
    a mbarrier of its own, was no faster: W5 1,868 against 1,871 tok/s on the H200.)"""
    in_x = c % 2 == 0
    use = c // 2
    return tl.where(in_x, slot_x, slot_y), tl.where(in_x, bar_x, bar_y), tl.where(in_x, PX + use, PY + use) % 2


@triton.jit
def _stage_head(
    base_ptr, head_off, post_ptr, acc_ptr, final_norm_ptr, eps, logits_ptr, next_tok_ptr, part_val_ptr, part_idx_ptr,
    sync_ptr, sync_n, pid, num_programs, rows_per_program, V, slot_x, slot_y, bar_x, bar_y, xbuf, red,
    H: tl.constexpr, BLOCK_X: tl.constexpr, COPIES: tl.constexpr, THREADS: tl.constexpr, CR: tl.constexpr,
    PX: tl.constexpr, PY: tl.constexpr, MMA_HEAD: tl.constexpr, PARTS: tl.constexpr, temp_ptr, seed_ptr,
    SAMPLE_BLOCK: tl.constexpr,
):
    """FUSED_HEAD: the LM head and the greedy argmax, after the last layer. Every program norms
    the residual stream itself (the final RMSNorm, staged at xbuf as stage A stages its input),
    then multiplies its rows_per_program vocabulary rows, CR at a time, from slots X and Y in
    turn (_head_buffer; chunks 0 and 1 were issued during the last layer's barrier; each
    chunk's slot takes chunk c + 2 once it is multiplied): the copies stream the weight while
    the tensor cores keep up. It stores the logits (rounded to their dtype) and keeps, per
    thread, the best (value, lowest row); the program's best goes to part_val/part_idx, and the
    last program to arrive (acq_rel count, the last of the sync_n sync words) writes the winner,
    lowest row on ties, to next_tok, and zeroes the sync words for the next launch. A temperature
    above 0 at temp_ptr samples instead: the best of logit / temperature plus the Gumbel noise
    that fused_sampler.gumbel_argmax (tiles of SAMPLE_BLOCK) would add under the seed at
    seed_ptr, so the token is the one gumbel_argmax would draw from the stored logits.
    """
    dtype = logits_ptr.dtype.element_ty
    _normed_to_shared(post_ptr, acc_ptr, final_norm_ptr, eps, xbuf, H, BLOCK_X, dtype, COPIES)
    t = tl.arange(0, THREADS)
    best_val = tl.full([THREADS], float("-inf"), tl.float32)
    best_row = tl.zeros([THREADS], tl.int32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, V)
    temperature = tl.load(temp_ptr)
    sampled = temperature > 0.0
    inv_t = 1.0 / tl.where(sampled, temperature, 1.0)
    seed = tl.load(seed_ptr)
    for c in range(0, tl.cdiv(rows_per_program, CR)):
        slot, bar, parity = _head_buffer(c, slot_x, slot_y, bar_x, bar_y, PX, PY)
        mbarrier_wait(bar, parity)
        tl.debug_barrier()  # the staged input (or the previous chunk's reads of `red`)
        acc, _ = mma_rows(MMA_HEAD, slot, xbuf, red, THREADS)
        # mma_rows ends with a CTA barrier after every read of the slot: it takes chunk c + 2
        _issue_head_chunk(c + 2, base_ptr, head_off, slot, bar, pid, rows_per_program, V, CR, H)
        rows = first + c * CR + t
        valid = (t < CR) & (rows < end)
        logit = acc.to(dtype)
        tl.store(logits_ptr + rows, logit, mask=valid)
        v = logit.to(tl.float32)
        if sampled:  # (the same for every thread: no divergence)
            v = gumbel_score(v, rows, inv_t, seed, SAMPLE_BLOCK, True)
        v = tl.where(valid, v, float("-inf"))
        better = v > best_val  # rows only grow: ties keep the lower row
        best_val = tl.where(better, v, best_val)
        best_row = tl.where(better, rows, best_row)
    top = tl.max(best_val, axis=0)
    tl.store(part_val_ptr + pid, top)
    tl.store(part_idx_ptr + pid, tl.min(tl.where(best_val == top, best_row, 2**31 - 1), axis=0))
    arrived = tl.atomic_add(sync_ptr + sync_n - 1, 1, sem="acq_rel", scope="gpu")  # the last sync word
    if arrived == num_programs - 1:
        tl.store(next_tok_ptr, best_part(part_val_ptr, part_idx_ptr, num_programs, PARTS).to(tl.int64))
        # Every program has passed every barrier and count of this launch: put them back to 0 for
        # the next one (which then needs no memset before it).
        offs = tl.arange(0, PARTS)
        for z in range(0, sync_n, PARTS):
            tl.store(sync_ptr + z + offs, tl.zeros([PARTS], tl.int32), mask=z + offs < sync_n)
