"""Paged attention in Triton: one kernel for mixed prefill/decode steps, plus a split-KV
(flash-decoding) pair of kernels for decode-only steps.

Cache layout (see `attention/backend.py`): `[num_blocks, block_size, num_kv_heads, head_dim]`, so
the K (or V) rows of one KV head for `BLOCK_N` consecutive positions are `BLOCK_N` contiguous
`head_dim` vectors, each found through the block table. Every tile is loaded as a
`[BLOCK_N, head_dim]` array with contiguous rows.

Why the work is cut this way:
- GQA: one program handles *all* query heads of one KV group, so each K/V byte is loaded once per
  group rather than once per query head. Its Q tile has `BLOCK_M` rows: row r is query token
  `r // GROUP` of the tile and head `r % GROUP` of the group. Packing tokens x heads gives the
  `tl.dot` calls at least 16 rows even for a decode (one token, GROUP heads); padding rows are
  masked. `GROUP` need not be a power of two (SmolLM2 has 3).
- Mixed steps: programs are laid out over "query tiles" of `BLOCK_Q = BLOCK_M // GROUP` tokens of one
  sequence. Sequence i's tiles start at `(query_start_loc[i] + i * (BLOCK_Q - 1)) // BLOCK_Q`, which
  is monotone, leaves each sequence room for all its tiles, and totals
  `(num_tokens + num_seqs * (BLOCK_Q - 1)) // BLOCK_Q`: exactly num_seqs for a decode-only launch.
  Each program finds its sequence by binary search over `query_start_loc` (device reads only), so
  the grid depends on host ints (num_tokens, num_seqs) and never on sequence lengths. A launch
  known to hold only decodes (DECODE_ONLY) maps program i to sequence i and skips the search,
  whose chain of dependent loads would otherwise delay every decode program's first KV load.
- Decode-only launches put the KV heads on the fastest grid axis, and the scheduler hands decodes
  over longest context first. Programs start roughly in grid order, so the long sequences start
  first, the short ones fill in the end of the launch instead of a long one running alone, and a
  sequence's heads (adjacent in the cache rows) are read at the same time; large batches run
  faster so than in arrival order, sequence-major (`benchmarks/attention_kernels.py --order`).
- Mixed steps are launched twice by the backend (decodes with a 16-row tile, prefills with a
  128-row one), but one launch can cover any mix.
- Causal masking: KV tiles that every query row of the tile can see completely run without any
  mask; only the last few tiles (the diagonal, and the ragged end of the context) are masked. The
  mask `kv_pos <= q_pos` also bounds each row by its sequence length. K/V rows past the context
  are loaded as zeros, so stale or NaN cache contents (padding slots, block 0 of padded block-table
  rows) can never leak into the result through `0 * NaN`.
- Softmax runs online in fp32 in the log2 domain (`exp2`, with log2(e) folded into the scale). The
  running max starts at a large finite negative number instead of -inf, so fully masked rows
  (padding, a zero-length context) produce 0 instead of NaN.
- Tiles: `BLOCK_N` KV positions per iteration. Each row's block id is read from the block table,
  so BLOCK_N may be a multiple of the cache block size (several blocks per tile) or a divisor of it
  (large blocks such as 256 are walked in 64-row tiles, which keeps shared memory bounded).
- Split-KV (decode only): with few sequences, `num_seqs * num_kv_heads` programs leave most of the
  ~132 SMs idle. The split kernel adds a third grid axis: split s of a sequence handles an equal
  share of its KV tiles (computed on the device from seq_lens) and writes unnormalised partial
  (max, sum, acc) to fp32 scratch; a small reduction kernel rescales and combines the splits. The
  split count is a runtime argument (one compiled variant serves every count up to 16). The
  number of splits is chosen from static shapes only (num_seqs, num_kv_heads, SM count, see
  `choose_num_splits`), never from context lengths, so a CUDA graph captured for one batch size
  is valid for every context length.
- Nothing here reads a device value on the host; scratch is allocated with `torch.empty`, which
  is safe under graph capture (the caching allocator gives the graph a private pool).
- fp32 inputs use IEEE dots (no TF32) so an fp32 model matches the reference token for token.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

import triton
import triton.language as tl

from nanovllm.precompile import launch


def _jit_stable(*, ints: tuple[str, ...], pointers: tuple[str, ...]):
    """triton.jit that does not specialize on these per-step values.

    Triton compiles a variant per value class of an int (==1, divisible by 16) and per 16-byte
    alignment of a pointer. Per-step counts, the block-table width (it follows the longest
    sequence of the step) and row slices of the metadata would then compile several variants
    mid-run, seconds each; one variant serves them all.
    """
    kwargs = {"do_not_specialize": ints + pointers}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = pointers
    return triton.jit(**kwargs)


_STEP_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")


# Running-max start value: finite, so exp2(m_old - m_new) is 1, not NaN, for fully masked rows.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the attention kernels."""

    block_m: int  # Q rows per program: query tokens x heads of one KV group, a power of two >= 16
    block_n: int  # KV positions per loop iteration, a power of two >= 16
    num_warps: int = 4
    num_stages: int = 2


