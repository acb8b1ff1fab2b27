"""A lone sequence's decode step as one persistent Triton kernel (`_decode_kernel`).

Why: one sequence decoding reads every weight once per token, yet a per-op decode graph is
~250 small kernels whose launch and ramp cost more than their reads. Here the whole stack of
layers is one launch: one program per SM loops over the layers, splits each stage's work
between the programs, and waits at a grid-wide barrier (an atomic counter) where the next stage
needs every program's output; a barrier costs less than a kernel boundary.

Stages of a layer (each program takes a slice of rows, or of (KV head, context split) pairs),
where the weights go through the shared-memory slots (FUSED_MLP and FUSED_ATTN), each followed
by a grid barrier:
  A  RMSNorm of the residual stream (recomputed by every program, the previous layer's down
     sums added first), then the packed q/k/v projection rows.
  B  q/k norm + rotary, attention over the paged KV cache in context splits (one more part per
     KV head attends to the step's own token and stores its K/V where that costs no split),
     then the o projection split by KV head and row block: an item waits for its head's count,
     combines the parts and adds its rows' sums into an fp32 accumulator (_stage_attn_o).
  D  RMSNorm of the residual plus the o sums, gate and up rows, SiLU-and-mul, then the down
     projection split by K into fp32 accumulator copies (_stage_gate_up), which the next
     layer's A adds to the residual.
Without the fused o projection a stage C does it (four stages); without the fused MLP a stage
E does the down projection too (five): models whose slices do not fit the slots, and the
stepwise launches. Before the first layer the embedding row becomes the residual stream; after
the last, the final RMSNorm writes the hidden state, or with FUSED_HEAD the LM head and the
greedy argmax (or fused_sampler's Gumbel-max sample at a temperature above 0) follow in the
kernel (head.py), from an int8 copy of the head where only the token is needed (HEAD_Q,
head_quant.py). With MULTI_STEP one launch runs a decode burst: the program that picks a
step's token writes its embedding into the residual stream and releases the others, and after
the last step writes the tokens into pinned host memory.

Synchronization: what other programs wrote this step is read with ordinary loads, each after an
acquire at GPU scope (a barrier's poll or arrival, or a count), which invalidates the SM's L1.
Weights travel into shared-memory slots by bulk asynchronous copies (TMA, inline PTX in ptx.py)
issued ahead of their stage and across the barriers, counted in by mbarriers.

Numerics follow the per-op path (layers/fused.py): every value the reference rounds to the
activation dtype is rounded here too (the kernel compiles with enable_fp_fusion=False);
projections accumulate in fp32 in another order than cuBLAS, so results agree to rounding.

The same stage code also runs as one launch per stage ("stepwise", kernel boundaries as the
barriers): what the CPU runs under TRITON_INTERPRET=1, and the reference the persistent launch
is tested against. Where the code is: the stages of a layer in stages.py, attention in
attention.py, the LM head in head.py, the offset table and shared helpers in common.py, inline
PTX in ptx.py, the host side in decoder.py. The design and its measurements: see
docs/persistent_kernel.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanovllm.fastpath.attention import _first_kv_rows, _kv_load, _step_values
from nanovllm.fastpath.common import (
    F_K_CACHE, F_V_CACHE, NUM_FIELDS, PROBE_POINTS, _at, _next_layer, _stamp, _stamp_sm, _table_to_shared,
)
from nanovllm.fastpath.head import (
    _issue_head_chunk, _issue_head_q_chunk, _pick_token, _stage_head, _stage_head_q, _tokens_out,
)
from nanovllm.fastpath.ptx import grid_arrive, grid_wait, mbarrier_wait, mbarriers_init, shared_address, wait_count
from nanovllm.fastpath.stages import (
    _stage_embed, _stage_final_norm, _prefetch, _issue_weights, _next_step_weights, _layer_stage,
)


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
    head_q_ptr=None, head_meta_ptr=None, head_hi_ptr=None, HEAD_Q: tl.constexpr = False, HEAD_Q_CR: tl.constexpr = 1,
    MMA_HEAD_Q: tl.constexpr = "", HEAD_META_OFF: tl.constexpr = 0, HEAD_CAND_OFF: tl.constexpr = 0,
    HEAD_CAP: tl.constexpr = 1, HEAD_NC: tl.constexpr = 8, HEAD_X_SCALE: tl.constexpr = 1.0, HEAD_LR: tl.constexpr = 1,
    MULTI_STEP: tl.constexpr = False, num_steps=1, rec8=0, rec4=0, host_tok_ptr=None,
):
    """PERSISTENT: every stage of every layer, with grid barriers between them (needs every
    program resident at once: launch at most one program per SM). Each stage's first weight
    tile is loaded during the barrier it waits at: after this program arrives, before it polls
    (loading it before the previous stage's work gains nothing). Otherwise: only stage STAGE (-1 embedding, 0-4 a layer's stages A-E of `layer`, 5
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
    FUSED_HEAD): unless the temperature is -1 (the caller wants every logit), the token is
    picked from the head's int8 copy at head_q_ptr with its meta at head_meta_ptr
    (_stage_head_q: HEAD_Q_CR rows per chunk, MMA_HEAD_Q, the meta and the candidate list
    HEAD_META_OFF and HEAD_CAND_OFF bytes into slot X, HEAD_CAP candidates per round, HEAD_NC
    rows per recompute, the input scaled by HEAD_X_SCALE) and no logits are stored; at -2 it
    stores every row's logit bounds instead (lower at logits_ptr, upper at head_hi_ptr) and
    picks no token (the programs' best lower bounds stay at head_val: head_refine.py). MULTI_STEP
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
                head_word = tl.load(temp_ptr + step * rec4)
                head_exact = (head_word < 0.0) & (head_word > -1.5)  # -1 (-2: the int8 head's bounds)
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
                        PROBE, HEAD_LR, sync_ptr + head_sync_n + 1, logits_ptr, head_hi_ptr, MULTI_STEP)
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
