"""What every stage of the persistent decode kernel (kernel.py) shares: the
per-layer offset table that addresses a layer's weights and KV cache, the PROBE build's time
stamps, the index helpers for a program's rows and a weight tile's columns, the residual
stream as it is read while a projection's sums still sit in an fp32 accumulator, and its
RMSNorm staged in shared memory for the tensor cores (stage A, the MLP and the LM head).

Why a module of its own: the kernel is split by what its stages do (this file, the attention
stage in attention.py, the LM head in head.py, the projections and the MLP in stages.py, the
layer loop in kernel.py); Triton inlines every jit function into the one kernel, so the split
costs nothing at run time.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.fastpath.ptx import stage_to_shared

# Rows of the per-layer offset table: where each layer's tensors start, in elements from the
# embedding weight (every tensor has the model's dtype, so one base pointer reaches them all).
# down_t: the down projection's weight transposed ([intermediate, hidden]; FUSED_MLP only); o_perm:
# the o projection's weight as [KV heads, hidden, group width] (FUSED_ATTN only, see _stage_attn_o).
_FIELDS = ("qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "ln1", "ln2", "gate_up_w", "down_w", "k_cache", "v_cache", "down_t",
           "o_perm")
_NUM_FIELDS = len(_FIELDS)
(F_QKV_W, F_QKV_B, F_Q_NORM, F_K_NORM, F_O_W, F_LN1, F_LN2, F_GU_W, F_DOWN_W, F_K_CACHE, F_V_CACHE, F_DOWN_T,
 F_O_PERM) = (
    tl.constexpr(i) for i in range(_NUM_FIELDS)
)
NUM_FIELDS = tl.constexpr(_NUM_FIELDS)

# Attention: KV positions per loop iteration, and the fewest positions worth a context split.
BLOCK_T = 64
SPLIT_TOKENS = 64
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
# Elements of one weight tile a program holds in registers (rows x K chunk).
_TILE_ELEMENTS = 8192


@triton.jit
def _at(base_ptr, layer, FIELD: tl.constexpr):
    """Pointer to a layer's tensor. `layer` is the layer's row of the offset table: a pointer into
    the table in global memory, or (an int32) the 32-bit address of its copy in shared memory
    (SMEM_WEIGHTS). The copy matters: every acquire at a grid barrier invalidates the SM's L1, so
    a table entry read from global memory after the barrier costs an L2 round trip before the
    loads that need it (a layer's norm weights, its KV cache) can even be issued. Offsets are a
    multiple of 16 elements (bind() checks), and saying so lets Triton vectorize the loads:
    without it every bf16 weight was read 2 bytes at a time, with a 64-bit address per element
    in registers."""
    if layer.dtype == tl.int32:
        # Not pure: a pure asm "reads no memory", so the compiler could move it before the
        # table's copy (and the CTA barrier after it).
        offset = tl.inline_asm_elementwise("ld.shared.b64 $0, [$1];", "=l,r", [layer + FIELD * 8], dtype=tl.int64,
                                           is_pure=False, pack=1)
    else:
        offset = tl.load(layer + FIELD)
    return base_ptr + tl.multiple_of(offset, 16)


@triton.jit
def _next_layer(layer):
    """The next layer's row of the offset table (see _at)."""
    if layer.dtype == tl.int32:
        return layer + NUM_FIELDS * 8
    else:
        return layer + NUM_FIELDS


@triton.jit
def _table_to_shared(table_ptr, table_sh, entries, BLOCK: tl.constexpr):
    """Copy the offset table (`entries` int64) into shared memory at table_sh (see _at); the
    caller's CTA barrier orders the copy before any read."""
    for i0 in range(0, entries, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        safe = tl.where(offs < entries, offs, 0)  # past the end: entry 0 again, to its own place
        tl.inline_asm_elementwise("st.shared.b64 [$1], $2; mov.u32 $0, 0;", "=r,r,l",
                                  [table_sh + safe * 8, tl.load(table_ptr + safe)], dtype=tl.int32, is_pure=False, pack=1)


# Points of a layer the PROBE build stamps (benchmarks/persistent_decode.py --timeline): per stage
# s, 3s its start (after the barrier), 3s+1 its work done, 3s+2 arrived and the next tile issued
# (the wait follows); in attention, 15 queries rotated, 16 cached positions walked, 17 the step's token
# attended and stored (last split), 18 the split count returned, 19 the splits combined (with
# FUSED_ATTN: 18 an o item's KV head counted complete, 19 its parts combined); with SMEM_WEIGHTS,
# 20 + s the stage's weights landed in its slot (its mbarrier wait done). Layer 0's points 6, 8
# and 12 also hold the program's start, the LM head's start and the program's end, and with the
# int8 head 7 its stream done and 13 its candidates recomputed.
_PROBE_POINTS = 25
PROBE_POINTS = tl.constexpr(_PROBE_POINTS)


@triton.jit
def _stamp(probe_row, POINT: tl.constexpr, num_programs, probe_half, PROBE: tl.constexpr):
    """PROBE builds only: the global timer (ns) and this SM's cycle counter at this point of the
    program, at probe_row[POINT * num_programs] and probe_half elements further."""
    if PROBE:
        ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        cycles = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(probe_row + POINT * num_programs, ns)
        tl.store(probe_row + probe_half + POINT * num_programs, cycles)


@triton.jit
def _stamp_sm(probe_row, POINT: tl.constexpr, num_programs, PROBE: tl.constexpr):
    """PROBE builds only: the SM this program runs on (%smid) at probe_row[POINT * num_programs],
    so that a benchmark can tell which program ran where (the block scheduler's choice)."""
    if PROBE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(probe_row + POINT * num_programs, sm.to(tl.int64))


@triton.jit
def _rows(item, rows_per_item, N, BLOCK_R: tl.constexpr):
    """Row indices [BLOCK_R] of work item `item` (rows_per_item rows of N) and their mask."""
    rows = item * rows_per_item + tl.arange(0, BLOCK_R)
    return rows, (rows < (item + 1) * rows_per_item) & (rows < N)


@triton.jit
def _item_rows(item, rows_per_item, N, BLOCK_R: tl.constexpr, THREADS: tl.constexpr, MMA: tl.constexpr):
    """_rows, in the layout the item's projection returns its rows in: one row per thread with
    tensor cores (MMA, mma_rows), else a [BLOCK_R] vector."""
    if MMA:
        t = tl.arange(0, THREADS)
        rows = item * rows_per_item + t
        rmask = (t < rows_per_item) & (rows < N)
    else:
        rows, rmask = _rows(item, rows_per_item, N, BLOCK_R)
    return rows, rmask


@triton.jit
def _tile_columns(rows, k0, BLOCK_K: tl.constexpr):
    """Column indices k0 + [0, BLOCK_K) broadcast to a weight tile's shape [BLOCK_R, BLOCK_K].
    Loading a projection's input with these gives it the tile's register layout (each thread
    keeps one copy of its columns): a 1-D load made Triton convert the layout through shared
    memory, with a CTA barrier, at every K chunk."""
    return rows[:, None] * 0 + (k0 + tl.arange(0, BLOCK_K))[None, :]


@triton.jit
def _weight_tile(w_ptr, rows, rmask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, k0:k0 + BLOCK_K] of a row-major [*, K] weight (masked rows and columns read nothing)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=rmask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _residual(resid_ptr, acc_ptr, offs, mask, H: tl.constexpr, COPIES: tl.constexpr):
    """The residual stream at offs (fp32). COPIES > 0 (FUSED_MLP, where the down projection's
    sums are still in the accumulator): round(round(sum of the accumulator's copies) + residual),
    what the down stage's residual add would have stored. The copies are summed in a fixed order."""
    x = tl.load(resid_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if COPIES > 0:
        s = tl.zeros(offs.shape, tl.float32)
        for c in tl.static_range(COPIES):
            s += tl.load(acc_ptr + c * H + offs, mask=mask, other=0.0)
        x = (s.to(resid_ptr.dtype.element_ty).to(tl.float32) + x).to(resid_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _zero_acc(acc_ptr, rows, rmask, H: tl.constexpr, COPIES: tl.constexpr):
    """Zero `rows` (where rmask) of each of an fp32 accumulator's COPIES copies of [H]."""
    for c in tl.static_range(COPIES):
        tl.store(acc_ptr + c * H + rows, tl.zeros(rows.shape, tl.float32), mask=rmask)


@triton.jit
def _embed_rows(base_ptr, token, resid_ptr, acc_ptr, offs, mask, H: tl.constexpr, COPIES: tl.constexpr):
    """Rows `offs` (where mask) of the token's embedding row (the table at base_ptr) become those
    rows of the residual stream, and those rows of the down sums' COPIES accumulators start at
    zero: the embedding stage's work, which a decode burst in one launch's picker does whole
    between steps (head._pick_token)."""
    tl.store(resid_ptr + offs, tl.load(base_ptr + token * H + offs, mask=mask), mask=mask)
    _zero_acc(acc_ptr, offs, mask, H, COPIES)


@triton.jit
def _zero_rows(acc_ptr, COPIES: tl.constexpr, pid, num_programs, rows_h, H: tl.constexpr, BR_H: tl.constexpr):
    """Zero this program's rows (rows_h per item) of an accumulator's COPIES copies."""
    for item in range(pid, tl.cdiv(H, rows_h), num_programs):
        rows, rmask = _rows(item, rows_h, H, BR_H)
        _zero_acc(acc_ptr, rows, rmask, H, COPIES)


@triton.jit
def _normed_to_shared(resid_ptr, acc_ptr, ln_ptr, eps, xbuf, H: tl.constexpr, BLOCK_X: tl.constexpr, dtype: tl.constexpr,
                      COPIES: tl.constexpr = 0):
    """RMSNorm(residual) * weight, rounded as _normed rounds it, staged at xbuf for the tensor-core
    path. The residual and the norm weights are loaded together, at once: with _rstd and then
    _normed, the weights' load waited for the sum of squares, a second L2 round trip after the
    barrier (every acquire empties the L1). The caller's CTA barrier orders the stores before the
    tensor-core program's reads. COPIES: see _residual."""
    offs = tl.arange(0, BLOCK_X)
    mask = offs < H
    stage_to_shared(_normed_input(resid_ptr, acc_ptr, ln_ptr, eps, offs, mask, H, dtype, COPIES), offs, mask, xbuf)


@triton.jit
def _normed_input(resid_ptr, acc_ptr, ln_ptr, eps, offs, mask, H: tl.constexpr, dtype: tl.constexpr,
                  COPIES: tl.constexpr = 0):
    """RMSNorm(residual) * weight at offs, in dtype, rounded as _normed rounds it (see
    _normed_to_shared); 0 where not mask."""
    x = _residual(resid_ptr, acc_ptr, offs, mask, H, COPIES)
    w = tl.load(ln_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) * (1.0 / H) + eps)
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)