def prefill_tile_config(group: int, head_dim: int, dtype: torch.dtype) -> TileConfig:
    """Tiles for launches that contain prefill chunks: large Q tiles feed the tensor cores.

    fp32 (IEEE dots run on the FMA units, not tensor cores) needs small tiles to avoid spills.
    """
    min_m = triton.next_power_of_2(group)
    if dtype == torch.float32:
        return TileConfig(block_m=max(32, min_m), block_n=16, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return TileConfig(block_m=max(128, min_m), block_n=64, num_warps=8, num_stages=2)
    return TileConfig(block_m=max(64, min_m), block_n=32, num_warps=4, num_stages=2)


def decode_tile_config(group: int, head_dim: int, dtype: torch.dtype) -> TileConfig:
    """Tiles for decode launches: one token's GROUP heads padded to 16 rows; memory bound."""
    block_m = max(16, triton.next_power_of_2(group))
    if dtype == torch.float32:
        return TileConfig(block_m=block_m, block_n=32, num_warps=8, num_stages=2)
    return TileConfig(block_m=block_m, block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)


# Decode programs (sequence x KV head x split) wanted per SM before a step is left unsplit:
# about 3 programs fit on an SM at once, and a few waves smooth out uneven context lengths.
_PROGRAMS_PER_SM = 3
# The split count is a runtime argument of the split kernels (each count compiled as its own
# variant cost a first start ~0.6 s per count); the reduction reads this many lanes, masked.
_SPLIT_BLOCK = 16


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per sequence for decode: enough (sequence, kv head, split) programs to fill every SM
    about _PROGRAMS_PER_SM times over.

    Static inputs only (CUDA graphs replay one captured grid for all context lengths). Returns 1
    when num_seqs * num_kv_heads programs already do. Contexts shorter than the split count leave
    trailing splits empty, which costs a few idle programs and nothing more; that cost is why the
    count is capped at 16 (a single few-hundred-token sequence runs fastest at 8-16 splits, 32
    is slower; `benchmarks/attention_kernels.py --splits`).
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = _PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    return min(max_splits, triton.next_power_of_2(triton.cdiv(target, programs)))


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_head_ptr,
    v_head_ptr,
    bt_row_ptr,
    q_pos,
    start,
    kv_end,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over KV positions [start, start + BLOCK_N) of one sequence/head.

    MASKED=False is only used for tiles that lie entirely inside every row's visible range.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_pos = start + offs_n
    in_range = kv_pos < kv_end
    if MASKED:
        block = tl.load(bt_row_ptr + kv_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row_ptr + kv_pos // BLOCK_SIZE).to(tl.int64)
    row = kv_pos % BLOCK_SIZE
    k_ptrs = k_head_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_head_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        kv_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        kv_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        qk = tl.where(kv_pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASKED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@_jit_stable(ints=("seq_offset", "num_seqs", "stride_bt"), pointers=_STEP_POINTERS)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_offset,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
):
    """Grid: (query tiles, kv heads), or (kv heads, sequences) for DECODE_ONLY launches.
    One program: BLOCK_Q tokens of one sequence x GROUP heads."""
    if DECODE_ONLY:
        kv_head = tl.program_id(0)
        tile_id = tl.program_id(1)
    else:
        tile_id = tl.program_id(0)
        kv_head = tl.program_id(1)
    # This launch covers sequences [seq_offset, seq_offset + num_seqs) of the step's metadata
    # (an offset instead of sliced tensors keeps one compiled variant for every offset).
    query_start_loc_ptr += seq_offset
    seq_lens_ptr += seq_offset
    block_tables_ptr += seq_offset.to(tl.int64) * stride_bt
    first_token = tl.load(query_start_loc_ptr)

    if DECODE_ONLY:
        seq = tile_id  # one tile per sequence; skips the search's chain of dependent loads
    else:
        # Find the sequence owning this tile: the last i with first_tile(i) <= tile_id.
        lo = tile_id * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            mid_tile = (tl.load(query_start_loc_ptr + mid) - first_token + mid * (BLOCK_Q - 1)) // BLOCK_Q
            right = mid_tile <= tile_id
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seq = lo

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_first_tile = (q_start - first_token + seq * (BLOCK_Q - 1)) // BLOCK_Q
    q_tile_start = (tile_id - seq_first_tile) * BLOCK_Q  # first query token of the tile, in-sequence
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of the sequence's first query token (cached prefix length)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_tile_start + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    q_pos = tl.where(row_valid, ctx_start + tok, -1)
    token = (q_start + tl.where(row_valid, tok, 0)).to(tl.int64)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)

    kv_end = ctx_start + tl.minimum(q_len, q_tile_start + BLOCK_Q)  # one past the last visible key
    num_full = (ctx_start + q_tile_start + 1) // BLOCK_N  # tiles visible to every row of the tile
    num_tiles = tl.cdiv(kv_end, BLOCK_N)

    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(0, num_full):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, q_pos, t * BLOCK_N, kv_end,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION,
        )
    for t in range(num_full, num_tiles):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, q_pos, t * BLOCK_N, kv_end,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@_jit_stable(ints=("stride_bt", "num_splits"), pointers=_STEP_POINTERS)
