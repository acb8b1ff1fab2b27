"""A lone sequence's decode step as one persistent Triton kernel.

Why: one sequence decoding (a chat user, W5 in docs/benchmarks.md) reads every weight once per
token, ~1.2 GB for Qwen3-0.6B: 0.25-0.3 ms on an H200. The per-op decode graph takes ~1.3 ms,
because each of its ~250 kernels (four projections, attention, the fused small ops, x 28 layers)
costs its launch and ramp (~5 us) whatever it reads. Here the whole stack of layers is one launch:
one program per SM loops over the layers, splits each stage's work between the programs, and
waits at a grid-wide barrier (an atomic counter) where the next stage needs every program's
output. A barrier costs 0.86-0.93 us on an H200, less than a kernel boundary. Measured result
(docs/benchmarks.md, W5, H200, Qwen3-0.6B shape): 0.49 ms per token (the model forward; the LM
head and the sampler follow) at context 640 against the per-op graph's 1.12-1.19 ms, and faster
than it at every context measured (1.77 vs 2.89 ms at 16,384, session 12); still far from the
weight-read floor (~0.3 ms for the whole step). Per layer (`--timeline`, 28 per token, session
15): A 3.3-3.6 us, attention with the o projection 7.4-7.7, the MLP 5.6-5.9, each from a stage's
start to the next's; no stage waits for its weights (they are in shared memory by then, below).

Code shape that the measurements chose (local sm_90 compiles, `cuobjdump -sass`, then the H200):
- Weights through shared memory (SMEM_WEIGHTS; sm_90+, where the slices fit): a program's
  rows of a weight stage are one contiguous range, so thread 0 copies them into a shared-memory
  slot with one bulk asynchronous copy (TMA, inline PTX: cp.async.bulk counted in by an
  mbarrier), issued when the stage before it in that slot is done, two weight stages ahead of
  its use and across the barriers between. Through registers, ptxas kept only ~1 chunk of loads
  in flight (255 registers, spills): 669 -> 611 us per token at context 640 (H200, session 12),
  bit-identical results.
- 16-bit projections on tensor cores, straight from the slots (mma_asm: a row pair per mma, A's
  rows being 8-column chunks of a row, so ldmatrix meets no bank conflicts; the diagonal of
  the product is kept): 573 -> 567 us at context 640 (session 13), ~3,400 SASS instructions
  instead of ~5,800; results within rounding of the FMA path, which fp32 weights, K not a
  multiple of 128 and `mma_projections=False` keep. The plain mapping (rows 2 KB apart) was
  slower, 8-way bank conflicts, and padded rows cost a bulk copy per row (commits aa1fe56,
  a8d7997).
- The MLP in one stage (FUSED_MLP, `fused_mlp`, on with the slots): the down projection split
  by K, each program's [hidden] partial sum added into fp32 accumulator copies with atomic
  reductions (down_asm, _down_partial), which the next layer's stages A and C add to the residual
  (_residual): one barrier and one input round trip less per layer, 558 -> 519 us at context 640
  (session 14), with the next layer's qkv rows copied into slot X as soon as gate/up is done
  (issued after the stage, they kept stage A waiting ~1.9 us). benchmarks/reduce_latency.py
  measured the atomics: ~0.5 us more than a barrier's handoff with 4 copies. The sums' last bits
  follow the atomics' arrival order.
- The o projection in the attention stage (FUSED_ATTN, `fused_attn`, with FUSED_MLP): split by
  KV head and row block; each item waits for its head's parts (a count per layer and head),
  combines them itself and adds its rows' sums into a second accumulator (_stage_attn_o): the o
  stage's barrier and the combiner's election gone, 523 -> 489 us at context 640 (session 14).
- Where each bulk copy is issued (session 15): a program's copy streams into the SM through the
  same path from the L2 as the loads a stage waits on, and slows them while it lasts. Issued
  when stage A arrives, the gate/up rows (96 KB per program for Qwen3-0.6B) held the barrier
  after A 1.02 us from its last arrival, against 0.26 at the others; issued once a program's
  attention parts are stored (before its o item waits; GU_LATE, `gate_up_late`), the barrier
  takes 0.26 us and the o item's wait and combine ~0.5 us more: 485 -> 471-482 us per token at
  context 640. The o tile is copied in stage A once the stage's input is loaded, not while it
  loads (O_LATE, `o_late`; within noise, 0-1%). Slower: the gate/up rows after the o item's
  combine, the down rows before attention's arrival, the next qkv rows after the down product.
- A grid barrier's arrival (its release) waits for the SM's bulk copies in flight, not only for
  its stores (session 23: issued by warp 1 instead of thread 0, a copy held the arrival after
  attention 0.74 -> 1.68 us). The next layer's qkv rows, copied as soon as gate/up is done,
  held the MLP's arrival 1.9 us (0.97 after stage A, whose copy goes out after its arrival);
  the down sums' reductions only 0.24 of that. So half of them are copied then and the rest
  once the MLP has arrived (QKV_EARLY, `qkv_early`: eighths copied early), and stage A waits for
  them only once its input is staged: layers 473.6 -> 458.2 us per token, W5 +49-57 tok/s.
  Early eighths 0, 2, 3, 4, 5, 6, 8: W5 ~2,010 (no gain), 2,028, 2,045, 2,059, 2,060, 2,051,
  2,011. The same split of the gate/up rows (stage B) or of the o tile (stage A) was slower
  (1,985 and 2,025 with qkv_early=4, against 2,058).
- After a barrier a stage issues every load it needs at once: every acquire empties the SM's L1,
  so a load whose address came from another load cost a second L2 round trip. The offset table
  lives in shared memory (_at), the step's rotary cos/sin, slot and context are loaded once per
  step (_step_values), and the norm weights, the bias and the residual rows are loaded with the
  stage's input: 617 -> 587 us (the table and the step values) and the rest part of the 587 ->
  567 above (session 13).
- The first cached K/V tile, loaded during the barrier before attention, goes through the L2
  only (.cg, kv_prefetch_cg): loaded into the L1, its fills held the acquire that ends that
  barrier (1.0 us after the last arrival there, 0.26 at the others): 567 -> 559 us (session 13).
- Projections accumulate a [rows, K chunk] fp32 tile across K chunks and reduce it once, and load
  the input vector broadcast to the tile's shape: a 1-D input made Triton convert its layout
  through shared memory with a CTA barrier per chunk, and a per-chunk row sum did too, which
  kept the next chunk's weight loads from issuing early (1.07 -> 0.87 ms per token, with the
  next change; 64-position K/V tiles then 0.83).
- Projections accumulate with tl.fma. The kernel compiles with enable_fp_fusion=False, so that
  its elementwise ops round as the per-op kernels do, and that had split every multiply-add into
  an FMUL and an FADD: 6,304 -> 5,800 SASS instructions, 704 -> 690 us per token at context 640
  (H200, session 11).
- Attention multiplies with tl.dot, the group's query heads padded to 16 rows: 3-D broadcast
  products took 238 registers and 14.6 us per layer, tl.dot 168 and 8.9 us.
- The split combine is an unrolled loop of elementwise operations over the splits (3.2 -> 1.0
  us), and the first cached K/V tile's block-table lookup runs once per step, not per layer
  (it held each program ~0.9 us before a barrier): 0.83 -> 0.79 ms per token.
- A program arrives at a barrier before it issues the next stage's first tiles, and waits after
  (0.79 -> 0.75 ms per token). Prefetching weights into the L2 (one prefetch per line, or bulk
  prefetches) during the stage before was slower in every variant tried: issuing the
  prefetches cost more than the L2 hits saved.
- What other programs wrote this step (the residual stream, q/k/v, the attention parts) is read
  with ordinary, L1-cached loads: every such read follows an acquire at GPU scope in the reading
  program (the barrier's poll or arrival, or the split count), and each acquire invalidates the
  SM's L1 (CCTL.IVALL in the SASS), so no stale line is read; a projection's K chunks and warps
  then share the input's lines in the L1. Reading them from the L2 (.cg) took 741 -> 703 us per
  token (context 640).
- The step's own token in an attention part of its own where that costs no split (see _splits):
  744 -> 706 us per token at context 640, faster at every context measured.
- Tried and slower (the code is in the history): projections' K loops as dynamic loops (709 ->
  755 us) or pipelined by Triton through shared memory (tl.range num_stages 2-4, cp.async:
  1,024-1,420 us; commit ec62a37); prefetching a projection's later chunks into the L1 at the
  stage's start (704 -> 772 us; commit eb21c16); a grid barrier of per-program arrival flags
  (1.77 against 0.86 us per barrier; commit 65cf178).

Stages of a layer (each program takes a slice of rows, or of (KV head, context split) pairs).
The default where the weights go through the shared-memory slots (FUSED_MLP and FUSED_ATTN),
three stages, each followed by a grid barrier:
  A  RMSNorm of the residual stream (recomputed by every program: hidden_size values, the
     previous layer's down sums added first), then the packed q/k/v projection rows.
  B  q/k norm + rotary, attention over the paged KV cache in context splits (one more part per
     KV head attends to the step's own token and stores its K/V, where that costs no split:
     own_token_split); each part counts itself in per KV head, then the o projection split by
     KV head and row block: an item waits for its head's count, combines the parts and adds
     its rows' sums into an fp32 accumulator with atomics (_stage_attn_o).
  D  RMSNorm of the residual plus the o sums, gate and up rows, SiLU-and-mul, then the down
     projection split by K: each program's [hidden] partial sum added into accumulator copies
     with atomics (_stage_gate_up), which the next layer's A adds to the residual.
See _layer_stage for the residual's two buffers. Without the fused o projection, B's last part
per KV head (an atomic count) combines the parts into the attention output and a stage C does
the o projection rows plus the residual add: four stages; without the fused MLP either, D stops
at SiLU-and-mul and a stage E does the down projection rows plus the residual add: five (what
models whose slices do not fit the slots, and the stepwise launches by default, run). Before
the first layer the embedding row becomes the residual stream; after the last, the final
RMSNorm writes the hidden state. With FUSED_HEAD (`fused_head`, on with the tensor-core slots)
the LM head and the greedy argmax (or, at a temperature above 0, fused_sampler's Gumbel-max
sample) follow in the kernel (runner/persistent_head.py): every program norms the residual
itself, streams its share of the vocabulary rows through slots X and Y (the first two chunks
copied during the last layer's barrier), stores the logits and folds its best into a count
whose last arrival writes the token; that program's rows of the normed state are the hidden
state output (no final-norm stage). Against cuBLAS's head (74.8 us), GreedyRow (3.3 us) and a
memset after the kernel: W5 1,855 -> 1,871-1,877 tok/s (H200, session 16). Where the step
only needs its token, the head's int8 copy picks it, exactly (HEAD_Q, `quantized_head`,
runner/head_quant.py: half the head's bytes): W5 1,881 -> 1,974 (session 18); its candidate
rows listed in one scan, 1,970 -> 1,977 (session 19). Otherwise the
LM head and the sampler run after the kernel, as for every other step (the runner's CUDA graphs
of the kernel hold them: runner/cuda_graph.py).

A decode burst in one launch (MULTI_STEP, `multi_step`, on with the fused head): the kernel
loops over the burst's steps, each reading its own input record. Between steps, the program
that picks the token (the last to count in, _pick_token) writes the token's embedding into the
residual stream and releases a step word the others wait on; layer 0's qkv rows of the next
step are copied into slot X as soon as the head is done (_next_step_weights); after the last
step that program writes the launch's tokens into the runner's pinned host memory
(_tokens_out: no copy after the launch). That replaces the launch's end, the next launch's start (2.6-3.3 us between an eager launch's last program
and the next one's first) and its prologue (4.6 us from a program's start to layer 0: the
offset table, the token's and its embedding row's loads, the embedding stage's barrier). Eager
launches at context 384: 8 steps in one launch 492-496 us per token, against 495-498 for 8
launches of the per-step build of the time (H200, session 20); W5 1,977 -> 1,984 tok/s in one
call, 1,981 -> 1,982 on another host. The saving per step is ~6 us, but the loop around the layers changed how ptxas compiled
them: the same build at one step was up to ~12 us slower than the per-step build until the LM
head's aranges were kept out of loop-invariant hoisting (ptx.loop_zero), which is what the gain
rests on. (The per-step build, multi_step=False, then measured 510-513 us per step against the
multi-step build's 502-504 for one step, in one call.)

Numerics follow the per-op path (layers/fused.py): every value the reference rounds to the
activation dtype (projection outputs, the residual sums, normalised values, rotary products,
SiLU) is rounded here too; projections accumulate in fp32 in another order than cuBLAS, and the
attention combines splits like the split-KV decode kernel, so results agree to rounding.

Where the code is: this module holds the projection and MLP stages, the kernel's layer loop and
the host side (PersistentDecoder); the attention stage is in runner/persistent_attention.py, the
LM head and argmax (FUSED_HEAD) in runner/persistent_head.py, the offset table, time stamps,
index helpers and normed input every stage uses in runner/persistent_common.py, and the inline
PTX (barriers, bulk copies, tensor-core and K-split programs) in runner/ptx.py.

Reference path and tests: the same stage code also runs as one launch per stage ("stepwise"),
where kernel boundaries are the barriers. That is what runs on the CPU under TRITON_INTERPRET=1
(whose programs run one after another, so a spinning barrier could never be passed) and is
compared with the model's own forward there; on CUDA the persistent launch is compared with the
stepwise one and with the per-op CUDA graph (tests/test_persistent_decode.py).

Scope: Llama-family decoders (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norm) without o/MLP
biases, one rank, a power-of-two head_dim of at least 32, every weight and the KV cache in one
dtype. The shared-memory slots need each program's slices to fit beside Triton's own shared
memory (Qwen3-0.6B on 132 SMs: 144 KB of 227 KB); larger models load weights into registers.
The runner (model_runner.py) compiles it in the background after start-up and from then
on replays a CUDA graph of it for every decode step of exactly one sequence; anything else
takes the per-op path.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from nanovllm.attention.backend import AttentionMetadata
from nanovllm.layers.fused_sampler import BLOCK_V as GUMBEL_BLOCK
from nanovllm.precompile import compiling_only, launch
from nanovllm.runner import head_quant
from nanovllm.runner.persistent_attention import _first_kv_rows, _kv_load, _stage_attention, _stage_attn_o, _step_values
from nanovllm.runner.persistent_common import (
    _FIELDS, _LOG2E, _NUM_FIELDS, _PROBE_POINTS, _TILE_ELEMENTS, BLOCK_T, F_DOWN_T, F_DOWN_W, F_GU_W, F_K_CACHE, F_LN1,
    F_LN2, F_O_PERM, F_O_W, F_QKV_B, F_QKV_W, F_V_CACHE, NUM_FIELDS, PROBE_POINTS, SPLIT_TOKENS, _at, _embed_rows, _item_rows,
    _next_layer, _normed_to_shared, _residual, _rows, _stamp, _stamp_sm, _table_to_shared, _tile_columns, _weight_tile, _zero_acc,
)
from nanovllm.runner.persistent_head import (
    _issue_head_chunk, _issue_head_q_chunk, _pick_token, _stage_head, _stage_head_q, _tokens_out,
)
from nanovllm.runner.ptx import (
    MMA_K_STEP, align_up, bulk_copy, down_asm, down_rows, grid_arrive, grid_wait, mbarrier_wait, mbarriers_init, mma_asm,
    mma_rows, reserve_shared_memory, shared_address, slot_tile, stage_f32_to_shared, stage_to_shared, wait_count,
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
    qkv rows (if next_valid) are copied in right then, before the down projection: issued after
    the stage, they arrived ~1.9 us into stage A (H200, --timeline). QKV_EARLY < 8: only that
    many eighths of them here, the rest once the stage has arrived (see _decode_kernel)."""
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


