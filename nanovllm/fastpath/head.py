"""The persistent decode kernel's last stage (kernel.py, FUSED_HEAD): the LM
head and the greedy argmax of the step, after the last layer, or a temperature sample.

Why in the kernel: after the layers, a lone greedy stream's step would be three more launches
on its critical path (cuBLAS's LM head, a memset, the argmax). Here the programs that just
finished the last layer stream the head's rows through the same shared-memory slots the
layers' weights came through (the first chunks copied during the last layer's barrier) and
multiply them on the tensor cores with the layers' program; the argmax is a count whose last
arrival picks the best part.

Sampling here too (a temperature above 0 in the step's input record): each row's score is its
logit / temperature plus the Gumbel noise fused_sampler.gumbel_argmax would add to it
(`gumbel_score`: the same Philox counter per column), so the best score is the token that
sampler draws from these logits. A stream with only a temperature then decodes in bursts of
steps in one graph, as a greedy one does, instead of sampling after each step's graph.

A step whose token the kernel picks (greedy, or a plain temperature) reads the head's int8
copy instead (`quantized_head`, head_quant.py: half the bytes, each row's logit with a bound on
its error), then recomputes from the 16-bit weight only the rows whose bound reaches the best
lower bound of their program's rows: the same token, no logits stored. Those rows are listed
in one scan of the program's rows (each thread a few consecutive ones), and the programs share
their best lower bounds (a sync word, an atomic max; published every 4 chunks and at the
stream's end), so that each lists only rows that reach the largest one published and most
programs recompute nothing. A step whose sampler needs every logit (top-k/p, logprobs, banned
ids) asks for them with a temperature below 0 and gets the 16-bit head.

Why a module of its own: as attention.py, one stage of the kernel; Triton
inlines every jit function into the one kernel, so the split costs nothing at run time.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.layers.fused_sampler import best_part, gumbel_noise, gumbel_score
from nanovllm.fastpath.common import _embed_rows, _normed_input, _stamp
from nanovllm.fastpath.ptx import (
    bulk_copy, loop_zero, mbarrier_wait, mma_rows, prefetch_l2, shared_f32, shared_i32, stage_f32_to_shared, stage_i32_to_shared,
    stage_to_shared,
)


@triton.jit
def _shared_bound_read(word_ptr):
    """The best lower bound any program has published this step at word_ptr (_shared_bound_publish),
    as a [1] fp32 tensor; NaN where none has (every comparison with it is then false). A relaxed load: a stale
    value is an older, smaller bound, still a real row's lower bound."""
    k = tl.inline_asm_elementwise(
        "{ .reg .u32 k; .reg .pred n; ld.relaxed.gpu.global.u32 k, [$1]; setp.lt.s32 n, k, 0; "
        "and.b32 $0, k, 0x7FFFFFFF; @!n not.b32 $0, k; }",
        "=r,l", [(word_ptr + tl.zeros([1], tl.int32)).to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    return k.to(tl.float32, bitcast=True)


@triton.jit
def _shared_bound_publish(word_ptr, bound):
    """Thread 0: fold `bound` (fp32, not NaN) into the word at word_ptr with an atomic max of its
    order-preserving key (sign bit set for a number >= 0, else every bit flipped: 0, the zeroed
    word, stays below every number's key). Nothing waits for it."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, n; .reg .u32 t, b, k; .reg .f32 f; mov.u32 t, %tid.x; mov.b32 f, $2; "
        "setp.eq.u32 p, t, 0; setp.num.and.f32 p, f, f, p; mov.b32 b, f; setp.lt.s32 n, b, 0; "
        "or.b32 k, b, 0x80000000; @n not.b32 k, b; @p red.relaxed.gpu.global.max.u32 [$1], k; mov.u32 $0, 0; }",
        "=r,l,f", [(word_ptr + tl.zeros([1], tl.int32)).to(tl.int64), bound + tl.zeros([1], tl.float32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_rows(c, pid, rows_per_program, V, CR: tl.constexpr):
    """(first row, rows) of chunk c (CR vocabulary rows) of this program's rows; 0 rows past
    them (the chunk's copy is then empty, and its mbarrier phase still completes)."""
    first = pid * rows_per_program
    row0 = first + c * CR
    end = tl.minimum(first + rows_per_program, V)
    return row0, tl.maximum(tl.minimum(end - row0, CR), 0)


@triton.jit
def _issue_head_chunk(c, base_ptr, head_off, slot, bar, pid, rows_per_program, V, CR: tl.constexpr, H: tl.constexpr):
    """FUSED_HEAD: copy chunk c of this program's rows of the LM head weight (_chunk_rows) into
    `slot`, counted at `bar`."""
    ESIZE: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    row0, rows = _chunk_rows(c, pid, rows_per_program, V, CR)
    src = base_ptr + tl.multiple_of(head_off, 16) + row0.to(tl.int64) * H
    bulk_copy(bar, slot, src, rows * (H * ESIZE), slot, src, 0)


@triton.jit
def _head_buffer(c, slot_x, slot_y, bar_x, bar_y, PX: tl.constexpr, PY: tl.constexpr):
    """FUSED_HEAD: (shared address, mbarrier, phase parity) of the slot that holds the LM head's
    chunk c: X and Y in turn. PX, PY: the parity of the first head phase of X's and Y's
    mbarriers (one phase per copy the layers made before)."""
    in_x = c % 2 == 0
    use = c // 2
    return tl.where(in_x, slot_x, slot_y), tl.where(in_x, bar_x, bar_y), tl.where(in_x, PX + use, PY + use) % 2


@triton.jit
def _stage_head(
    base_ptr, head_off, post_ptr, acc_ptr, final_norm_ptr, eps, logits_ptr, pid, rows_per_program, V, slot_x, slot_y,
    bar_x, bar_y, xbuf, red, H: tl.constexpr, BLOCK_X: tl.constexpr, COPIES: tl.constexpr, THREADS: tl.constexpr,
    CR: tl.constexpr, PX: tl.constexpr, PY: tl.constexpr, MMA_HEAD: tl.constexpr, temp_ptr, seed_ptr,
    SAMPLE_BLOCK: tl.constexpr, out_ptr, rows_h, IN_LOOP: tl.constexpr = False,
):
    """FUSED_HEAD: the LM head and the greedy argmax, after the last layer. Every program norms
    the residual stream itself (the final RMSNorm, staged at xbuf as stage A stages its input),
    then multiplies its rows_per_program vocabulary rows, CR at a time, from slots X and Y in
    turn (_head_buffer; chunks 0 and 1 were issued during the last layer's barrier; each
    chunk's slot takes chunk c + 2 once it is multiplied): the copies stream the weight while
    the tensor cores keep up. It stores the logits (rounded to their dtype) and keeps, per
    thread, the best (value, lowest row), and returns the program's best (value, lowest row) for
    the argmax across programs (_pick_token). A temperature
    above 0 at temp_ptr samples instead: the best of logit / temperature plus the Gumbel noise
    that fused_sampler.gumbel_argmax (tiles of SAMPLE_BLOCK) would add under the seed at
    seed_ptr, so the token is the one gumbel_argmax would draw from the stored logits.
    """
    dtype = logits_ptr.dtype.element_ty
    _head_input(post_ptr, acc_ptr, final_norm_ptr, eps, out_ptr, pid, rows_h, xbuf, H, BLOCK_X, dtype, COPIES, False,
                1.0, IN_LOOP)
    t = tl.arange(0, THREADS) + loop_zero(IN_LOOP)  # (see _head_input)
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
    return top, tl.min(tl.where(best_val == top, best_row, 2**31 - 1), axis=0)


@triton.jit
def _head_input(post_ptr, acc_ptr, final_norm_ptr, eps, out_ptr, pid, rows_h, xbuf, H: tl.constexpr,
                BLOCK_X: tl.constexpr, dtype: tl.constexpr, COPIES: tl.constexpr, FP16_SCALED: tl.constexpr,
                X_SCALE: tl.constexpr = 1.0, IN_LOOP: tl.constexpr = False):
    """The head's input: the final RMSNorm of the residual stream, which every program computes
    whole (returned, fp32 of the dtype's values) and stages at xbuf for the tensor-core program
    (FP16_SCALED: times X_SCALE in fp16, for the int8 head's program); the program's own rows_h
    rows of it also go to out_ptr, the kernel's hidden-state output (in place of a final-norm
    stage: one L2 round trip less before the head). IN_LOOP: the head runs inside the kernel's
    loop of decode steps (MULTI_STEP), whose aranges get loop_zero added."""
    offs = tl.arange(0, BLOCK_X) + loop_zero(IN_LOOP)
    xmask = offs < H
    x = _normed_input(post_ptr, acc_ptr, final_norm_ptr, eps, offs, xmask, H, dtype, COPIES)
    if FP16_SCALED:
        stage_to_shared((x.to(tl.float32) * X_SCALE).to(tl.float16), offs, xmask, xbuf)
    else:
        stage_to_shared(x, offs, xmask, xbuf)
    mine = xmask & (offs >= pid * rows_h) & (offs < (pid + 1) * rows_h)
    tl.store(out_ptr + offs, x, mask=mine)
    return x.to(tl.float32)


@triton.jit
def _pick_token(top, top_row, next_tok_ptr, part_val_ptr, part_idx_ptr, sync_ptr, sync_n, pid, num_programs,
                PARTS: tl.constexpr, MULTI_STEP: tl.constexpr = False, more=False, step=0, emb_ptr=None, post_ptr=None,
                acc_ptr=None, H: tl.constexpr = 1, BLOCK_H: tl.constexpr = 1, COPIES: tl.constexpr = 0):
    """Store this program's best (value, row) and count it in; the last program to arrive (acq_rel
    count, the last of the sync_n sync words) writes the winner, lowest row on ties, to next_tok
    and zeroes the sync words for the next launch (or step), and the int8 head's shared bound
    (sync word sync_n + 1, _stage_head_q: every program read it before it counted in).

    MULTI_STEP (a decode burst in one launch, this is its step `step`): where another step
    follows (`more`), the last program also does what the next launch's embedding stage would:
    the token's embedding row (at emb_ptr) becomes the residual stream at post_ptr and the
    down sums' COPIES accumulators at acc_ptr are zeroed; then it counts step + 1 into the step
    word (sync word sync_n, release), for which every other program waits (the caller: acquire).
    That replaces the launch's end, the next launch's start and prologue, its embedding stage and
    that stage's barrier. After the last step the step word goes back to 0. Returns whether this
    program was the last."""
    tl.store(part_val_ptr + pid, top)
    tl.store(part_idx_ptr + pid, top_row)
    arrived = tl.atomic_add(sync_ptr + sync_n - 1, 1, sem="acq_rel", scope="gpu")  # the last sync word
    last = arrived == num_programs - 1
    if last:
        token = best_part(part_val_ptr, part_idx_ptr, num_programs, PARTS).to(tl.int64)
        tl.store(next_tok_ptr, token)
        # Every program has passed every barrier and count of this launch: put them back to 0 for
        # the next one (which then needs no memset before it).
        offs = tl.arange(0, PARTS) + loop_zero(MULTI_STEP)  # (see _head_input)
        for z in range(0, sync_n, PARTS):
            tl.store(sync_ptr + z + offs, tl.zeros([PARTS], tl.int32), mask=z + offs < sync_n)
        tl.store(sync_ptr + sync_n + 1, 0)
        if MULTI_STEP:
            if more:
                offs_h = tl.arange(0, BLOCK_H) + loop_zero(MULTI_STEP)
                _embed_rows(emb_ptr, token, post_ptr, acc_ptr, offs_h, offs_h < H, H, COPIES)
                tl.debug_barrier()  # every thread's stores before the release
                tl.atomic_add(sync_ptr + sync_n, 1, sem="release", scope="gpu")
            else:
                tl.store(sync_ptr + sync_n, 0)
    return last


@triton.jit
def _tokens_out(tok_ptr, next_tok_ptr, out_ptr, steps, rec8, BLOCK: tl.constexpr = 16):
    """The launch's `steps` tokens in step order into out_ptr (pinned host memory, where the
    runner reads them once the launch is done: no copy after the launch delays the next burst).
    Step i <
    steps - 1 wrote its token into step i + 1's input record (tok_ptr + (i + 1) * rec8 int64
    words), the last step into next_tok_ptr. Run by the program that picked the last token,
    after the launch's last step: nothing waits for these stores but the launch's end."""
    final = tl.load(next_tok_ptr)
    for z in range(0, steps, BLOCK):
        i = z + tl.arange(0, BLOCK)
        earlier = tl.load(tok_ptr + (i + 1) * rec8, mask=i + 1 < steps, other=0)
        tl.store(out_ptr + i, tl.where(i == steps - 1, final, earlier), mask=i < steps)


@triton.jit
def _issue_head_q_chunk(c, q_ptr, meta_ptr, slot, bar, meta, pid, rows_per_program, V, CR: tl.constexpr,
                        H: tl.constexpr):
    """The quantized head: copy chunk c (CR rows) of this program's rows of the int8 head into
    `slot`, and the same rows of the head's meta ([V, 4] fp32: scale, bound terms, and a word for
    each row's upper bound) to their place in the program's meta at shared address `meta` (in
    slot X, where they stay through the head), both counted at `bar`. (All the meta with chunk 0,
    18 KB for Qwen3-0.6B, delayed the first chunk.) Past the program's rows the copies are empty."""
    row0, rows = _chunk_rows(c, pid, rows_per_program, V, CR)
    bulk_copy(bar, slot, q_ptr + row0.to(tl.int64) * H, rows * H, meta + c * (CR * 16), meta_ptr + row0.to(tl.int64) * 4,
              rows * 16)


@triton.jit
def _stage_head_q(
    base_ptr, head_off, q_ptr, meta_ptr, post_ptr, acc_ptr, final_norm_ptr, eps, pid, num_programs, rows_per_program, V,
    slot_x, slot_y, bar_x, bar_y, xbuf, red, H: tl.constexpr, BLOCK_X: tl.constexpr, COPIES: tl.constexpr,
    THREADS: tl.constexpr, CR: tl.constexpr, PX: tl.constexpr, PY: tl.constexpr, MMA_HEAD_Q: tl.constexpr, temp_ptr, seed_ptr,
    SAMPLE_BLOCK: tl.constexpr, META_OFF: tl.constexpr, CAND_OFF: tl.constexpr, CAP: tl.constexpr, NC: tl.constexpr,
    X_SCALE: tl.constexpr, out_ptr, rows_h, probe_row, probe_half, PROBE: tl.constexpr, LR: tl.constexpr,
    bound_ptr, lo_ptr, hi_ptr, IN_LOOP: tl.constexpr = False,
):
    """The LM head's pick from its int8 copy (head_quant.py), the same token _stage_head
    would pick. Every program norms the residual stream (x, the model's dtype) and stages x *
    X_SCALE in fp16 for the int8 tensor-core program (MMA_HEAD_Q), then takes its rows CR at a
    time from slots X and Y in turn, as _stage_head does (half the bytes per row). Per row: the
    approximate logit a and its bound b (head_quant), the bounds rounded to the dtype as the
    logits are, lo and hi (plus the row's Gumbel noise at a temperature above 0: a score only
    grows with the logit); hi goes to the row's meta word, and tau is the program's best lo.
    Only a row with hi >= tau can be the program's best; those candidates (a handful) are
    listed in shared memory (CAP at a time; more take another round), and their logits
    recomputed from the 16-bit weight at head_off, NC rows per load, in fp32 and rounded to the
    dtype. Their best (value, row) is returned: the program's part in the argmax (_pick_token). No
    logits are stored.

    tau is also shared: each program publishes its best lower bound at bound_ptr (an atomic max,
    every 4 chunks and at the stream's end) and lists against the largest published so far
    where that is higher. A row whose upper bound is below another program's best lower bound
    cannot be the step's token, so most programs, and most often the late ones, whose end the
    step waits for, list no row and recompute nothing. A program with no candidate returns (-inf, 0), which loses to the
    program that published the bound (its own row has hi >= lo = that bound).

    A temperature of -2 (BOUNDS: a top-k sample follows, head_refine.py) stores every row's lo
    and hi (rounded to the dtype, no noise) at lo_ptr and hi_ptr instead, lists and recomputes
    nothing, and returns the program's best lo (with its first row) for the caller's part."""
    dtype = base_ptr.dtype.element_ty
    z = loop_zero(IN_LOOP)  # added to every arange: see _head_input
    offs = tl.arange(0, BLOCK_X) + z
    xmask = offs < H
    x = _head_input(post_ptr, acc_ptr, final_norm_ptr, eps, out_ptr, pid, rows_h, xbuf, H, BLOCK_X, dtype, COPIES, True,
                    X_SCALE, IN_LOOP)
    nx = tl.sqrt(tl.sum(x * x, axis=0)) * (1.0 + 2.0**-10)
    t = tl.arange(0, THREADS) + z
    first = pid * rows_per_program
    nrows = tl.minimum(rows_per_program, V - first)
    temperature = tl.load(temp_ptr)
    sampled = temperature > 0.0
    bounds = temperature < -1.5
    inv_t = 1.0 / tl.where(sampled, temperature, 1.0)
    seed = tl.load(seed_ptr)
    meta = slot_x + META_OFF
    best_lo = tl.full([THREADS], float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(rows_per_program, CR)):
        slot, bar, parity = _head_buffer(c, slot_x, slot_y, bar_x, bar_y, PX, PY)
        mbarrier_wait(bar, parity)
        tl.debug_barrier()  # the staged input (or the previous chunk's reads of `red`)
        acc, _ = mma_rows(MMA_HEAD_Q, slot, xbuf, red, THREADS)
        _issue_head_q_chunk(c + 2, q_ptr, meta_ptr, slot, bar, meta, pid, rows_per_program, V, CR, H)
        local = c * CR + t
        valid = (t < CR) & (local < nrows)
        a = acc * shared_f32(local * 4, valid, meta)
        b = ((shared_f32(local * 4 + 1, valid, meta) * nx + shared_f32(local * 4 + 2, valid, meta)) * (1.0 + 2.0**-16)
             + tl.abs(a) * 2.0**-20)
        lo = (a - b).to(dtype).to(tl.float32)
        hi = (a + b).to(dtype).to(tl.float32)
        if sampled:  # (the same for every thread: no divergence)
            noise = gumbel_noise(first + local, seed, SAMPLE_BLOCK, True)
            lo = lo * inv_t + noise
            hi = hi * inv_t + noise
        if bounds:  # (the same for every thread)
            tl.store(lo_ptr + first + local, lo.to(dtype), mask=valid)
            tl.store(hi_ptr + first + local, hi.to(dtype), mask=valid)
        stage_f32_to_shared(hi, local * 4 + 3, valid, meta)
        best_lo = tl.maximum(best_lo, tl.where(valid, lo, float("-inf")))
        if c % 4 == 3:  # published along the way too, for the programs whose streams end first
            _shared_bound_publish(bound_ptr, tl.max(best_lo, axis=0))
    shared = _shared_bound_read(bound_ptr)  # (issued before the block's max below, which hides its latency)
    tau = tl.max(best_lo, axis=0)
    own_lo = tau
    _shared_bound_publish(bound_ptr, tau)
    tau = tl.max(tl.where(shared > tau, shared, tau), axis=0)
    tau = tl.where(bounds, float("inf"), tau)  # BOUNDS: list nothing
    _stamp(probe_row, 7, num_programs, probe_half, PROBE)  # (layer 0's free points: see _decode_kernel)
    tl.debug_barrier()  # every row's hi stored
    cand = slot_x + CAND_OFF
    head_w = base_ptr + tl.multiple_of(head_off, 16)
    ESIZE: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    best_val = float("-inf")
    best_row = 0  # (kept only if no row beats -inf, e.g. NaN logits: token 0, as _stage_head gives)
    jr = tl.arange(0, LR) + z
    start = 0
    while start < nrows:
        n = 0
        last = -1
        # Thread t lists rows t * LR .. t * LR + LR - 1 of each block, in order: one scan of the
        # threads' counts places them (one block of THREADS * LR rows for Qwen3-0.6B on 132 SMs).
        for r0 in range(0, rows_per_program, THREADS * LR):
            local = r0 + t[:, None] * LR + jr[None, :]
            live = (local >= start) & (local < nrows)
            take = live & (shared_f32(local * 4 + 3, live, meta) >= tau)
            k = take.to(tl.int32)
            per_thread = tl.sum(k, axis=1)
            pos = n + (tl.cumsum(per_thread, axis=0) - per_thread)[:, None] + tl.cumsum(k, axis=1) - k
            keep = take & (pos < CAP)
            stage_i32_to_shared(local, pos, keep, cand)
            last = tl.maximum(last, tl.max(tl.max(tl.where(keep, local, -1), axis=1), axis=0))
            n += tl.sum(per_thread, axis=0)
        tl.debug_barrier()  # the list stored
        listed = tl.minimum(n, CAP)
        if listed > NC:  # the rows of the recomputes after the first on their way to the L2 with the first's
            for p0 in range(NC, listed, THREADS):
                ahead = p0 + t < listed
                prefetch_l2(head_w + (first + shared_i32(p0 + t, ahead, cand)).to(tl.int64) * H, H * ESIZE, ahead)
        for i in range(0, listed, NC):
            j = i + tl.arange(0, NC) + z
            jv = j < listed
            rows = first + shared_i32(j, jv, cand)
            w = tl.load(head_w + rows.to(tl.int64)[:, None] * H + offs[None, :], mask=jv[:, None] & xmask[None, :],
                        other=0.0)
            v = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(dtype).to(tl.float32)
            if sampled:
                v = gumbel_score(v, rows, inv_t, seed, SAMPLE_BLOCK, True)
            v = tl.where(jv, v, float("-inf"))
            top = tl.max(v, axis=0)
            top_row = tl.min(tl.where(v == top, rows, 2**31 - 1), axis=0)
            better = top > best_val  # the list only grows in rows: ties keep the lower row
            best_val = tl.where(better, top, best_val)
            best_row = tl.where(better, top_row, best_row)
        start = tl.where(n > CAP, last + 1, nrows)
        tl.debug_barrier()  # the list read before the next round rewrites it
    _stamp(probe_row, 13, num_programs, probe_half, PROBE)
    return tl.where(bounds, own_lo, best_val), tl.where(bounds, first, best_row)
