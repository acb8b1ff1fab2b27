"""The attention stage of the persistent decode kernel (kernel.py, stage B):
the step's rotary values, q/k norm and rotary, attention over the paged KV cache in context
splits (one part per (KV head, split) item; the step's own token in a part of its own where that
costs no split), and the combine of the parts: by the last part to finish, or, with FUSED_ATTN,
by each item of the o projection that follows in the same stage (_stage_attn_o).

Why a module of its own: see common.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.fastpath.common import (
    _NEG_BIG, F_K_CACHE, F_K_NORM, F_O_PERM, F_Q_NORM, F_V_CACHE, _at, _stamp, _tile_columns, _weight_tile, _zero_rows,
)
from nanovllm.fastpath.ptx import mbarrier_wait, mma_rows, slot_tile, stage_to_shared, wait_count


@triton.jit
def _step_values(pos_ptr, slot_ptr, seq_len_ptr, cos_sin_ptr, D: tl.constexpr, dtype: tl.constexpr):
    """What attention needs of the step in every layer: the rotary cos and sin of the token's
    position ([D // 2] each, rounded to the activation dtype), its cache slot and the context
    length (cached positions plus this token). The persistent kernel loads them once per step:
    per layer, after a barrier, the position's load and then the cos/sin loads were two
    dependent L2 round trips."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * D + offs_d).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * D + HALF + offs_d).to(dtype).to(tl.float32)
    return cos, sin, tl.load(slot_ptr).to(tl.int64), tl.load(seq_len_ptr)


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, eps, offs_d, HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """Per-head RMSNorm (optional) then neox rotary of rows [R, HALF] + [R, HALF], fp32 in and
    out, every intermediate rounded as layers/fused.py's _norm_rope_heads rounds it."""
    if HAS_NORM:
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (1.0 / (2 * HALF)) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        x1 = ((x1 * scale).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * scale).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    o1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return o1, o2


@triton.jit
def _splits(ctx, num_programs, NK: tl.constexpr, SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr,
            OWN_SPLIT: tl.constexpr):
    """(parts, positions per split) of a KV head's attention over a context of ctx positions: the
    cached positions in at most MAX_SPLITS splits of at least SPLIT_MIN; with OWN_SPLIT, while
    there are fewer than MAX_SPLITS splits and a program is free for it (every KV head's parts
    still fit in one round of the programs), one more part that attends to the step's own token
    alone (else the last split does). That part starts past the cached positions, so it walks
    none of them."""
    num_splits = tl.maximum(tl.minimum(tl.cdiv(ctx, SPLIT_MIN), MAX_SPLITS), 1)
    own = ((num_splits < MAX_SPLITS) & (NK * (num_splits + 1) <= num_programs)).to(tl.int32) * OWN_SPLIT
    return num_splits + own, tl.cdiv(ctx, num_splits)


@triton.jit
def _kv_row_starts(
    block_table_ptr, head_off, t0, end, stride_cb, stride_cs, KV_BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Where the cached K/V rows of positions [t0, t0 + BLOCK_T) of one KV head start, in
    elements from a layer's cache ([BLOCK_T] int64), and which are before `end`."""
    t = t0 + tl.arange(0, BLOCK_T)
    valid = t < end
    block = tl.load(block_table_ptr + t // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (t % KV_BLOCK_SIZE) * stride_cs + head_off, valid


@triton.jit
def _kv_load(k_cache_ptr, v_cache_ptr, row_start, valid, HALF: tl.constexpr, BYPASS_L1: tl.constexpr = False):
    """K and V rows at row_start as halves [BLOCK_T, HALF] in the cache dtype (invalid rows read
    nothing). BYPASS_L1: read through the L2 only (.cg)."""
    row = row_start[:, None] + tl.arange(0, HALF)[None, :]
    m = valid[:, None]
    CACHE: tl.constexpr = ".cg" if BYPASS_L1 else ""
    k1 = tl.load(k_cache_ptr + row, mask=m, other=0.0, cache_modifier=CACHE)
    k2 = tl.load(k_cache_ptr + row + HALF, mask=m, other=0.0, cache_modifier=CACHE)
    v1 = tl.load(v_cache_ptr + row, mask=m, other=0.0, cache_modifier=CACHE)
    v2 = tl.load(v_cache_ptr + row + HALF, mask=m, other=0.0, cache_modifier=CACHE)
    return k1, k2, v1, v2


@triton.jit
def _first_kv_rows(
    seq_len_ptr, block_table_ptr, pid, num_programs, stride_cb, stride_cs,
    NK: tl.constexpr, D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, SPLIT_MIN: tl.constexpr,
    MAX_SPLITS: tl.constexpr, OWN_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """_kv_row_starts of this program's first attention item's first tile. The cache holds that
    tile before the step's q/k/v exist, so the persistent kernel loads it ahead, like weight
    tiles; and it is at the same place in every layer's cache, so the block-table lookup runs
    once per step (per layer, its dependent load would hold each program before the barrier)."""
    ctx = tl.load(seq_len_ptr)
    parts, per_split = _splits(ctx, num_programs, NK, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT)
    start = (pid % parts) * per_split
    end = tl.where(pid < NK * parts, tl.minimum(start + per_split, ctx - 1), start)
    return _kv_row_starts(block_table_ptr, (pid // parts) * D, start, end, stride_cb, stride_cs, KV_BLOCK_SIZE, BLOCK_T)


@triton.jit
def _stage_attention(
    first_k1, first_k2, first_v1, first_v2, base_ptr, layer_ptr, qkv_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, count_ptr,
    cos, sin, slot, ctx, block_table_ptr,
    qk_eps, qk_scale, stride_cb, stride_cs, pid, num_programs, probe_row, probe_half,
    NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr, OWN_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, PROBE: tl.constexpr, FUSED_ATTN: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    """Attention parts (KV head, context split) over the programs; see the module docstring.
    FUSED_ATTN: no combine here (_stage_attn_o does it); a persistent launch counts each stored
    part at count_ptr (this layer's counters)."""
    dtype = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    GROUP: tl.constexpr = NQ // NK
    k_cache_ptr = _at(base_ptr, layer_ptr, F_K_CACHE)
    v_cache_ptr = _at(base_ptr, layer_ptr, F_V_CACHE)
    q_norm_ptr = _at(base_ptr, layer_ptr, F_Q_NORM)
    k_norm_ptr = _at(base_ptr, layer_ptr, F_K_NORM)
    # cos, sin, slot, ctx (cached positions plus this step's token): see _step_values
    parts, per_split = _splits(ctx, num_programs, NK, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT)
    offs_d = tl.arange(0, HALF)
    BLOCK_M: tl.constexpr = 16 if BLOCK_G < 16 else BLOCK_G
    cache_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
    PRECISION: tl.constexpr = "ieee" if cache_dtype == tl.float32 else "tf32"
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < GROUP
    offs_t = tl.arange(0, BLOCK_T)
    for item in range(pid, NK * parts, num_programs):
        kvh = item // parts
        split = item % parts
        # The group's query heads as the rows of tl.dot operands, padded to the 16 rows it needs.
        heads = kvh * GROUP + offs_m
        q_rows = qkv_ptr + heads[:, None] * D + offs_d[None, :]
        q1 = tl.load(q_rows, mask=mmask[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(q_rows + HALF, mask=mmask[:, None], other=0.0).to(tl.float32)
        q1, q2 = _norm_rope(q1, q2, q_norm_ptr, cos, sin, qk_eps, offs_d, HALF, HAS_NORM, dtype)
        q1c = q1.to(cache_dtype)  # exact: _norm_rope rounds to the activation dtype
        q2c = q2.to(cache_dtype)
        _stamp(probe_row, 15, num_programs, probe_half, PROBE)
        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
        head_off = kvh * D
        start = split * per_split
        end = tl.minimum(start + per_split, ctx - 1)  # positions already in the cache
        for t0 in range(start, end, BLOCK_T):
            tmask = t0 + offs_t < end
            if (item == pid) & (t0 == start):  # the tile loaded ahead (_first_kv_rows)
                k1, k2, v1, v2 = first_k1, first_k2, first_v1, first_v2
            else:
                row_start, valid = _kv_row_starts(block_table_ptr, head_off, t0, end, stride_cb, stride_cs,
                                                  KV_BLOCK_SIZE, BLOCK_T)
                k1, k2, v1, v2 = _kv_load(k_cache_ptr, v_cache_ptr, row_start, valid, HALF)
            s = tl.dot(q1c, tl.trans(k1), input_precision=PRECISION)
            s = tl.dot(q2c, tl.trans(k2), s, input_precision=PRECISION)
            s = tl.where(tmask[None, :], s * qk_scale, _NEG_BIG)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # p in the cache dtype, as the split-KV decode kernel multiplies it.
            acc1 = tl.dot(p.to(cache_dtype), v1, acc1 * alpha[:, None], input_precision=PRECISION)
            acc2 = tl.dot(p.to(cache_dtype), v2, acc2 * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        _stamp(probe_row, 16, num_programs, probe_half, PROBE)
        if split == parts - 1:
            # This step's token: its K/V come from the projection, not the cache, and are stored.
            k_row = qkv_ptr + (NQ + kvh) * D + offs_d[None, :]
            k1 = tl.load(k_row).to(tl.float32)
            k2 = tl.load(k_row + HALF).to(tl.float32)
            k1, k2 = _norm_rope(k1, k2, k_norm_ptr, cos, sin, qk_eps, offs_d, HALF, HAS_NORM, dtype)
            v_row = qkv_ptr + (NQ + NK + kvh) * D + offs_d[None, :]
            v1 = tl.load(v_row).to(tl.float32)
            v2 = tl.load(v_row + HALF).to(tl.float32)
            s = (tl.sum(q1 * k1, axis=1) + tl.sum(q2 * k2, axis=1)) * qk_scale
            m_new = tl.maximum(m_i, s)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + p
            acc1 = acc1 * alpha[:, None] + p[:, None] * v1
            acc2 = acc2 * alpha[:, None] + p[:, None] * v2
            m_i = m_new
            safe = tl.maximum(slot, 0)
            dst = (safe // KV_BLOCK_SIZE) * stride_cb + (safe % KV_BLOCK_SIZE) * stride_cs + head_off + offs_d[None, :]
            smask = (offs_d[None, :] * 0 + slot) >= 0
            tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=smask)
            tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=smask)
            tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=smask)
            tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=smask)
            _stamp(probe_row, 17, num_programs, probe_half, PROBE)
        part = (heads * MAX_SPLITS + split)[:, None] * D + offs_d[None, :]
        tl.store(part_acc_ptr + part, acc1, mask=mmask[:, None])
        tl.store(part_acc_ptr + part + HALF, acc2, mask=mmask[:, None])
        tl.store(part_ml_ptr + (heads * MAX_SPLITS + split) * 2, m_i, mask=mmask)
        tl.store(part_ml_ptr + (heads * MAX_SPLITS + split) * 2 + 1, l_i, mask=mmask)
        tl.debug_barrier()
        if FUSED_ATTN:
            # The o projection's programs combine the parts themselves (_stage_attn_o), once this
            # head's count (this layer's own counter) says every part is stored.
            if PERSISTENT:
                tl.atomic_add(count_ptr + kvh, 1, sem="release", scope="gpu")
        else:
            # The last part of this KV head to finish combines all of them.
            arrived = tl.atomic_add(count_ptr + kvh, 1, sem="acq_rel", scope="gpu")
            _stamp(probe_row, 18, num_programs, probe_half, PROBE)
            if arrived == parts - 1:
                tl.atomic_xchg(count_ptr + kvh, 0, sem="relaxed", scope="gpu")
                out1, out2 = _combine_group(kvh, parts, part_acc_ptr, part_ml_ptr, GROUP, D, MAX_SPLITS, BLOCK_G)
                _store_group(attn_ptr, kvh, out1, out2, GROUP, D, BLOCK_G)
                _stamp(probe_row, 19, num_programs, probe_half, PROBE)


@triton.jit
def _store_group(attn_ptr, kvh, out1, out2, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr):
    """Store KV head kvh's query heads' attention output (_combine_group's halves) into the
    attention output vector, rounded to its dtype."""
    HALF: tl.constexpr = D // 2
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < GROUP
    dst = attn_ptr + (kvh * GROUP + offs_g)[:, None] * D + tl.arange(0, HALF)[None, :]
    tl.store(dst, out1.to(attn_ptr.dtype.element_ty), mask=gmask[:, None])
    tl.store(dst + HALF, out2.to(attn_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _combine_group(kvh, parts, part_acc_ptr, part_ml_ptr, GROUP: tl.constexpr, D: tl.constexpr,
                   MAX_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr):
    """The attention output of KV head kvh's query heads ([BLOCK_G, D // 2] halves, fp32) from
    its `parts` partial results. Every split's partials are loaded at once (an unrolled loop,
    masked past `parts`: one round trip to the L2) and combined with elementwise operations only.
    Loading them as one [MAX_SPLITS, BLOCK_G, HALF] tensor and reducing over its first axis is
    slower: cross-warp reductions through shared memory."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < GROUP
    group_heads = kvh * GROUP + offs_g
    m_max = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    for sp in tl.static_range(0, MAX_SPLITS):
        valid = gmask & (offs_g * 0 + sp < parts)  # a vector: the interpreter rejects a scalar mask
        m_s = tl.load(part_ml_ptr + (group_heads * MAX_SPLITS + sp) * 2, mask=valid, other=_NEG_BIG)
        m_max = tl.maximum(m_max, m_s)
    total = tl.zeros([BLOCK_G], tl.float32)
    out1 = tl.zeros([BLOCK_G, HALF], tl.float32)
    out2 = tl.zeros([BLOCK_G, HALF], tl.float32)
    for sp in tl.static_range(0, MAX_SPLITS):
        valid = gmask & (offs_g * 0 + sp < parts)
        ml = part_ml_ptr + (group_heads * MAX_SPLITS + sp) * 2
        m_s = tl.load(ml, mask=valid, other=_NEG_BIG)
        l_s = tl.load(ml + 1, mask=valid, other=0.0)
        src = part_acc_ptr + (group_heads * MAX_SPLITS + sp)[:, None] * D + offs_d[None, :]
        a1 = tl.load(src, mask=valid[:, None], other=0.0)
        a2 = tl.load(src + HALF, mask=valid[:, None], other=0.0)
        weight = tl.exp2(m_s - m_max)  # empty and masked splits: m = _NEG_BIG, weight 0
        total += weight * l_s
        out1 += weight[:, None] * a1
        out2 += weight[:, None] * a2
    inv = 1.0 / tl.where(gmask, total, 1.0)
    return out1 * inv[:, None], out2 * inv[:, None]


@triton.jit
def _stage_attn_o(
    base_ptr, layer_ptr, attn_ptr, part_acc_ptr, part_ml_ptr, count_ptr, acc_o_ptr, acc_d_ptr, ctx, pid, num_programs,
    rows_h, slot, bar, xbuf, red, probe_row, probe_half,
    H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, SPLIT_MIN: tl.constexpr,
    MAX_SPLITS: tl.constexpr, OWN_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, RBS: tl.constexpr, BR_OB: tl.constexpr,
    BK_OB: tl.constexpr, MMA_OB: tl.constexpr, THREADS: tl.constexpr, SMEM: tl.constexpr, PERSISTENT: tl.constexpr,
    COPIES: tl.constexpr, BR_H: tl.constexpr, PROBE: tl.constexpr,
):
    """FUSED_ATTN: the o projection split by KV head (K) and row blocks, right after attention.
    Work item (g, b) of NK x (num_programs // NK): wait until KV head g's attention parts are all
    stored (its count, persistent launches only), combine them (_combine_group; every item of
    head g does it, in place of one last part), multiply the head group's attention output
    ([GROUP * D], rounded to the activation dtype) by rows b * RBS.. of the o weight's columns
    for that group (a contiguous [RBS, GROUP * D] tile of the permuted copy o_perm, slot Y with
    SMEM) and add the RBS sums into the fp32 accumulator acc_o with atomics (NK adds per row).
    Stage D adds acc_o to the residual (_residual). Saves the o stage's grid barrier and its
    input's round trip. Then this program's rows of the down accumulator are zeroed: every
    program read them in stage A, and this layer's MLP adds into them."""
    dtype = attn_ptr.dtype.element_ty
    GROUP: tl.constexpr = NQ // NK
    GD: tl.constexpr = GROUP * D
    HALF: tl.constexpr = D // 2
    parts, per_split = _splits(ctx, num_programs, NK, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT)
    offs_d = tl.arange(0, HALF)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < GROUP
    w_base = _at(base_ptr, layer_ptr, F_O_PERM)
    for oi in range(pid, NK * (num_programs // NK), num_programs):
        g = oi % NK
        b = oi // NK
        if PERSISTENT:
            wait_count(count_ptr + g, parts)
        _stamp(probe_row, 18, num_programs, probe_half, PROBE)
        out1, out2 = _combine_group(g, parts, part_acc_ptr, part_ml_ptr, GROUP, D, MAX_SPLITS, BLOCK_G)
        _stamp(probe_row, 19, num_programs, probe_half, PROBE)
        w_ptr = w_base + (g * H + b * RBS) * GD
        if MMA_OB != "":
            off = offs_g[:, None] * D + offs_d[None, :]
            stage_to_shared(out1.to(dtype), off, gmask[:, None], xbuf)
            stage_to_shared(out2.to(dtype), off + HALF, gmask[:, None], xbuf)
            mbarrier_wait(bar, 0)  # slot Y's first phase of the layer: this item's o tile
            tl.debug_barrier()
            acc, unused = mma_rows(MMA_OB, slot, xbuf, red, THREADS)
            t = tl.arange(0, THREADS)
            rows = b * RBS + t
            rmask = (t < RBS) & (rows < H)
        else:
            _store_group(attn_ptr, g, out1, out2, GROUP, D, BLOCK_G)
            tl.debug_barrier()  # the group's output, read back by every thread
            if SMEM:
                mbarrier_wait(bar, 0)
            lr = tl.arange(0, BR_OB)
            rows = b * RBS + lr
            rmask = (lr < RBS) & (rows < H)
            acc2 = tl.zeros([BR_OB, BK_OB], tl.float32)
            for k0 in tl.static_range(0, GD, BK_OB):
                offs_k = _tile_columns(lr, k0, BK_OB)
                x = tl.load(attn_ptr + g * GD + offs_k, mask=offs_k < GD, other=0.0).to(tl.float32)
                if SMEM:
                    w = slot_tile(slot, w_ptr, rmask, k0, GD, BR_OB, BK_OB)
                else:
                    w = _weight_tile(w_ptr, lr, rmask, k0, GD, BK_OB)
                acc2 = tl.fma(w.to(tl.float32), x, acc2)
            acc = tl.sum(acc2, axis=1)
        tl.atomic_add(acc_o_ptr + rows, acc, mask=rmask, sem="relaxed", scope="gpu")
    _zero_rows(acc_d_ptr, COPIES, pid, num_programs, rows_h, H, BR_H)