_STAGES_PER_LAYER = 5


@triton.jit(do_not_specialize=("layer", "smem_off", "num_steps", "rec8", "rec4"))
def _decode_kernel(
    base_ptr, table_ptr, final_norm_ptr, tok_ptr, resid_ptr, qkv_ptr, attn_ptr, act_ptr, out_ptr, acc_ptr,
    resid2_ptr, acc_o_ptr, part_acc_ptr, part_ml_ptr, sync_ptr, pos_ptr, slot_ptr, seq_len_ptr, block_table_ptr, cos_sin_ptr, probe_ptr,
    eps, qk_eps, qk_scale, stride_cb, stride_cs, num_layers, layer, rows_qkv, rows_h, rows_inter, smem_off,
    PERSISTENT: tl.constexpr, STAGE: tl.constexpr,
    H: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr, OWN_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_H: tl.constexpr, BK_H: tl.constexpr, BK_O: tl.constexpr,
    BK_DOWN: tl.constexpr, BR_INTER: tl.constexpr, BK_INTER: tl.constexpr, BLOCK_T: tl.constexpr,
    ONE_THREAD_BARRIER: tl.constexpr = False, STAGE_MASK: tl.constexpr = 31, PROBE: tl.constexpr = False,
    SMEM_WEIGHTS: tl.constexpr = False, TABLE_BYTES: tl.constexpr = 0, SLOT_X_BYTES: tl.constexpr = 0,
    SLOT_Y_BYTES: tl.constexpr = 0, XBUF_BYTES: tl.constexpr = 0, MMA_QKV: tl.constexpr = "", MMA_O: tl.constexpr = "",
    MMA_GU: tl.constexpr = "", MMA_DOWN: tl.constexpr = "", BX_O: tl.constexpr = 16, BX_DOWN: tl.constexpr = 16,
    THREADS: tl.constexpr = 256, KV_PREFETCH_CG: tl.constexpr = False, ACC_COPIES: tl.constexpr = 0,
    BK_DT: tl.constexpr = 16, DOWN_ASM: tl.constexpr = "", FUSED_ATTN: tl.constexpr = False, RBS: tl.constexpr = 1,
    BR_OB: tl.constexpr = 1, BK_OB: tl.constexpr = 16, MMA_OB: tl.constexpr = "", GU_LATE: tl.constexpr = False,
    O_LATE: tl.constexpr = False, QKV_EARLY: tl.constexpr = 8, head_off=0, logits_ptr=None, next_tok_ptr=None,
    head_val_ptr=None, head_idx_ptr=None,
    vocab=0, rows_vocab=0, FUSED_HEAD: tl.constexpr = False, HEAD_CR: tl.constexpr = 1, MMA_HEAD: tl.constexpr = "",
    HEAD_PARTS: tl.constexpr = 1, temp_ptr=None, seed_ptr=None, SAMPLE_BLOCK: tl.constexpr = 2048,
    head_q_ptr=None, head_meta_ptr=None, HEAD_Q: tl.constexpr = False, HEAD_Q_CR: tl.constexpr = 1,
    MMA_HEAD_Q: tl.constexpr = "", HEAD_META_OFF: tl.constexpr = 0, HEAD_CAND_OFF: tl.constexpr = 0,
    HEAD_CAP: tl.constexpr = 1, HEAD_NC: tl.constexpr = 8, HEAD_X_SCALE: tl.constexpr = 1.0, HEAD_LR: tl.constexpr = 1,
    MULTI_STEP: tl.constexpr = False, num_steps=1, rec8=0, rec4=0, host_tok_ptr=None,
):
    """PERSISTENT: every stage of every layer, with grid barriers between them (needs every
    program resident at once: launch at most one program per SM). Each stage's first weight
    tile is loaded during the barrier it waits at: after this program arrives, before it polls
    (loading it before the previous stage's work measured the same as after it, 1,091 vs 1,088 us
    per token). Otherwise: only stage STAGE (-1 embedding, 0-4 a layer's stages A-E of `layer`, 5
    the final norm), its tile loaded at its start. Benchmarks only: STAGE_MASK skips stages of
    the persistent kernel; PROBE stamps the times of each layer's PROBE_POINTS into probe_ptr
    (see _stamp). SMEM_WEIGHTS (persistent only): weights through two shared-memory slots, X
    (qkv, then gate and up: SLOT_X_BYTES) and Y (o, then down), at smem_off bytes into the
    dynamic shared memory, after their mbarriers and a copy of the offset table (TABLE_BYTES,
    see _at); each weight stage's rows are copied in
    when the stage before it in the same slot is done (for qkv: the previous layer's gate and
    up), so that a copy has the stages between to land. SLOT_Y_BYTES is not read here: it only
    makes the slots' total size part of the compiled variant, whose launch reserves it. MMA_QKV,
    MMA_O, MMA_GU, MMA_DOWN (SMEM_WEIGHTS, 16-bit; "" for FMAs): each projection's tensor-core
    program (mma_asm), its input staged at XBUF_BYTES of shared memory after the slots and its
    warps' sums after that; BX_O and BX_DOWN the staged inputs' block widths, THREADS the
    program's threads. KV_PREFETCH_CG: see PersistentDecoder. ACC_COPIES > 0: FUSED_MLP (see
    _stage_gate_up; four stages per layer, the down projection's sums in ACC_COPIES copies of an
    fp32 accumulator at acc_ptr; with SMEM_WEIGHTS its program is DOWN_ASM (down_asm), else the
    transposed weight is read BK_DT columns at a time). FUSED_ATTN (with ACC_COPIES): the o
    projection in the attention stage (_stage_attn_o: RBS rows per item, BR_OB x BK_OB tiles or
    the tensor-core program MMA_OB), three stages per layer, the residual in resid and resid2,
    the o sums in acc_o (see _layer_stage); the attention parts count at sync_ptr[1 + layer * NK].
    GU_LATE, O_LATE (FUSED_ATTN, SMEM_WEIGHTS): when the gate/up rows and the o tile are copied
    in (see the module docstring and _layer_stage); QKV_EARLY (with O_LATE and ACC_COPIES): how
    many eighths of the next layer's qkv rows are copied during the MLP, the rest once it
    arrives (8: all during the MLP, stage A waiting for them at its start). FUSED_HEAD (persistent, FUSED_ATTN, MMA): the
    LM head and the greedy argmax follow the last layer (_stage_head: the weight at head_off,
    `vocab` rows, rows_vocab per program, HEAD_CR per chunk; the logits to logits_ptr, the token
    to next_tok_ptr, the programs' bests at head_val/head_idx, their count after the attention
    counts; a temperature above 0 at temp_ptr samples the token instead, under the seed at
    seed_ptr, as fused_sampler.gumbel_argmax with tiles of SAMPLE_BLOCK would). HEAD_Q (with
    FUSED_HEAD): unless the temperature is below 0 (the caller wants every logit), the token is
    picked from the head's int8 copy at head_q_ptr with its meta at head_meta_ptr
    (_stage_head_q: HEAD_Q_CR rows per chunk, MMA_HEAD_Q, the meta and the candidate list
    HEAD_META_OFF and HEAD_CAND_OFF bytes into slot X, HEAD_CAP candidates per round, HEAD_NC
    rows per recompute, the input scaled by HEAD_X_SCALE) and no logits are stored. MULTI_STEP
    (FUSED_HEAD with O_IN_A): num_steps decode steps in this launch, step i's inputs rec8 int64
    (rec4 32-bit) elements after step 0's (tok_ptr, pos_ptr, slot_ptr, seq_len_ptr, temp_ptr,
    seed_ptr), its token written over step i + 1's input token (the last step's to next_tok_ptr);
    see the module docstring. FUSED_HEAD: the launch's tokens, in step order, also go to
    host_tok_ptr (the runner's pinned host memory: no copy after the launch, _tokens_out)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    count_ptr = sync_ptr + 1  # per-KV-head split counters; sync_ptr[0] counts barrier arrivals
    # FUSED_HEAD: the pick's count is the last of the head_sync_n words the picker zeroes; the step
    # word and the int8 head's shared bound follow them (_pick_token).
    head_sync_n = 2 + num_layers * NK
    slot_x = 0
    slot_y = 0
    bar_x = 0
    bar_y = 0
    xbuf = 0
    red = 0
    FUSED: tl.constexpr = ACC_COPIES > 0
    # Where the gate/up rows and the o tile are copied into their slots (see _layer_stage).
    GU_IN_B: tl.constexpr = GU_LATE and FUSED_ATTN and SMEM_WEIGHTS
    O_IN_A: tl.constexpr = O_LATE and FUSED_ATTN and SMEM_WEIGHTS and MMA_QKV != ""  # A stages its input first
    # The next layer's qkv rows: QKV_E eighths of them copied during the MLP, the rest once it arrives.
    QKV_E: tl.constexpr = QKV_EARLY if O_IN_A and FUSED else 8
    # FUSED_HEAD: the parity of the LM head's first mbarrier phase in each slot, one phase per copy
    # the layers made there before it. X: the first qkv rows, then per layer the gate/up rows and
    # the next qkv rows (the last layer's empty): odd. Y: per layer the o tile (in stage A with
    # O_IN_A, else once ahead and after each MLP) and the down rows: even with O_IN_A.
    HEAD_PX: tl.constexpr = 1
    HEAD_PY: tl.constexpr = 0 if O_IN_A else 1
    if FUSED_ATTN:
        post_ptr = resid2_ptr  # the residual after a layer's MLP (see _layer_stage)
    else:
        post_ptr = resid_ptr
    if PERSISTENT:
        probe_half = num_layers * PROBE_POINTS * num_programs
        # PROBE: layer 0's free points 6, 8 and 12 hold the program's start, the head's start
        # and the program's end (benchmarks/persistent_decode.py --timeline).
        _stamp(probe_ptr + pid, 6, num_programs, probe_half, PROBE)
        _stamp_sm(probe_ptr + pid, 14, num_programs, PROBE)  # (point 14 of layer 0: free, as 6, 8 and 12)
        if SMEM_WEIGHTS:
            bar_x = shared_address(smem_off)
            bar_y = bar_x + 8
            table = bar_x + 128
            slot_x = table + TABLE_BYTES
            slot_y = slot_x + SLOT_X_BYTES
            xbuf = slot_y + SLOT_Y_BYTES
            red = xbuf + XBUF_BYTES
            _table_to_shared(table_ptr, table, NUM_FIELDS * num_layers, 256)
            mbarriers_init(bar_x, bar_y)  # its CTA barrier also orders the table's copy before its reads
            _issue_weights(0, table, True, base_ptr, slot_x, bar_x, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER)
            if not O_IN_A:
                _issue_weights(2, table, True, base_ptr, slot_y, bar_y, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D,
                               INTER, FUSED, FUSED_ATTN, RBS, num_programs)
        _stage_embed(base_ptr, tok_ptr, post_ptr, acc_ptr, pid, num_programs, rows_h, H, BR_H, ACC_COPIES)
        seen = grid_arrive(sync_ptr, ONE_THREAD_BARRIER)
        t1, t2 = _prefetch(0, table_ptr, not SMEM_WEIGHTS, base_ptr, pid, rows_qkv, rows_h, rows_inter,
                      H, NQ, NK, D, INTER, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN, BR_INTER, BK_INTER)
        if not MULTI_STEP:  # (else loaded at each step's start, below)
            kv_rows, kv_valid = _first_kv_rows(seq_len_ptr, block_table_ptr, pid, num_programs, stride_cb, stride_cs,
                                               NK, D, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT, BLOCK_T)
            cos, sin, step_slot, ctx = _step_values(pos_ptr, slot_ptr, seq_len_ptr, cos_sin_ptr, D,
                                                    qkv_ptr.dtype.element_ty)
        arrivals = num_programs
        grid_wait(sync_ptr, seen, arrivals)
        if MULTI_STEP:
            steps_here = num_steps
        else:
            steps_here = 1
        last = pid < 0  # whether this program picked the last token (FUSED_HEAD: _pick_token)
        for step in range(0, steps_here):
            # MULTI_STEP: the launch runs num_steps decode steps (a burst); step i's input record lies
            # i * rec8 int64 words (rec4 32-bit words) after the first's, and its token's embedding is
            # already the residual stream (_pick_token).
            if MULTI_STEP:  # the step's values, from its record (needed from stage A's arrival on)
                kv_rows, kv_valid = _first_kv_rows(seq_len_ptr + step * rec4, block_table_ptr, pid, num_programs,
                                                   stride_cb, stride_cs, NK, D, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS,
                                                   OWN_SPLIT, BLOCK_T)
                cos, sin, step_slot, ctx = _step_values(pos_ptr + step * rec8, slot_ptr + step * rec8,
                                                        seq_len_ptr + step * rec4, cos_sin_ptr, D,
                                                        qkv_ptr.dtype.element_ty)
            # Placeholders, set before each use (defined per step: nothing of a step is carried
            # through the head into the next).
            kv1 = tl.zeros([BLOCK_T, D // 2], base_ptr.dtype.element_ty)
            kv2 = kv1
            kv3 = kv1
            kv4 = kv1
            if HEAD_Q:  # the 16-bit head runs (every logit stored) only where the step asks for it
                head_exact = tl.load(temp_ptr + step * rec4) < 0.0
            for layer_i in range(0, num_layers):
                if SMEM_WEIGHTS:
                    layer_ptr = table + layer_i * (NUM_FIELDS * 8)
                else:
                    layer_ptr = table_ptr + layer_i * NUM_FIELDS
                probe_row = probe_ptr + layer_i * PROBE_POINTS * num_programs + pid
                if FUSED_ATTN:
                    count_ptr = sync_ptr + 1 + layer_i * NK  # this layer's attention-part counts (_stage_attn_o)
                for stage in tl.static_range(0, 5):
                    # FUSED_ATTN: no stage 2 (the o projection is in stage 1); FUSED_MLP: no stage 4.
                    if (stage != 2 or not FUSED_ATTN) and (stage != 4 or not FUSED):
                        _stamp(probe_row, 3 * stage, num_programs, probe_half, PROBE)
                        if SMEM_WEIGHTS:
                            # Slot X holds qkv (phase 0 of each layer's two) and gate/up (1); Y o (0) and down (1).
                            # (FUSED_ATTN waits for its o tile in _stage_attn_o, FUSED_MLP for its down rows in
                            # _down_partial.)
                            if stage == 0:
                                if QKV_E == 8:  # (else once its input is staged: _stage_qkv's LATE_WAIT)
                                    mbarrier_wait(bar_x, 0)
                            elif stage == 2:
                                mbarrier_wait(bar_y, 0)
                            elif stage == 3:
                                mbarrier_wait(bar_x, 1)
                            elif stage == 4:
                                mbarrier_wait(bar_y, 1)
                            _stamp(probe_row, 20 + stage, num_programs, probe_half, PROBE)
                        if (STAGE_MASK >> stage) & 1:
                            _layer_stage(
                                stage, t1, t2, kv1, kv2, kv3, kv4, layer_ptr, base_ptr, resid_ptr, qkv_ptr, attn_ptr, act_ptr,
                                acc_ptr, part_acc_ptr, part_ml_ptr, count_ptr, cos, sin, step_slot, ctx, block_table_ptr,
                                eps, qk_eps, qk_scale, stride_cb, stride_cs, pid, num_programs, rows_qkv, rows_h, rows_inter,
                                probe_row, probe_half, slot_x, slot_y, bar_x, bar_y, layer_i + 1 < num_layers, H, NQ, NK, D,
                                INTER, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT, BLOCK_G, HAS_NORM, HAS_BIAS, BR_QKV, BK_QKV,
                                BR_H, BK_O, BK_DOWN, BR_INTER, BK_INTER, BLOCK_T, PROBE, SMEM_WEIGHTS, xbuf, red, MMA_QKV, MMA_O,
                                MMA_GU, MMA_DOWN, BK_H, BX_O, BX_DOWN, THREADS, ACC_COPIES, BK_DT, DOWN_ASM, resid2_ptr, acc_o_ptr,
                                FUSED_ATTN, True, RBS, BR_OB, BK_OB, MMA_OB, GU_IN_B, O_IN_A, QKV_E,
                            )
                        _stamp(probe_row, 3 * stage + 1, num_programs, probe_half, PROBE)
                        seen = grid_arrive(sync_ptr, ONE_THREAD_BARRIER)
                        # The first tile of the next stage with weights, loaded during this barrier:
                        # stage 0's loads the o tile (gate/up with FUSED_ATTN), which waits through
                        # attention; the layer's last stage loads stage 0 of the next layer.
                        if SMEM_WEIGHTS:
                            # The slot this stage read is free (every thread passed the CTA barrier in
                            # grid_arrive): copy in the stage that uses it next.
                            if stage == 0 and not GU_IN_B:
                                _issue_weights(3, layer_ptr, True, base_ptr, slot_x, bar_x, pid, rows_qkv, rows_h, rows_inter,
                                               H, NQ, NK, D, INTER)
                            elif stage == 1:
                                if FUSED_ATTN:  # attention read the o tile: slot Y takes the down rows
                                    _issue_weights(4, layer_ptr, True, base_ptr, slot_y, bar_y, pid, rows_qkv, rows_h, rows_inter,
                                                   H, NQ, NK, D, INTER, FUSED)
                            elif stage == 2:
                                _issue_weights(4, layer_ptr, True, base_ptr, slot_y, bar_y, pid, rows_qkv, rows_h, rows_inter,
                                               H, NQ, NK, D, INTER, FUSED)
                            elif stage == 3:
                                if FUSED:  # the next qkv rows are on their way (_stage_gate_up); no stage 4: slot Y is free
                                    if QKV_E < 8:  # the rest of them, completing their phase (before the head's chunk 0)
                                        _issue_weights(0, _next_layer(layer_ptr), layer_i + 1 < num_layers, base_ptr, slot_x,
                                                       bar_x, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER, False,
                                                       False, 1, 1, 2, QKV_E)
                                    if not O_IN_A:  # (else the next o tile is copied in its stage A)
                                        _issue_weights(2, _next_layer(layer_ptr), layer_i + 1 < num_layers, base_ptr, slot_y,
                                                       bar_y, pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER, FUSED,
                                                       FUSED_ATTN, RBS, num_programs)
                                    if FUSED_HEAD:
                                        if layer_i + 1 == num_layers:  # both slots are free: the LM head's first chunks
                                            # (The 16-bit calls appear twice: Triton compiles both arms of a run-time
                                            # `if`, and the int8 arm exists only with HEAD_Q's arguments.)
                                            if HEAD_Q:
                                                if head_exact:
                                                    _issue_head_chunk(0, base_ptr, head_off, slot_x, bar_x, pid, rows_vocab,
                                                                      vocab, HEAD_CR, H)
                                                    _issue_head_chunk(1, base_ptr, head_off, slot_y, bar_y, pid, rows_vocab,
                                                                      vocab, HEAD_CR, H)
                                                else:
                                                    _issue_head_q_chunk(0, head_q_ptr, head_meta_ptr, slot_x, bar_x,
                                                                        slot_x + HEAD_META_OFF, pid, rows_vocab, vocab,
                                                                        HEAD_Q_CR, H)
                                                    _issue_head_q_chunk(1, head_q_ptr, head_meta_ptr, slot_y, bar_y,
                                                                        slot_x + HEAD_META_OFF, pid, rows_vocab, vocab,
                                                                        HEAD_Q_CR, H)
                                            else:
                                                _issue_head_chunk(0, base_ptr, head_off, slot_x, bar_x, pid, rows_vocab,
                                                                  vocab, HEAD_CR, H)
                                                _issue_head_chunk(1, base_ptr, head_off, slot_y, bar_y, pid, rows_vocab,
                                                                  vocab, HEAD_CR, H)
                                else:
                                    _issue_weights(0, _next_layer(layer_ptr), layer_i + 1 < num_layers, base_ptr, slot_x, bar_x,
                                                   pid, rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER)
                            elif stage == 4:
                                _issue_weights(2, _next_layer(layer_ptr), layer_i + 1 < num_layers, base_ptr, slot_y, bar_y, pid,
                                               rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER)
                        elif stage != 1:  # the next stage with weights: after the layer's last, the next layer's first
                            if stage == 0:
                                t1, t2 = _prefetch(3 if FUSED_ATTN else 2, layer_ptr, True, base_ptr, pid, rows_qkv, rows_h,
                                                   rows_inter, H, NQ, NK, D, INTER, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN, BR_INTER,
                                                   BK_INTER)
                            elif stage == 4 or (stage == 3 and FUSED):
                                t1, t2 = _prefetch(0, _next_layer(layer_ptr), layer_i + 1 < num_layers, base_ptr, pid, rows_qkv,
                                                   rows_h, rows_inter, H, NQ, NK, D, INTER, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN,
                                                   BR_INTER, BK_INTER)
                            else:
                                t1, t2 = _prefetch(stage + 1, layer_ptr, True, base_ptr, pid, rows_qkv, rows_h, rows_inter,
                                                   H, NQ, NK, D, INTER, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN, BR_INTER, BK_INTER)
                        if stage == 0:
                            kv1, kv2, kv3, kv4 = _kv_load(_at(base_ptr, layer_ptr, F_K_CACHE), _at(base_ptr, layer_ptr, F_V_CACHE),
                                                          kv_rows, kv_valid, D // 2, KV_PREFETCH_CG)
                        _stamp(probe_row, 3 * stage + 2, num_programs, probe_half, PROBE)
                        arrivals += num_programs
                        grid_wait(sync_ptr, seen, arrivals)
            _stamp(probe_ptr + pid, 8, num_programs, probe_half, PROBE)
            if not FUSED_HEAD:  # (else the head stores the hidden state: _head_input)
                _stage_final_norm(post_ptr, acc_ptr, final_norm_ptr, out_ptr, eps, pid, num_programs, rows_h, H, BR_H,
                                  BK_H, ACC_COPIES)
            else:
                temp_s = temp_ptr + step * rec4  # (computed here, not live through the layers)
                seed_s = seed_ptr + step * rec8
                if not HEAD_Q:
                    top, top_row = _stage_head(
                        base_ptr, head_off, post_ptr, acc_ptr, final_norm_ptr, eps, logits_ptr, pid, rows_vocab, vocab,
                        slot_x, slot_y, bar_x, bar_y, xbuf, red, H, BK_H, ACC_COPIES, THREADS, HEAD_CR, HEAD_PX, HEAD_PY,
                        MMA_HEAD, temp_s, seed_s, SAMPLE_BLOCK, out_ptr, rows_h, MULTI_STEP)
                elif head_exact:
                    top, top_row = _stage_head(
                        base_ptr, head_off, post_ptr, acc_ptr, final_norm_ptr, eps, logits_ptr, pid, rows_vocab, vocab,
                        slot_x, slot_y, bar_x, bar_y, xbuf, red, H, BK_H, ACC_COPIES, THREADS, HEAD_CR, HEAD_PX, HEAD_PY,
                        MMA_HEAD, temp_s, seed_s, SAMPLE_BLOCK, out_ptr, rows_h, MULTI_STEP)
                else:
                    top, top_row = _stage_head_q(
                        base_ptr, head_off, head_q_ptr, head_meta_ptr, post_ptr, acc_ptr, final_norm_ptr, eps, pid,
                        num_programs, rows_vocab, vocab, slot_x, slot_y, bar_x, bar_y, xbuf, red, H, BK_H, ACC_COPIES,
                        THREADS, HEAD_Q_CR, HEAD_PX, HEAD_PY, MMA_HEAD_Q, temp_s, seed_s, SAMPLE_BLOCK, HEAD_META_OFF,
                        HEAD_CAND_OFF, HEAD_CAP, HEAD_NC, HEAD_X_SCALE, out_ptr, rows_h, probe_ptr + pid, probe_half,
                        PROBE, HEAD_LR, sync_ptr + head_sync_n + 1, MULTI_STEP)
                more = step + 1 < steps_here
                nxt = tl.minimum(step + 1, steps_here - 1)
                if MULTI_STEP:  # layer 0's qkv rows of the next step on their way into slot X (free now)
                    if HEAD_Q:
                        head_cr = tl.where(head_exact, HEAD_CR, HEAD_Q_CR)
                    else:
                        head_cr = HEAD_CR
                    _next_step_weights(head_cr, rows_vocab, more, table, base_ptr, slot_x, slot_y, bar_x, bar_y, pid,
                                       rows_qkv, rows_h, rows_inter, H, NQ, NK, D, INTER)
                last = _pick_token(top, top_row, tl.where(more, tok_ptr + nxt * rec8, next_tok_ptr), head_val_ptr,
                                   head_idx_ptr, sync_ptr, head_sync_n, pid, num_programs, HEAD_PARTS,
                                   MULTI_STEP, more, step, base_ptr, post_ptr, acc_ptr, H, BK_H, ACC_COPIES)
                if MULTI_STEP:
                    if more & (last == 0):  # the last program's release of the step word: the next token's embedding is in
                        wait_count(sync_ptr + head_sync_n, step + 1)
                    arrivals = arrivals * 0  # the last program put the barrier's count back to 0
        if FUSED_HEAD:
            if last:
                tl.debug_barrier()  # its token's store (one thread's) before every thread reads it
                _tokens_out(tok_ptr, next_tok_ptr, host_tok_ptr, steps_here, rec8)
        _stamp(probe_ptr + pid, 12, num_programs, probe_half, PROBE)
    elif STAGE == -1:
        _stage_embed(base_ptr, tok_ptr, post_ptr, acc_ptr, pid, num_programs, rows_h, H, BR_H, ACC_COPIES)
    elif STAGE == 5:
        _stage_final_norm(post_ptr, acc_ptr, final_norm_ptr, out_ptr, eps, pid, num_programs, rows_h, H, BR_H, BK_H,
                          ACC_COPIES)
    else:
        layer_ptr = table_ptr + layer * NUM_FIELDS
        t1, t2 = _prefetch(STAGE if STAGE != 1 else 0, layer_ptr, STAGE != 1, base_ptr, pid, rows_qkv, rows_h, rows_inter,
                      H, NQ, NK, D, INTER, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN, BR_INTER, BK_INTER)
        kv_rows, kv_valid = _first_kv_rows(seq_len_ptr, block_table_ptr, pid, num_programs, stride_cb, stride_cs,
                                           NK, D, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT, BLOCK_T)
        kv1, kv2, kv3, kv4 = _kv_load(_at(base_ptr, layer_ptr, F_K_CACHE), _at(base_ptr, layer_ptr, F_V_CACHE),
                                      kv_rows, kv_valid, D // 2)
        cos, sin, step_slot, ctx = _step_values(pos_ptr, slot_ptr, seq_len_ptr, cos_sin_ptr, D, qkv_ptr.dtype.element_ty)
        _layer_stage(
            STAGE, t1, t2, kv1, kv2, kv3, kv4, layer_ptr, base_ptr, resid_ptr, qkv_ptr, attn_ptr, act_ptr,
            acc_ptr, part_acc_ptr, part_ml_ptr, count_ptr, cos, sin, step_slot, ctx, block_table_ptr,
            eps, qk_eps, qk_scale, stride_cb, stride_cs, pid, num_programs, rows_qkv, rows_h, rows_inter,
            probe_ptr, 0, 0, 0, 0, 0, False, H, NQ, NK, D, INTER, KV_BLOCK_SIZE, SPLIT_MIN, MAX_SPLITS, OWN_SPLIT, BLOCK_G, HAS_NORM,
            HAS_BIAS, BR_QKV, BK_QKV, BR_H, BK_O, BK_DOWN, BR_INTER, BK_INTER, BLOCK_T, False, False,
            0, 0, "", "", "", "", BK_H, BX_O, BX_DOWN, THREADS, ACC_COPIES, BK_DT, "", resid2_ptr, acc_o_ptr,
            FUSED_ATTN, False, RBS, BR_OB, BK_OB, "",
        )


def _tile_shape(rows: int, k: int, elements: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) for a program's slice of `rows` rows over a K of `k`, about `elements`
    weights per chunk."""
    block_r = triton.next_power_of_2(rows)
    return block_r, max(16, min(triton.next_power_of_2(k), elements // block_r))


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot take the persistent decode kernel (None: it can)."""
    from nanovllm.distributed import tp_size
    from nanovllm.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family decoder"
    if tp_size() != 1:
        return "tensor parallelism"
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "o/MLP projection biases"
    if attn.head_dim & (attn.head_dim - 1) or attn.head_dim < 32:
        # Attention multiplies head halves with tl.dot, whose inner dimension is at least 16.
        return f"head_dim {attn.head_dim} is not a power of two >= 32"
    if attn.num_heads % attn.num_kv_heads:
        return "query heads are not a multiple of KV heads"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float16, torch.bfloat16}:
        return f"parameter dtypes {sorted(map(str, dtypes))} (needs one of float32/float16/bfloat16)"
    if attn.q_norm is not None and attn.q_norm.eps != attn.k_norm.eps:
        return "q_norm and k_norm have different eps"
    return None


class PersistentDecoder:
    """`decoder(input_ids [1], positions [1], meta) -> hidden [1, H]` for one decoding sequence:
    the model's forward (final norm included) in one launch, or one launch per stage with
    `persistent=False`. Call `bind` with the KV caches after every (re)allocation. Inputs are
    read from the device tensors given (graph-capturable: no host sync, fixed launch shapes).

    num_programs: one per SM for the persistent launch (every program must be resident). The
    other keywords are shapes: context splits (at most max_splits parts, a power of two, of at
    least split_tokens positions, walked block_t at a time; own_token_split: where it costs no
    split, one more part attends to the step's own token alone, off the path of the splits that
    walk the cache (see _splits); measured on the H200 against the last split attending to it:
    744 -> 706 us per token at context 640, 834 -> 815 at 2,048, 1,866 -> 1,846 at 16,384 (eager
    launches; an earlier rule that always added the part was slower past ~1,000 positions),
    warps, weights per register tile (gate_up_tile_elements: the gate and up tiles together,
    default tile_elements), one_thread_barrier (thread 0 alone arrives and polls, see
    grid_arrive; False: every thread takes the arrival's answer, 14-25 us per token slower),
    smem_weights (weights through shared-memory slots where the GPU and the slices allow: see
    _smem_weights_fit; False: straight into registers, 58 us per token slower at context 640),
    mma_projections (16-bit weights in the slots: projections on tensor cores, mma_asm; False:
    FMAs, bit-identical to the stepwise launches; 6 us slower), kv_prefetch_cg (the first cached
    K/V tile read through the L2 only; 8 us faster), fused_mlp (the MLP in one stage, its down
    sums in acc_copies fp32 copies; None: on with the slots; 39 us faster at context 640),
    fused_attn (the o projection in the attention stage; needs fused_mlp and a program per KV
    head; None: on with fused_mlp and the slots; 34 us faster), gate_up_late and o_late (with
    fused_attn: when the slots' gate/up rows and o tile are copied in; 4-14 us faster and within
    noise), qkv_early (with o_late and fused_mlp: eighths of the next layer's qkv rows copied
    during the MLP, the rest once it arrives at its barrier; W5 ~2,010 -> ~2,055 tok/s with 4,
    the module docstring), fused_head (the LM head and the greedy argmax, or a temperature sample, in the
    kernel, into self.logits and next_token; None: on with the tensor-core slots and fused_attn;
    ~1% faster on W5), quantized_head (with fused_head: a step that only needs the token
    picks it from an int8 copy of the head, exactly, see runner/head_quant.py; None: on where
    slot X holds a chunk, the rows' meta and a candidate list; +155 MB for Qwen3-0.6B; W5 1,881
    -> 1,974 tok/s; head_candidates, head_scan_rows: candidates listed per round and rows per
    thread in their scan, for tests), multi_step (a decode burst in one launch, see __call__;
    None: on with fused_head and o_late; W5 +1 to +8 tok/s across hosts), and two benchmark switches
    (stage_mask and probe, see _decode_kernel; probe's stamps land in self.probe; a PROBE build
    also records each program's SM). The defaults are the fastest measured on the H200
    (benchmarks/persistent_decode.py --breakdown and --compare); the tests use small ones so that
    programs take several items and contexts several splits."""

    def __init__(
        self, model: Any, num_programs: int, persistent: bool = True,
        max_splits: int = 16, split_tokens: int = SPLIT_TOKENS, block_t: int = BLOCK_T, num_warps: int = 8,
        tile_elements: int = _TILE_ELEMENTS, gate_up_tile_elements: int | None = None, stage_mask: int = 31,
        probe: bool = False, own_token_split: bool = True, one_thread_barrier: bool = True,
        smem_weights: bool = True, mma_projections: bool = True, kv_prefetch_cg: bool = True,
        fused_mlp: bool | None = None, acc_copies: int = 4, fused_attn: bool | None = None,
        gate_up_late: bool = True, o_late: bool = True, fused_head: bool | None = None,
        quantized_head: bool | None = None, head_candidates: int | None = None, head_scan_rows: int | None = None,
        multi_step: bool | None = None, qkv_early: int = 4,
    ) -> None:
        reason = unsupported_reason(model)
        if not 0 <= qkv_early <= 8:
            raise ValueError(f"qkv_early counts eighths of a program's qkv rows, 0 to 8; got {qkv_early}")
        if reason is not None:
            raise ValueError(f"persistent decode does not support this model: {reason}")
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, got {max_splits}")
        if block_t < 16 or block_t & (block_t - 1):
            raise ValueError(f"block_t must be a power of two >= 16 (a tl.dot dimension), got {block_t}")
        if acc_copies < 1:
            raise ValueError(f"acc_copies must be at least 1, got {acc_copies}")
        inner = model.model
        layer = inner.layers[0]
        attn = layer.self_attn
        self.model = model
        self.persistent = persistent
        self.num_programs = num_programs
        self.num_warps = num_warps
        self.max_splits = max_splits
        self.dtype = inner.embed_tokens.weight.dtype
        device = inner.embed_tokens.weight.device
        self.hidden = inner.embed_tokens.weight.shape[1]
        self.num_q, self.num_k, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = layer.mlp.down_proj.weight.shape[1]
        self.num_layers = len(inner.layers)
        self.eps = float(layer.input_layernorm.eps)
        self.has_norm = attn.q_norm is not None
        self.qk_eps = float(attn.q_norm.eps) if self.has_norm else 0.0
        self.has_bias = attn.qkv_proj.bias is not None
        self.scale = attn.attn.scale
        self.cos_sin = attn.rotary_emb.cos_sin_cache
        n_qkv = (self.num_q + 2 * self.num_k) * self.head_dim
        empty = lambda n, dtype=self.dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        self.resid, self.qkv = empty(self.hidden), empty(n_qkv)
        self.attn_out, self.act = empty(self.num_q * self.head_dim), empty(self.inter)
        self.out = empty((1, self.hidden))
        self.acc = empty(acc_copies * self.hidden, torch.float32)
        self.resid2, self.acc_o = empty(self.hidden), empty(self.hidden, torch.float32)  # fused_attn
        self.part_acc = empty(self.num_q * max_splits * self.head_dim, torch.float32)
        self.part_ml = empty(self.num_q * max_splits * 2, torch.float32)
        # fused_attn: a count per layer and KV head; fused_head: the pick's count, the step word and
        # the int8 head's shared bound (_stage_head_q)
        self.sync = empty(4 + self.num_k * self.num_layers, torch.int32)
        # probe: [2 (global ns, SM cycles), layers, PROBE_POINTS, programs] stamps, 0 = not reached
        self.probe = empty(2 * self.num_layers * _PROBE_POINTS * num_programs if probe else 1, torch.int64)
        self.rows_qkv = -(-n_qkv // num_programs)
        self.rows_h = -(-self.hidden // num_programs)
        self.rows_inter = -(-self.inter // num_programs)
        br_qkv, bk_qkv = _tile_shape(self.rows_qkv, self.hidden, tile_elements)
        br_h, bk_o = _tile_shape(self.rows_h, self.num_q * self.head_dim, tile_elements)
        _, bk_down = _tile_shape(self.rows_h, self.inter, tile_elements)
        gate_up_elements = gate_up_tile_elements or tile_elements
        _, bk_inter = _tile_shape(2 * self.rows_inter, self.hidden, gate_up_elements)  # a gate and an up tile
        _, bk_dt = _tile_shape(self.rows_inter, self.hidden, tile_elements)  # W_down^T rows (fused_mlp)
        # fused_attn's o items: (KV head, block of rbs rows), num_programs // num_k blocks.
        group_width = self.num_q // self.num_k * self.head_dim
        self.rbs = -(-self.hidden // max(1, num_programs // self.num_k))
        br_ob, bk_ob = _tile_shape(self.rbs, group_width, tile_elements)
        self.constexprs = dict(
            H=self.hidden, NQ=self.num_q, NK=self.num_k, D=self.head_dim, INTER=self.inter,
            SPLIT_MIN=split_tokens, MAX_SPLITS=max_splits, BLOCK_T=block_t, OWN_SPLIT=int(own_token_split),
            BLOCK_G=max(2, triton.next_power_of_2(self.num_q // self.num_k)),
            HAS_NORM=self.has_norm, HAS_BIAS=self.has_bias,
            BR_QKV=br_qkv, BK_QKV=bk_qkv, BR_H=br_h, BK_H=triton.next_power_of_2(self.hidden) if self.hidden <= 8192 else 8192,
            BK_O=bk_o, BK_DOWN=bk_down, BR_INTER=triton.next_power_of_2(self.rows_inter), BK_INTER=bk_inter,
            ONE_THREAD_BARRIER=one_thread_barrier, STAGE_MASK=stage_mask, PROBE=probe, KV_PREFETCH_CG=kv_prefetch_cg,
            BK_DT=bk_dt, THREADS=num_warps * 32,
        )
        self.table: torch.Tensor | None = None
        # Shared-memory weight slots (SMEM_WEIGHTS in _decode_kernel): X holds a program's qkv
        # or gate+up rows, Y its o or down rows; before them, 128 bytes hold the mbarriers and
        # table_bytes a copy of the offset table.
        item = self.dtype.itemsize
        self.table_bytes = align_up(self.num_layers * _NUM_FIELDS * 8, 128)
        self.slot_x_bytes = align_up(max(self.rows_qkv, 2 * self.rows_inter) * self.hidden * item, 128)
        self.slot_y_bytes = align_up(max(max(self.num_q * self.head_dim, self.inter) * self.rows_h,
                                         self.rows_inter * self.hidden, self.rbs * group_width) * item, 128)
        # Tensor-core projections (mma_asm): the input staged at xbuf, the warps' sums at red.
        q, h = self.num_q * self.head_dim, self.hidden
        self.xbuf_bytes = align_up(max(max(h, q, self.inter) * item, self.rows_inter * 4), 128)  # or fused_mlp's act (fp32)
        self.red_rows = max(self.rows_qkv, self.rows_h, 2 * self.rows_inter, self.rbs)  # the most rows of one projection
        red_bytes = align_up(num_warps * (self.red_rows + 1) * 4, 128)
        self.smem_bytes = 128 + self.table_bytes + self.slot_x_bytes + self.slot_y_bytes + self.xbuf_bytes + red_bytes
        self.smem_weights = smem_weights and self._smem_weights_fit(device, [
            (self.hidden, bk_qkv), (self.num_q * self.head_dim, bk_o), (self.inter, bk_down), (self.hidden, bk_inter),
            (self.hidden, bk_dt), (group_width, bk_ob)])
        # The MLP in one stage (FUSED_MLP in _decode_kernel): by default where the weights go
        # through shared memory, the small models a lone sequence's latency is about. It keeps a
        # transposed copy of every layer's down weight (for Qwen3-0.6B, 168 MB).
        self.fused_mlp = self.smem_weights and h % 4 == 0 if fused_mlp is None else fused_mlp
        if self.fused_mlp and self.smem_weights and h % 4:
            raise ValueError(f"fused_mlp through the shared-memory slots needs hidden_size a multiple of 4, got {h}")
        self.down_t = ([lyr.mlp.down_proj.weight.t().contiguous() for lyr in inner.layers] if self.fused_mlp
                       else [None] * self.num_layers)
        if self.fused_mlp:
            self.constexprs.update(ACC_COPIES=acc_copies)
            if self.smem_weights:
                self.constexprs.update(DOWN_ASM=down_asm(self.rows_inter, h, num_warps * 32, self.dtype))
        # The o projection in the attention stage (FUSED_ATTN; needs the one-stage MLP's residual
        # handling and a program per KV head at least). It keeps a copy of every layer's o weight
        # with each KV head's columns together (for Qwen3-0.6B, 112 MB).
        self.fused_attn = (self.fused_mlp and self.smem_weights and num_programs >= self.num_k
                           if fused_attn is None else fused_attn)
        if self.fused_attn and not self.fused_mlp:
            raise ValueError("fused_attn needs fused_mlp")
        if self.fused_attn and num_programs < self.num_k:
            raise ValueError(f"fused_attn needs a program per KV head at least ({self.num_k}), got {num_programs}")
        self.o_perm = ([lyr.self_attn.o_proj.weight.view(h, self.num_k, group_width).permute(1, 0, 2).contiguous()
                        for lyr in inner.layers] if self.fused_attn else [None] * self.num_layers)
        if self.fused_attn:
            self.constexprs.update(FUSED_ATTN=True, RBS=self.rbs, BR_OB=br_ob, BK_OB=bk_ob, GU_LATE=gate_up_late, O_LATE=o_late,
                                   QKV_EARLY=qkv_early)
        self._smem_off: int | None = None
        self.mma = (self.smem_weights and mma_projections and self.dtype in (torch.bfloat16, torch.float16)
                    and all(k % MMA_K_STEP == 0 for k in (h, q, self.inter))
                    and max(self.rows_qkv, self.rows_h, self.rows_inter) <= num_warps * 32
                    # the staged inputs are one block each (BK_H stops at 8,192)
                    and h <= 8192 and max(q, self.inter) <= 16384)
        if self.mma:
            self.constexprs.update(
                XBUF_BYTES=self.xbuf_bytes,
                BX_O=triton.next_power_of_2(q), BX_DOWN=triton.next_power_of_2(self.inter),
                MMA_QKV=mma_asm(self.rows_qkv, h, num_warps, 0, self.dtype),
                MMA_O=mma_asm(self.rows_h, q, num_warps, 0, self.dtype),
                MMA_GU=mma_asm(2 * self.rows_inter, h, num_warps, self.rows_inter, self.dtype),
                MMA_DOWN=mma_asm(self.rows_h, self.inter, num_warps, 0, self.dtype),
            )
            if self.fused_attn and group_width % MMA_K_STEP == 0 and self.rbs <= num_warps * 32:
                self.constexprs.update(MMA_OB=mma_asm(self.rbs, group_width, num_warps, 0, self.dtype))
        self._setup_fused_head(model, fused_head, device)
        self._setup_quantized_head(quantized_head, head_candidates, head_scan_rows)
        # Decode bursts in one launch (MULTI_STEP): the kernel picks each step's token and the
        # o tile comes in stage A, which its fixed mbarrier parities assume (_next_step_weights).
        possible = self.fused_head and self.fused_attn and o_late
        self.multi_step = possible if multi_step is None else multi_step
        if self.multi_step and not possible:
            raise ValueError("multi_step needs fused_head and o_late")
        self.constexprs.update(MULTI_STEP=self.multi_step)

    def _setup_quantized_head(self, quantized_head: bool | None, head_candidates: int | None,
                              head_scan_rows: int | None) -> None:
        """The fused head's pick from an int8 copy of the LM head (HEAD_Q, `quantized_head`; None:
        on with fused_head where slot X holds a chunk, the program's rows' meta and a candidate
        list): runner/head_quant.py, runner/persistent_head.py's _stage_head_q. Chunks are as
        many int8 rows as the smaller slot holds (twice the 16-bit head's); head_candidates caps
        the candidates listed per round (default: one per thread; tests set fewer) and
        head_scan_rows the rows each thread scans for candidates at once (HEAD_LR; default: a
        program's rows in one pass, at most 8 per thread; tests set more)."""
        self.quantized_head = False
        if not self.fused_head or self.hidden % MMA_K_STEP:
            if quantized_head:
                raise ValueError(f"quantized_head needs fused_head and hidden_size a multiple of {MMA_K_STEP}")
            return
        threads = self.num_warps * 32
        meta_bytes = align_up(self.rows_vocab * head_quant.META_FIELDS * 4, 128)
        if head_candidates is not None and head_candidates < 1:
            raise ValueError(f"head_candidates must be at least 1, got {head_candidates}")
        need = head_candidates or 16  # list entries (more candidates take more rounds)

        def list_room(rows: int) -> int:
            """Candidate-list entries left in slot X after a chunk of `rows` int8 rows and the meta."""
            return (self.slot_x_bytes - align_up(rows * self.hidden, 128) - meta_bytes) // 4

        cr = min(threads, self.red_rows, self.slot_y_bytes // self.hidden, self.slot_x_bytes // self.hidden)
        while cr >= 1 and list_room(cr) < need:
            cr -= 1
        if cr < 1:
            if quantized_head:
                raise ValueError("quantized_head: slot X cannot hold a chunk, the rows' meta and a candidate list")
            return
        self.quantized_head = quantized_head is None or quantized_head
        if not self.quantized_head:
            return
        meta_off = align_up(cr * self.hidden, 128)
        cap = head_candidates or min(threads, list_room(cr))
        self.head_exponent = head_quant.input_exponent(self.model.model.norm.weight, self.hidden)
        self.head_q, self.head_meta = head_quant.quantize_head(self.head_weight, self.head_exponent)
        self.constexprs.update(
            HEAD_Q=True, HEAD_Q_CR=cr, MMA_HEAD_Q=mma_asm(cr, self.hidden, self.num_warps, 0, torch.int8),
            HEAD_META_OFF=meta_off, HEAD_CAND_OFF=meta_off + meta_bytes, HEAD_CAP=cap,
            HEAD_X_SCALE=2.0 ** -self.head_exponent,
            HEAD_LR=head_scan_rows or min(8, triton.next_power_of_2(-(-self.rows_vocab // threads))),
        )

    def requantize_head(self) -> None:
        """Make the int8 copy of the LM head again, after its weight changed in place."""
        if self.quantized_head:
            self.head_q, self.head_meta = head_quant.quantize_head(self.head_weight, self.head_exponent)

    def _setup_fused_head(self, model: Any, fused_head: bool | None, device: torch.device) -> None:
        """The LM head and the greedy argmax inside the kernel (FUSED_HEAD, `fused_head`; None: on
        where the projections run on tensor cores from the slots with the o projection fused,
        and the LM head is one rank's whole vocabulary). Its chunks alternate between slots X and
        Y, so a chunk is as many rows as the smaller slot holds."""
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        possible = (self.mma and self.fused_attn and weight is not None and getattr(head, "tp_size", 1) == 1
                    and tuple(weight.shape) == (head.num_embeddings, self.hidden) and weight.is_contiguous())
        self.fused_head = possible if fused_head is None else fused_head
        self.logits: torch.Tensor | None = None
        self.greedy_token = torch.zeros(1, dtype=torch.int64, device=device)
        self.greedy_temperature = torch.zeros(1, dtype=torch.float32, device=device)  # 0: the argmax
        self.exact_temperature = torch.full((1,), -1.0, dtype=torch.float32, device=device)  # every logit stored
        self.no_seed = torch.zeros(1, dtype=torch.int64, device=device)
        self._token_scratch = torch.zeros(16, dtype=torch.int64, device=device)  # a launch's tokens (see __call__)
        if not self.fused_head:
            return
        if not possible:
            raise ValueError("fused_head needs mma projections with fused_attn, and one rank's whole LM head")
        item = self.dtype.itemsize
        # at most a slot's rows, and the most rows whose sums `red` holds
        cr = min(self.num_warps * 32, min(self.slot_x_bytes, self.slot_y_bytes) // (self.hidden * item), self.red_rows)
        if cr < 1:
            raise ValueError("fused_head: a slot does not hold one row of the LM head")
        self.head_weight = weight
        self.vocab = head.num_embeddings
        self.rows_vocab = -(-self.vocab // self.num_programs)
        self.logits = torch.zeros((1, self.vocab), dtype=self.dtype, device=device)
        self.head_val = torch.zeros(self.num_programs, dtype=torch.float32, device=device)
        self.head_idx = torch.zeros(self.num_programs, dtype=torch.int32, device=device)
        self.constexprs.update(
            FUSED_HEAD=True, HEAD_CR=cr,
            MMA_HEAD=mma_asm(cr, self.hidden, self.num_warps, 0, self.dtype),
            HEAD_PARTS=triton.next_power_of_2(self.num_programs), SAMPLE_BLOCK=GUMBEL_BLOCK,
        )

    def _smem_weights_fit(self, device: torch.device, k_and_chunks: list[tuple[int, int]]) -> bool:
        """Whether weights can go through shared-memory slots here: a persistent launch on an
        sm_90+ GPU (bulk asynchronous copies), slots that leave Triton 64 KB of the opt-in
        shared memory (it takes ~36 KB for Qwen3-0.6B), each K a multiple of its chunk (the
        slot reads are unmasked) and of 16 bytes (the copies' granule)."""
        if not self.persistent or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
            return False
        optin = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        item = self.dtype.itemsize
        return self.smem_bytes + 64 * 1024 <= optin and all(k % bk == 0 and k * item % 16 == 0 for k, bk in k_and_chunks)

    def _base(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    def bind(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Point the kernel at these per-layer caches ([blocks, block_size, kv_heads, head_dim])."""
        base = self._base()
        item = base.element_size()

        def offset(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.dtype != base.dtype or not t.is_contiguous():
                raise ValueError(f"persistent decode needs contiguous {base.dtype} tensors, got {t.dtype}")
            diff = t.data_ptr() - base.data_ptr()
            if diff % (16 * item):  # the kernel tells Triton so (_at), to vectorize loads
                raise ValueError("persistent decode: a tensor does not start 16 elements from the embedding's alignment")
            return diff // item

        if len(k_caches) != self.num_layers or k_caches[0].shape[2:] != (self.num_k, self.head_dim):
            raise ValueError("persistent decode: the KV caches do not match the model")
        rows = []
        for layer, kc, vc, down_t, o_perm in zip(self.model.model.layers, k_caches, v_caches, self.down_t, self.o_perm):
            attn, mlp = layer.self_attn, layer.mlp
            if kc.stride() != k_caches[0].stride() or vc.stride() != kc.stride():
                raise ValueError("persistent decode: every layer's K and V cache must share one layout")
            fields = {
                "qkv_w": attn.qkv_proj.weight, "qkv_b": attn.qkv_proj.bias,
                "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                "k_norm": attn.k_norm.weight if attn.k_norm is not None else None,
                "o_w": attn.o_proj.weight, "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                "gate_up_w": mlp.gate_up_proj.weight, "down_w": mlp.down_proj.weight, "k_cache": kc, "v_cache": vc,
                "down_t": down_t, "o_perm": o_perm,
            }
            rows.append([offset(fields[name]) for name in _FIELDS])
        self.table = torch.tensor(rows, dtype=torch.int64, device=base.device)
        self.head_off = offset(self.head_weight) if self.fused_head else 0
        self.kv_block_size = k_caches[0].shape[1]
        self.stride_cb, self.stride_cs = k_caches[0].stride(0), k_caches[0].stride(1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 next_token: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                 seed: torch.Tensor | None = None, steps: int = 1, record_bytes: int = 0,
                 host_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden state [1, H]. With fused_head, also the logits (into self.logits) and their
        argmax, lowest id on ties, into next_token ([1] int64; None: self.greedy_token); or, where
        the [1] float32 `temperature` is above 0, the token fused_sampler.gumbel_argmax(logits,
        temperature, seed) would sample (seed: [1] int64). With quantized_head the same token
        comes from the int8 head and the logits are not stored, unless the temperature is below
        0 (the argmax, every logit stored). None: -1, the logits and their argmax.

        steps > 1 (multi_step): a decode burst in this one launch. Step i's inputs (token,
        position, slot, context length, temperature, seed) are the given tensors' elements
        record_bytes * i bytes further (SingleDecodeInputs' records; the block table is shared),
        step i's token goes into step i + 1's input token and the last step's into next_token;
        the hidden state and logits are the last step's. host_tokens (fused_head; int64, at least
        `steps` elements; pinned host memory, which the kernel writes directly): the launch's
        tokens in step order (None: a scratch buffer on the device)."""
        if self.table is None:
            raise RuntimeError("PersistentDecoder: call bind() with the KV caches first")
        if input_ids.shape[0] != 1 or meta.num_decodes != 1:
            raise ValueError("persistent decode runs exactly one decoding sequence")
        if next_token is None:
            next_token = self.greedy_token
        if self.fused_head and (next_token.shape != (1,) or next_token.dtype != torch.int64):
            raise ValueError(f"persistent decode: next_token must be [1] int64, got {tuple(next_token.shape)} {next_token.dtype}")
        temperature = self.exact_temperature if temperature is None else temperature
        seed = self.no_seed if seed is None else seed
        if temperature.shape != (1,) or temperature.dtype != torch.float32 or seed.shape != (1,) or seed.dtype != torch.int64:
            raise ValueError("persistent decode: temperature must be [1] float32 and seed [1] int64")
        if steps != 1:
            if not self.multi_step or steps < 1:
                raise ValueError(f"persistent decode: {steps} steps in one launch need multi_step")
            if record_bytes <= 0 or record_bytes % 8:
                raise ValueError(f"persistent decode: record_bytes must be a positive multiple of 8, got {record_bytes}")
        if host_tokens is None:
            if self._token_scratch.numel() < steps:
                self._token_scratch = torch.zeros(steps, dtype=torch.int64, device=self.greedy_token.device)
            host_tokens = self._token_scratch
        elif host_tokens.dtype != torch.int64 or host_tokens.numel() < steps:
            raise ValueError(f"persistent decode: host_tokens must be int64 with at least {steps} elements")
        if not self.fused_head:  # (a fused head's last program zeroes them: _pick_token)
            self.sync.zero_()
        args = (
            self._base(), self.table, self.model.model.norm.weight, input_ids, self.resid, self.qkv, self.attn_out,
            self.act, self.out, self.acc, self.resid2, self.acc_o, self.part_acc, self.part_ml, self.sync, positions, meta.slot_mapping, meta.seq_lens,
            meta.block_tables, self.cos_sin, self.probe,
            self.eps, self.qk_eps, self.scale * _LOG2E, self.stride_cb, self.stride_cs, self.num_layers,
        )
        counts = (self.rows_qkv, self.rows_h, self.rows_inter)
        common = dict(self.constexprs, KV_BLOCK_SIZE=self.kv_block_size, num_warps=self.num_warps, enable_fp_fusion=False)
        if self.fused_head:
            common.update(head_off=self.head_off, logits_ptr=self.logits, next_tok_ptr=next_token, head_val_ptr=self.head_val,
                          head_idx_ptr=self.head_idx, vocab=self.vocab, rows_vocab=self.rows_vocab, temp_ptr=temperature,
                          seed_ptr=seed, host_tok_ptr=host_tokens)
            if self.quantized_head:
                common.update(head_q_ptr=self.head_q, head_meta_ptr=self.head_meta)
        if self.multi_step:
            common.update(num_steps=steps, rec8=record_bytes // 8, rec4=record_bytes // 4)
        grid = (self.num_programs,)
        if self.persistent:
            common.update(PERSISTENT=True, STAGE=0, SMEM_WEIGHTS=self.smem_weights,
                          TABLE_BYTES=self.table_bytes, SLOT_X_BYTES=self.slot_x_bytes, SLOT_Y_BYTES=self.slot_y_bytes)
            if self.smem_weights and self._smem_off is None and not compiling_only():
                kernel = _decode_kernel.warmup(*args, 0, *counts, 0, grid=grid, **common)
                self._smem_off = reserve_shared_memory(kernel, self.smem_bytes)
            launch(_decode_kernel, grid, *args, 0, *counts, self._smem_off or 0, **common)
        else:
            launch(_decode_kernel, grid, *args, 0, *counts, 0, PERSISTENT=False, STAGE=-1, **common)
            for layer in range(self.num_layers):
                for stage in range(_STAGES_PER_LAYER - self.fused_mlp):  # fused_mlp: no stage 4 (fused_attn: 2 is the o part)
                    launch(_decode_kernel, grid, *args, layer, *counts, 0, PERSISTENT=False, STAGE=stage, **common)
            launch(_decode_kernel, grid, *args, 0, *counts, 0, PERSISTENT=False, STAGE=5, **common)
        return self.out
