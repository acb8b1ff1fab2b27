"""The projection, MLP, embedding and final-norm stages of the persistent decode kernel, and
the per-layer stage dispatch (`_layer_stage`) that both the persistent launch and the stepwise
launches run (kernel.py says how the stages fit together)."""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.fastpath.attention import _stage_attention, _stage_attn_o
from nanovllm.fastpath.common import (
    F_DOWN_T, F_DOWN_W, F_GU_W, F_LN1, F_LN2, F_O_PERM, F_O_W, F_QKV_B, F_QKV_W, _at, _embed_rows, _item_rows, _next_layer,
    _normed_to_shared, _residual, _rows, _tile_columns, _weight_tile, _zero_acc,
)
from nanovllm.fastpath.ptx import (
    bulk_copy, down_rows, mbarrier_wait, mma_rows, slot_tile, stage_f32_to_shared, stage_to_shared,
)


@triton.jit
def _rstd(resid_ptr, acc_ptr, eps, H: tl.constexpr, BLOCK_K: tl.constexpr, COPIES: tl.constexpr = 0):
    """1 / sqrt(mean(x^2) + eps) of the residual stream (COPIES: see _residual)."""
    sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = _residual(resid_ptr, acc_ptr, offs, offs < H, H, COPIES)
        sq += x * x
    return tl.rsqrt(tl.sum(sq, axis=0) * (1.0 / H) + eps)


@triton.jit
def _normed(resid_ptr, acc_ptr, w_ptr, offs, mask, rstd, dtype: tl.constexpr, H: tl.constexpr, COPIES: tl.constexpr = 0):
    """One chunk of RMSNorm(residual) * weight, rounded as the fused RMSNorm kernel rounds it."""
    x = _residual(resid_ptr, acc_ptr, offs, mask, H, COPIES)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _stage_embed(base_ptr, tok_ptr, resid_ptr, acc_ptr, pid, num_programs, rows_per_item, H: tl.constexpr,
                 BLOCK_R: tl.constexpr, COPIES: tl.constexpr):
    """The token's embedding row becomes the residual stream; FUSED_MLP (COPIES > 0): the down
    projection's accumulator starts at zero (the first layer reads it, _residual)."""
    token = tl.load(tok_ptr).to(tl.int64)
    for item in range(pid, tl.cdiv(H, rows_per_item), num_programs):
        offs, mask = _rows(item, rows_per_item, H, BLOCK_R)
        _embed_rows(base_ptr, token, resid_ptr, acc_ptr, offs, mask, H, COPIES)