def _paged_attention_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid: (decode seqs, kv heads, splits). Writes unnormalised partials for one split."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < GROUP
    head = kv_head * GROUP + tl.where(row_valid, offs_m, 0)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    q_pos = tl.where(row_valid, seq_len - 1, -1)

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, num_tiles)
    num_full = seq_len // BLOCK_N

    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(t_begin, tl.minimum(t_end, num_full)):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, q_pos, t * BLOCK_N, seq_len,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION,
        )
    for t in range(tl.maximum(t_begin, num_full), t_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, q_pos, t * BLOCK_N, seq_len,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION,
        )

    part = (seq.to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_M]
    tl.store(part_m_ptr + part, m_i, mask=row_valid)
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)


@_jit_stable(ints=("num_splits",), pointers=())
def _split_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid: (decode seqs, query heads). Combines the splits' partials into the output row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    split_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s
    # Lanes past num_splits read as empty splits (m = _NEG_BIG, l = 0, acc = 0).
    m = tl.load(part_m_ptr + part, mask=split_ok, other=_NEG_BIG)
    l = tl.load(part_l_ptr + part, mask=split_ok, other=0.0)
    acc_mask = split_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=acc_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # empty splits have m = _NEG_BIG, so weight 0 (or all 1 and l = 0)
    denom = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> int:
    """Validate layouts; return the GQA group size."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged attention: want q [T, H, D] and caches [blocks, block_size, Hkv, D]; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"paged attention: q heads/dim {num_heads}/{head_dim} vs cache {tuple(k_cache.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"paged attention: out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head_dim axis of q, out and the caches must be contiguous")
    return num_heads // num_kv_heads


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D], written for the tokens of these sequences
    block_tables: torch.Tensor,  # [S, max_blocks] int32 (rows of the sequences in this launch)
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, absolute token offsets into q/out
    num_tokens: int,  # upper bound on query_start_loc[S] - query_start_loc[0] (host int)
    scale: float,
    config: TileConfig,
    decode_only: bool = False,
    seq_offset: int = 0,
    num_seqs: int | None = None,
) -> None:
    """Causal paged attention for a run of sequences (any mix of decodes and prefill chunks).

    The metadata tensors may be row slices of the step's metadata (e.g. only its prefills):
    token offsets stay absolute. The grid depends only on num_tokens and S. decode_only=True
    promises every sequence has exactly one query token (then program i is sequence i).
    """
    group = _check(q, k_cache, v_cache, out)
    if num_seqs is None:
        num_seqs = seq_lens.shape[0] - seq_offset
    if num_seqs <= 0 or num_tokens == 0:
        return
    if config.block_m < group or config.block_m < 16 or config.block_n < 16:
        raise ValueError(f"paged attention: tile {config} too small for GQA group {group}")
    head_dim, num_kv_heads, block_size = q.shape[2], k_cache.shape[2], k_cache.shape[1]
    block_q = config.block_m // group
    if decode_only:
        grid = (num_kv_heads, num_seqs)  # a sequence's heads side by side: see the module docstring
    else:
        grid = ((num_tokens + num_seqs * (block_q - 1)) // block_q, num_kv_heads)
    launch(
        _paged_attention_kernel, grid,
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        seq_offset, num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=_dot_precision(q.dtype),
        DECODE_ONLY=decode_only,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def paged_attention_split_kv(
    q: torch.Tensor,  # [T, H, D]; sequence i's single query token is q[query_start_loc[i]]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    num_splits: int,
    config: TileConfig,
) -> None:
    """Flash-decoding for sequences that each have exactly one query token.

    Launches (S, Hkv, num_splits) partial programs and an (S, H) reduction; the grid and the
    scratch size depend only on S and static shapes.
    """
    group = _check(q, k_cache, v_cache, out)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"paged attention: num_splits must be a power of two, got {num_splits}")
    if config.block_m < group or config.block_m < 16 or config.block_n < 16:
        raise ValueError(f"paged attention: tile {config} too small for GQA group {group}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_m = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(num_seqs * num_heads * num_splits * head_dim, dtype=torch.float32, device=q.device)
    launch(
        _paged_attention_split_kernel, (num_seqs, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_m, part_l, part_acc,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    launch(
        _split_reduce_kernel, (num_seqs, num_heads),
        part_m, part_l, part_acc, out, query_start_loc,
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=max(_SPLIT_BLOCK, num_splits),  # one compiled variant for every count up to 16
        num_warps=4,
    )