@triton.jit
def _first_tile(w_ptr, pid, rows_per_item, N, valid, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first K chunk of this program's first item: what a stage reads first, so the
    persistent kernel loads it ahead, before the barrier the stage waits at (weights do not
    depend on the other programs' results). valid=False reads nothing."""
    rows, rmask = _rows(pid, rows_per_item, N, BLOCK_R)
    return _weight_tile(w_ptr, rows, rmask & valid, 0, K, BLOCK_K)


@triton.jit
def _chunk(first, is_first_item, w_ptr, rows, rmask, k0: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
           slot, SMEM: tl.constexpr):
    """K chunk k0 of an item's weight rows. SMEM: from the program's shared-memory slot (its one
    item's rows, copied there ahead, see _issue_weights). Else `first` (loaded ahead, see
    _first_tile) for the program's first item's first chunk, or a load."""
    if SMEM:
        w = slot_tile(slot, w_ptr, rmask, k0, K, rows.shape[0], BLOCK_K)
    elif k0 == 0:
        if is_first_item:
            w = first
        else:
            w = _weight_tile(w_ptr, rows, rmask, 0, K, BLOCK_K)
    else:
        w = _weight_tile(w_ptr, rows, rmask, k0, K, BLOCK_K)
    return w


@triton.jit
def _stage_qkv(
    first, base_ptr, layer_ptr, resid_ptr, acc_ptr, qkv_ptr, eps, pid, num_programs, rows_per_item, slot,
    H: tl.constexpr, N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SMEM: tl.constexpr, xbuf, red, MMA_ASM: tl.constexpr, BLOCK_X: tl.constexpr, THREADS: tl.constexpr,
    COPIES: tl.constexpr, STAGED: tl.constexpr = False, bar=0, LATE_WAIT: tl.constexpr = False,
):
    """qkv rows = W_qkv[rows] @ rmsnorm(residual) (+ bias). `first`: see _first_tile. MMA_ASM
    (not empty): on tensor cores from the slot (mma_asm), the normed input staged at xbuf (by
    the caller already if STAGED). COPIES: the residual still has the previous layer's down sums
    to add (see _residual). LATE_WAIT (MMA_ASM): wait for the slot's rows (phase 0 of mbarrier
    `bar`) only once the input is staged (QKV_EARLY in _decode_kernel)."""
    dtype = qkv_ptr.dtype.element_ty
    w_ptr = _at(base_ptr, layer_ptr, F_QKV_W)
    ln_ptr = _at(base_ptr, layer_ptr, F_LN1)
    if MMA_ASM != "":
        if not STAGED:
            _normed_to_shared(resid_ptr, acc_ptr, ln_ptr, eps, xbuf, H, BLOCK_X, dtype, COPIES)
        if LATE_WAIT:
            mbarrier_wait(bar, 0)
    else:
        rstd = _rstd(resid_ptr, acc_ptr, eps, H, BLOCK_K, COPIES)
    for item in range(pid, tl.cdiv(N, rows_per_item), num_programs):
        rows, rmask = _item_rows(item, rows_per_item, N, BLOCK_R, THREADS, MMA_ASM != "")
        if HAS_BIAS:  # loaded before the projection, so that its round trip overlaps it
            bias = tl.load(_at(base_ptr, layer_ptr, F_QKV_B) + rows, mask=rmask, other=0.0).to(tl.float32)
        if MMA_ASM != "":
            tl.debug_barrier()  # the staged input (or the previous item's reads of `red`)
            acc, _ = mma_rows(MMA_ASM, slot, xbuf, red, THREADS)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
            for k0 in tl.static_range(0, H, BLOCK_K):
                offs_k = _tile_columns(rows, k0, BLOCK_K)
                x = _normed(resid_ptr, acc_ptr, ln_ptr, offs_k, offs_k < H, rstd, dtype, H, COPIES)
                w = _chunk(first, item == pid, w_ptr, rows, rmask, k0, H, BLOCK_K, slot, SMEM)
                acc = tl.fma(w.to(tl.float32), x, acc)
            acc = tl.sum(acc, axis=1)
        if HAS_BIAS:
            acc += bias
        tl.store(qkv_ptr + rows, acc.to(dtype), mask=rmask)


@triton.jit
def _carry_residual(src_ptr, acc_ptr, COPIES: tl.constexpr, dst_ptr, zero_ptr, pid, num_programs, rows_h,
                    H: tl.constexpr, BR_H: tl.constexpr, ZERO: tl.constexpr):
    """FUSED_ATTN: store this program's rows of the residual that src plus the accumulator make
    (_residual) into dst, the other residual buffer (every program reads src and the accumulator
    in this stage, so they cannot be updated in place), and with ZERO zero those rows of zero_ptr
    (the accumulator of the stage after next, read by every program before the last barrier)."""
    for item in range(pid, tl.cdiv(H, rows_h), num_programs):
        rows, rmask = _rows(item, rows_h, H, BR_H)
        x = _residual(src_ptr, acc_ptr, rows, rmask, H, COPIES)
        tl.store(dst_ptr + rows, x.to(dst_ptr.dtype.element_ty), mask=rmask)
        if ZERO:
            _zero_acc(zero_ptr, rows, rmask, H, 1)


@triton.jit
def _stage_rows_residual(
    first, w_ptr, x_ptr, resid_ptr, acc_ptr, pid, num_programs, rows_per_item, slot,
    H: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SMEM: tl.constexpr,
    xbuf, red, MMA_ASM: tl.constexpr, BLOCK_X: tl.constexpr, THREADS: tl.constexpr, COPIES: tl.constexpr = 0,
):
    """residual[rows] = round(round(W[rows] @ x) + residual[rows]): the o and down projections
    (MMA_ASM: see _stage_qkv). COPIES (the o projection with FUSED_MLP): the residual rows first
    take the previous layer's down sums (_residual), whose accumulator rows are then zeroed for
    this layer's MLP (every program read them in stage A, before the barriers since)."""
    dtype = resid_ptr.dtype.element_ty
    for item in range(pid, tl.cdiv(H, rows_per_item), num_programs):
        rows, rmask = _item_rows(item, rows_per_item, H, BLOCK_R, THREADS, MMA_ASM != "")
        # The residual rows are loaded before the projection, so that their round trip overlaps
        # the input's (after it, they cost one more L2 round trip at the end of the stage).
        r = _residual(resid_ptr, acc_ptr, rows, rmask, H, COPIES)
        if MMA_ASM != "":
            offs = tl.arange(0, BLOCK_X)
            stage_to_shared(tl.load(x_ptr + offs, mask=offs < K, other=0.0), offs, offs < K, xbuf)
            tl.debug_barrier()
            acc, _ = mma_rows(MMA_ASM, slot, xbuf, red, THREADS)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                offs_k = _tile_columns(rows, k0, BLOCK_K)
                x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                w = _chunk(first, item == pid, w_ptr, rows, rmask, k0, K, BLOCK_K, slot, SMEM)
                acc = tl.fma(w.to(tl.float32), x, acc)
            acc = tl.sum(acc, axis=1)
        tl.store(resid_ptr + rows, (acc.to(dtype).to(tl.float32) + r).to(dtype), mask=rmask)
        if COPIES > 0:
            tl.debug_barrier()  # every thread holding a copy of these rows has read them
            _zero_acc(acc_ptr, rows, rmask, H, COPIES)


@triton.jit
def _stage_gate_up(
    first_gate, first_up, base_ptr, layer_ptr, resid_ptr, act_ptr, acc_ptr, eps, pid, num_programs, rows_per_item,
    slot, slot_down, bar_down, bar, next_valid, rows_qkv, rows_h, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SMEM: tl.constexpr,
    xbuf, red, MMA_ASM: tl.constexpr, BLOCK_X: tl.constexpr, THREADS: tl.constexpr, COPIES: tl.constexpr,
    BK_DT: tl.constexpr, DOWN_ASM: tl.constexpr, acc_in_ptr, IN_COPIES: tl.constexpr, QKV_EARLY: tl.constexpr = 8,
):
    """act[i] = silu(gate[i]) * up[i] for this program's i, gate/up = W @ rmsnorm(residual)
    (MMA_ASM: see _stage_qkv; its slice is the gate rows then the up rows; IN_COPIES: the
    residual still has acc_in's sums to add, FUSED_ATTN's o projection, see _residual). COPIES > 0
    (FUSED_MLP): the down projection follows here, split by K: this program's act values times
    the matching rows of the transposed down weight (slot_down, counted in at bar_down, with
    SMEM) give a whole [H] partial sum, added into copy pid % COPIES of the accumulator with
    atomics; the next layer's stage A and o stage add the copies to the residual (_residual).
    That saves the down stage's grid barrier and its input's L2 round trip; the sums' order
    follows the atomics' arrival, so their last bits can differ between runs. With SMEM, slot X
    (at mbarrier `bar`) is free as soon as the gate/up rows are multiplied, so the next layer's
    qkv rows (if next_valid) are copied in right then, before the down projection (issued after
    the stage, they would arrive after stage A has begun). A grid barrier's arrival waits for
    the SM's bulk copies in flight, so QKV_EARLY < 8: only that many eighths of them here, the
    rest once the stage has arrived (see _decode_kernel)."""
    dtype = act_ptr.dtype.element_ty
    w_ptr = _at(base_ptr, layer_ptr, F_GU_W)
    ln_ptr = _at(base_ptr, layer_ptr, F_LN2)
    QKV_PART: tl.constexpr = 1 if QKV_EARLY < 8 else 0  # the next qkv rows: their early part, or all of them
    if MMA_ASM != "":
        _normed_to_shared(resid_ptr, acc_in_ptr, ln_ptr, eps, xbuf, H, BLOCK_X, dtype, IN_COPIES)
    else:
        rstd = _rstd(resid_ptr, acc_in_ptr, eps, H, BLOCK_K, IN_COPIES)
    for item in range(pid, tl.cdiv(INTER, rows_per_item), num_programs):
        rows, rmask = _item_rows(item, rows_per_item, INTER, BLOCK_R, THREADS, MMA_ASM != "")
        if MMA_ASM != "":
            tl.debug_barrier()  # the staged input (or the previous item's reads of `red`)
            gate, up = mma_rows(MMA_ASM, slot, xbuf, red, THREADS)
        else:
            gate = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
            up = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
            for k0 in tl.static_range(0, H, BLOCK_K):
                offs_k = _tile_columns(rows, k0, BLOCK_K)
                x = _normed(resid_ptr, acc_in_ptr, ln_ptr, offs_k, offs_k < H, rstd, dtype, H, IN_COPIES)
                wg = _chunk(first_gate, item == pid, w_ptr, rows, rmask, k0, H, BLOCK_K, slot, SMEM)
                wu = _chunk(first_up, item == pid, w_ptr + INTER * H, rows, rmask, k0, H, BLOCK_K,
                            _up_rows_slot(slot, rows_per_item, H, w_ptr.dtype.element_ty.primitive_bitwidth // 8), SMEM)
                gate = tl.fma(wg.to(tl.float32), x, gate)
                up = tl.fma(wu.to(tl.float32), x, up)
            gate = tl.sum(gate, axis=1)
            up = tl.sum(up, axis=1)
        g = gate.to(dtype).to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)
        act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
        if COPIES > 0 and SMEM:
            if MMA_ASM == "":
                tl.debug_barrier()  # every thread's reads of slot X are done (mma_rows ends with a CTA barrier)
            _issue_weights(0, _next_layer(layer_ptr), next_valid, base_ptr, slot, bar, pid, rows_qkv, rows_h,
                           rows_per_item, H, NQ, NK, D, INTER, False, False, 1, 1, QKV_PART, QKV_EARLY)
        if COPIES == 0:
            tl.store(act_ptr + rows, act, mask=rmask)
        else:
            # With MMA_ASM the tensor-core program's reads of xbuf are done (its CTA barrier).
            _down_partial(act, rows, rmask, base_ptr, layer_ptr, acc_ptr, pid, item, rows_per_item, slot_down, bar_down,
                          H, INTER, BLOCK_R, SMEM, xbuf, COPIES, BK_DT, DOWN_ASM, THREADS)
    if COPIES > 0 and SMEM:
        if pid >= tl.cdiv(INTER, rows_per_item):  # a program without gate/up rows copies its qkv rows here
            _issue_weights(0, _next_layer(layer_ptr), next_valid, base_ptr, slot, bar, pid, rows_qkv, rows_h,
                           rows_per_item, H, NQ, NK, D, INTER, False, False, 1, 1, QKV_PART, QKV_EARLY)


@triton.jit
def _down_partial(
    act, rows, rmask, base_ptr, layer_ptr, acc_ptr, pid, item, rows_per_item, slot, bar,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_R: tl.constexpr, SMEM: tl.constexpr, xbuf,
    COPIES: tl.constexpr, BK_DT: tl.constexpr, DOWN_ASM: tl.constexpr, THREADS: tl.constexpr,
):
    """FUSED_MLP (see _stage_gate_up): acc[pid % COPIES] += act[rows] @ W_down^T[rows, :], `act`
    and `rows` in the gate/up result's layout. SMEM: the act values are staged at xbuf (fp32) and
    the slot's rows multiplied by down_asm's program (each thread its own columns, no cross-thread
    sum); else the rows are loaded from the transposed weight and summed with tl.sum (the
    stepwise launches, which the CPU tests run, and models whose slices do not fit the slots)."""
    acc = acc_ptr + (pid % COPIES) * H
    if SMEM:
        stage_f32_to_shared(act, rows - item * rows_per_item, rmask, xbuf)  # xbuf's earlier reads: see the caller
        tl.debug_barrier()
        mbarrier_wait(bar, 1)  # slot Y's second phase of the layer: these rows of W_down^T
        valid = tl.minimum(rows_per_item, INTER - item * rows_per_item)
        down_rows(DOWN_ASM, slot, xbuf, acc, valid, THREADS)
    else:
        a = tl.where(rmask, act.to(tl.float32), 0.0)
        wt_ptr = _at(base_ptr, layer_ptr, F_DOWN_T)
        for k0 in tl.static_range(0, H, BK_DT):
            w = _weight_tile(wt_ptr, rows, rmask, k0, H, BK_DT)
            part = tl.sum(w.to(tl.float32) * a[:, None], axis=0)
            offs = k0 + tl.arange(0, BK_DT)
            tl.atomic_add(acc + offs, part, mask=offs < H, sem="relaxed", scope="gpu")


@triton.jit
def _stage_final_norm(resid_ptr, acc_ptr, w_ptr, out_ptr, eps, pid, num_programs, rows_per_item, H: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, COPIES: tl.constexpr):
    rstd = _rstd(resid_ptr, acc_ptr, eps, H, BLOCK_K, COPIES)
    dtype = out_ptr.dtype.element_ty
    for item in range(pid, tl.cdiv(H, rows_per_item), num_programs):
        offs, mask = _rows(item, rows_per_item, H, BLOCK_R)
        tl.store(out_ptr + offs, _normed(resid_ptr, acc_ptr, w_ptr, offs, mask, rstd, dtype, H, COPIES).to(dtype), mask=mask)


@triton.jit
def _prefetch(
    STAGE: tl.constexpr, layer_ptr, valid, base_ptr, pid, rows_qkv, rows_h, rows_inter,
    H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_H: tl.constexpr, BK_O: tl.constexpr, BK_DOWN: tl.constexpr,
    BR_INTER: tl.constexpr, BK_INTER: tl.constexpr,
):
    """The first weight tile(s) of stage STAGE (0 qkv, 2 o, 3 gate and up, 4 down) of a layer."""
    if STAGE == 0:
        t = _first_tile(_at(base_ptr, layer_ptr, F_QKV_W), pid, rows_qkv, (NQ + 2 * NK) * D, valid, H, BR_QKV, BK_QKV)
        return t, t
    elif STAGE == 2:
        t = _first_tile(_at(base_ptr, layer_ptr, F_O_W), pid, rows_h, H, valid, NQ * D, BR_H, BK_O)
        return t, t
    elif STAGE == 3:
        w_ptr = _at(base_ptr, layer_ptr, F_GU_W)
        gate = _first_tile(w_ptr, pid, rows_inter, INTER, valid, H, BR_INTER, BK_INTER)
        up = _first_tile(w_ptr + INTER * H, pid, rows_inter, INTER, valid, H, BR_INTER, BK_INTER)
        return gate, up
    else:
        t = _first_tile(_at(base_ptr, layer_ptr, F_DOWN_W), pid, rows_h, H, valid, INTER, BR_H, BK_DOWN)
        return t, t


@triton.jit
def _up_rows_slot(slot, rows_inter, H: tl.constexpr, ESIZE: tl.constexpr):
    """Where a program's up rows start in slot X: after its rows_inter gate rows of H weights
    (_issue_weights copies them there, _stage_gate_up reads them; mma_asm's row2 is the same
    rows_inter rows further)."""
    return slot + rows_inter * (H * ESIZE)


@triton.jit
def _issue_weights(
    STAGE: tl.constexpr, layer_ptr, valid, base_ptr, slot, bar, pid, rows_qkv, rows_h, rows_inter,
    H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    FUSED_MLP: tl.constexpr = False, FUSED_ATTN: tl.constexpr = False, RBS: tl.constexpr = 1, num_programs=1,
    PART: tl.constexpr = 0, EARLY: tl.constexpr = 8,
):
    """SMEM_WEIGHTS: copy this program's rows of weight stage STAGE (0 qkv, 2 o, 3 gate and up,
    4 down; with FUSED_MLP, 4 is the program's rows_inter rows of the transposed down weight) of
    a layer into `slot`, counted at mbarrier `bar` (gate rows, then up rows rows_inter rows
    further). valid=False copies nothing but still completes the phase. With FUSED_ATTN, stage 2
    is the program's o tile (_stage_attn_o's item (pid % NK, pid // NK)), RBS rows of o_perm.
    PART (stage 0 only): 0 all the rows; 1 the first EARLY eighths of them, without completing
    the phase; 2 the rest, which completes it (see QKV_EARLY in _decode_kernel)."""
    ESIZE: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    if STAGE == 2 and FUSED_ATTN:
        GD: tl.constexpr = (NQ // NK) * D
        b = pid // NK
        has = valid & (pid < NK * (num_programs // NK))
        tile = _at(base_ptr, layer_ptr, F_O_PERM) + ((pid % NK) * H + b * RBS) * GD
        tile_bytes = tl.where(has, tl.maximum(tl.minimum(RBS, H - b * RBS), 0), 0) * (GD * ESIZE)
        bulk_copy(bar, slot, tile, tile_bytes, slot, tile, 0)
    else:
        if STAGE == 0:
            w_ptr = _at(base_ptr, layer_ptr, F_QKV_W)
            rows_per_item = rows_qkv
            N: tl.constexpr = (NQ + 2 * NK) * D
            K: tl.constexpr = H
        elif STAGE == 2:
            w_ptr = _at(base_ptr, layer_ptr, F_O_W)
            rows_per_item = rows_h
            N: tl.constexpr = H
            K: tl.constexpr = NQ * D
        elif STAGE == 3:
            w_ptr = _at(base_ptr, layer_ptr, F_GU_W)
            rows_per_item = rows_inter
            N: tl.constexpr = INTER
            K: tl.constexpr = H
        elif FUSED_MLP:
            w_ptr = _at(base_ptr, layer_ptr, F_DOWN_T)
            rows_per_item = rows_inter
            N: tl.constexpr = INTER
            K: tl.constexpr = H
        else:
            w_ptr = _at(base_ptr, layer_ptr, F_DOWN_W)
            rows_per_item = rows_h
            N: tl.constexpr = H
            K: tl.constexpr = INTER
        row0 = pid * rows_per_item
        count = tl.where(valid, tl.maximum(tl.minimum(rows_per_item, N - row0), 0), 0)
        if PART != 0:
            early = tl.minimum(count, rows_per_item * EARLY // 8)
            if PART == 1:
                count = early
            else:
                row0 += early
                count -= early
                slot += early * (K * ESIZE)
        nbytes = count * (K * ESIZE)
        src = w_ptr + row0 * K
        if STAGE == 3:  # the up rows: INTER rows after the gate rows in the packed weight
            bulk_copy(bar, slot, src, nbytes, _up_rows_slot(slot, rows_per_item, K, ESIZE), src + INTER * K, nbytes)
        elif PART == 1:
            bulk_copy(bar, slot, src, nbytes, slot, src, 0, False)
        else:
            bulk_copy(bar, slot, src, nbytes, slot, src, 0)


@triton.jit
def _next_step_weights(head_cr, rows_vocab, valid, table, base_ptr, slot_x, slot_y, bar_x, bar_y, pid, rows_qkv, rows_h,
                       rows_inter, H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr,
                       INTER: tl.constexpr):
    """MULTI_STEP, after a step's LM head (head_cr rows per chunk): copy the next step's layer 0 qkv
    rows into slot X (valid=False: an empty copy), so that they land during the pick and the
    handoff to the next step. The kernel's mbarrier waits use fixed parities, which hold in
    every step if each slot's phases per step are even: X takes the first qkv rows, two copies
    per layer and the head's even chunks, Y two per layer (O_IN_A) and the head's odd chunks (of
    the chunks 0 .. n + 1 issued for n); an empty copy completes a phase where that count is odd."""
    n = tl.cdiv(rows_vocab, head_cr)
    if (n + 3) // 2 % 2 == 0:  # X: 1 + 2 * layers + ceil((n + 2) / 2) phases
        bulk_copy(bar_x, slot_x, base_ptr, 0, slot_x, base_ptr, 0)
    if (n + 2) // 2 % 2 == 1:  # Y: 2 * layers + floor((n + 2) / 2)
        bulk_copy(bar_y, slot_y, base_ptr, 0, slot_y, base_ptr, 0)
    _issue_weights(0, table, valid, base_ptr, slot_x, bar_x, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER)


@triton.jit
def _layer_stage(
    STAGE: tl.constexpr, first, first2, kv1, kv2, kv3, kv4, layer_ptr, base_ptr, resid_ptr, qkv_ptr, attn_ptr, act_ptr,
    acc_ptr, part_acc_ptr, part_ml_ptr, count_ptr, cos, sin, step_slot, ctx, block_table_ptr,
    eps, qk_eps, qk_scale, stride_cb, stride_cs, pid, num_programs, rows_qkv, rows_h, rows_inter, probe_row, probe_half,
    slot_x, slot_y, bar_x, bar_y, next_valid,
    H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr, OWN_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_H: tl.constexpr, BK_O: tl.constexpr, BK_DOWN: tl.constexpr,
    BR_INTER: tl.constexpr, BK_INTER: tl.constexpr, BLOCK_T: tl.constexpr, PROBE: tl.constexpr, SMEM: tl.constexpr,
    xbuf, red, MMA_QKV: tl.constexpr, MMA_O: tl.constexpr, MMA_GU: tl.constexpr, MMA_DOWN: tl.constexpr,
    BK_H: tl.constexpr, BX_O: tl.constexpr, BX_DOWN: tl.constexpr, THREADS: tl.constexpr, COPIES: tl.constexpr,
    BK_DT: tl.constexpr, DOWN_ASM: tl.constexpr, resid2_ptr, acc_o_ptr, FUSED_ATTN: tl.constexpr,
    PERSISTENT: tl.constexpr, RBS: tl.constexpr, BR_OB: tl.constexpr, BK_OB: tl.constexpr, MMA_OB: tl.constexpr,
    GU_IN_B: tl.constexpr = False, O_IN_A: tl.constexpr = False, QKV_EARLY: tl.constexpr = 8,
):
    """Stage STAGE (0-4: A-E of the module docstring) of the layer at layer_ptr; `first` (and
    `first2`, the up tile of stage 3) from _prefetch, unused by stage 1 (attention), which takes
    its first cached K/V tile as kv1-kv4 (at _first_kv_rows). COPIES > 0: FUSED_MLP, stage 3
    does the down projection too (_stage_gate_up) and there is no stage 4. FUSED_ATTN (with
    FUSED_MLP): the o projection follows attention in stage 1 (_stage_attn_o; stage 2 of the
    stepwise launches, where kernel boundaries order it after every part), and the residual
    lives in two buffers: stage A reads resid2 (after the MLP) plus the down sums and stores its
    rows of the sum into resid, stage D reads resid plus the o sums and stores its rows into
    resid2 (_carry_residual). Slot copies issued here (see _decode_kernel): GU_IN_B, the gate/up
    rows once this program's attention parts are stored (else when stage A arrives); O_IN_A, this
    layer's o tile once stage A's input is staged (else when the previous layer's MLP arrives)."""
    if STAGE == 0:
        if FUSED_ATTN:
            _carry_residual(resid2_ptr, acc_ptr, COPIES, resid_ptr, acc_o_ptr, pid, num_programs, rows_h, H, BR_H, True)
            if O_IN_A:  # the o tile's copy once this stage's input is in, not during its loads
                _normed_to_shared(resid2_ptr, acc_ptr, _at(base_ptr, layer_ptr, F_LN1), eps, xbuf, H, BK_H,
                                  qkv_ptr.dtype.element_ty, COPIES)
                _issue_weights(2, layer_ptr, True, base_ptr, slot_y, bar_y, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK,
                               D, INTER, True, True, RBS, num_programs)
            _stage_qkv(first, base_ptr, layer_ptr, resid2_ptr, acc_ptr, qkv_ptr, eps, pid, num_programs, rows_qkv, slot_x,
                       H, (NQ + 2 * NK) * D, HAS_BIAS, BR_QKV, BK_QKV, SMEM, xbuf, red, MMA_QKV, BK_H, THREADS, COPIES,
                       O_IN_A, bar_x, QKV_EARLY < 8)
        else:
            _stage_qkv(first, base_ptr, layer_ptr, resid_ptr, acc_ptr, qkv_ptr, eps, pid, num_programs, rows_qkv, slot_x,
                       H, (NQ + 2 * NK) * D, HAS_BIAS, BR_QKV, BK_QKV, SMEM, xbuf, red, MMA_QKV, BK_H, THREADS, COPIES)
    elif STAGE == 1:
        _stage_attention(kv1, kv2, kv3, kv4, base_ptr, layer_ptr, qkv_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, count_ptr,
                         cos, sin, step_slot, ctx, block_table_ptr,
                         qk_eps, qk_scale, stride_cb, stride_cs, pid, num_programs, probe_row, probe_half,
                         NQ, NK, D, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT, BLOCK_G, HAS_NORM, BLOCK_T, PROBE,
                         FUSED_ATTN, PERSISTENT)
        if FUSED_ATTN and PERSISTENT:
            if GU_IN_B:  # slot X (free since stage A) takes the gate/up rows only now
                _issue_weights(3, layer_ptr, True, base_ptr, slot_x, bar_x, pid, rows_qkv, rows_h, rows_inter,
                               H, NQ, NK, D, INTER)
            _stage_attn_o(base_ptr, layer_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, count_ptr, acc_o_ptr, acc_ptr, ctx, pid,
                          num_programs, rows_h, slot_y, bar_y, xbuf, red, probe_row, probe_half, H, NQ, NK, D, SPLIT_MIN,
                          MAX_SPLITS, OWN_SPLIT, BLOCK_G, RBS, BR_OB, BK_OB, MMA_OB, THREADS, SMEM, PERSISTENT, COPIES,
                          BR_H, PROBE)
    elif STAGE == 2:
        if FUSED_ATTN:
            _stage_attn_o(base_ptr, layer_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, count_ptr, acc_o_ptr, acc_ptr, ctx, pid,
                          num_programs, rows_h, slot_y, bar_y, xbuf, red, probe_row, probe_half, H, NQ, NK, D, SPLIT_MIN,
                          MAX_SPLITS, OWN_SPLIT, BLOCK_G, RBS, BR_OB, BK_OB, MMA_OB, THREADS, SMEM, PERSISTENT, COPIES,
                          BR_H, PROBE)
        else:
            _stage_rows_residual(first, _at(base_ptr, layer_ptr, F_O_W), attn_ptr, resid_ptr, acc_ptr, pid, num_programs,
                                 rows_h, slot_y, H, NQ * D, BR_H, BK_O, SMEM, xbuf, red, MMA_O, BX_O, THREADS, COPIES)
    elif STAGE == 3:
        if FUSED_ATTN:
            _carry_residual(resid_ptr, acc_o_ptr, 1, resid2_ptr, acc_o_ptr, pid, num_programs, rows_h, H, BR_H, False)
            _stage_gate_up(first, first2, base_ptr, layer_ptr, resid_ptr, act_ptr, acc_ptr, eps, pid, num_programs,
                           rows_inter, slot_x, slot_y, bar_y, bar_x, next_valid, rows_qkv, rows_h, NQ, NK, D, H, INTER,
                           BR_INTER, BK_INTER, SMEM, xbuf, red, MMA_GU, BK_H, THREADS, COPIES, BK_DT, DOWN_ASM,
                           acc_o_ptr, 1, QKV_EARLY)
        else:
            _stage_gate_up(first, first2, base_ptr, layer_ptr, resid_ptr, act_ptr, acc_ptr, eps, pid, num_programs,
                           rows_inter, slot_x, slot_y, bar_y, bar_x, next_valid, rows_qkv, rows_h, NQ, NK, D, H, INTER,
                           BR_INTER, BK_INTER, SMEM, xbuf, red, MMA_GU, BK_H, THREADS, COPIES, BK_DT, DOWN_ASM, acc_ptr, 0)
    elif COPIES == 0:
        _stage_rows_residual(first, _at(base_ptr, layer_ptr, F_DOWN_W), act_ptr, resid_ptr, acc_ptr, pid, num_programs,
                             rows_h, slot_y, H, INTER, BR_H, BK_DOWN, SMEM, xbuf, red, MMA_DOWN, BX_DOWN, THREADS)
