"""The mixture-of-experts MLP on the GPU: routing, grouping by expert and the expert GEMMs in
Triton, with no host sync (graph-capturable) and every launch through `precompile.launch`.

The steps of `fused_moe(x, router_logits, w13, w2, top_k, renormalize)`, T tokens, E experts,
S = T * top_k (token, choice) slots:

1. `route`: one program per token: softmax of the router logits in fp32, the top_k largest
   (ties to the lower expert id, as torch.topk), optionally renormalised to sum to 1. Gives
   weights [T, top_k] fp32 and expert ids [T, top_k] int32. `route_and_rank` also takes each
   slot's rank within its expert by an atomic add on the experts' counts (`SlotRanks`).
2. Grouping by expert, in one of three ways by the batch's size:
   - up to 64 slots, `route_one_slot_per_block`: the routing launch gives each slot a block of
     its own;
   - up to 8 slots per expert on average (decode), `route_by_expert`: the routing launch writes
     each slot at its rank in its expert's rows (`ExpertRows`, E groups of capacity T), and the
     GEMMs run one program per expert (and block of columns) over its rows, BLOCK_M at a time;
   - above, `align_by_expert` (vLLM's moe_align_block_size, written here): the S slots
     grouped by expert, each expert's group padded to a multiple of BLOCK_M, so that every
     block of BLOCK_M rows belongs to one expert. Each slot's rank within its expert comes
     from the routing launch, or from a launch of its own (per chunk of slots, a one-hot
     cumsum inside the chunk plus an atomic add of the chunk's counts); then every program of
     one launch lays out the groups from the counts (each expert's padded start, a cumsum over
     E that each program repeats), writes each slot of its chunk to its row, and gives each
     block of its chunk of blocks its expert and its last valid row.
   Every size is a bound computed from shapes (S, E, BLOCK_M), never from the routing, so
   nothing is read back to the host. Rows within an expert come in whatever order the atomics
   gave; each row of a GEMM is computed on its own, so the results do not depend on it.
3. `_gate_up_kernel`: per block of rows (or expert) and of intermediate columns,
   x[token] @ w13[e].T for the gate and the up halves, then silu(gate) * up, into a [S, I]
   buffer (rows by slot).
4. `_down_kernel`: per block, act[slot] @ w2[e].T times the slot's routing weight, into [S, H];
   `_sum_kernel` adds each token's top_k rows into [T, H].

Weight reads: on a GPU with the tensor memory accelerator (Hopper and newer), 3. and 4. read
their weight tiles through tensor descriptors (`TMA`; `MoEKernelConfig.tma`; an H200 runs
prefill-sized batches 6-8% faster so, decode-sized ones, which the weights' bytes bound, at the
same speed), the same arithmetic otherwise. Reads through pointers are the reference, and what
runs elsewhere.

Padding rows: a CUDA-graph decode batch is padded to the captured size, and a padding row
routed like a token would make the GEMMs read its experts' weights too (a lone sequence padded to
8 rows read up to 64 experts per layer instead of 8). Given the step's KV slots, `route` sends
rows whose slot is negative (padding) to no expert; they come out as zeros.

Numerics follow the torch reference (layers/moe.py, as Hugging Face computes it): gate and up
rounded to the activation dtype, SiLU rounded, then the product; the down projection rounded
before the routing weight. fp32 uses IEEE dot products, not TF32.

Block sizes: `MoEKernelConfig`, chosen by `default_config` from the tokens' average rows per
expert; any call can pass its own (benchmarks/moe_bench.py --sweep measures the choices).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.precompile import launch

try:  # Triton's host-side tensor descriptors (tensor memory accelerator reads on Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the expert weights are read through pointers
    TensorDescriptor = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALIGN_CHUNK = 64  # slots per program in the rank and scatter launches
# Up to this many slots (a decode graph of 8 rows at top-8), each slot takes a block of its own,
# laid out by the routing launch: the grouping's launches cost more than the few experts
# two slots share would save.
ONE_SLOT_PER_BLOCK_MAX_SLOTS = 64
# Up to this many slots per expert on average (decode-sized batches), the routing launch groups
# the slots itself (`ExpertRows`), one launch fewer than `align_by_expert`; above, where a
# crowded expert's rows are better split over programs, `align_by_expert`'s blocks do.
BY_EXPERT_MAX_ROWS_PER_EXPERT = 8


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int = 16  # rows (slots) per block; each expert's rows are padded to a multiple of it
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Read the expert weights through tensor descriptors (the tensor memory accelerator) or
    # through pointers; None: descriptors where the GPU and the weights allow them (_reads_by_tma).
    tma: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoEKernelConfig.{name} must be a power of two >= 16, got {value}")


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEKernelConfig:
    """Block sizes by the average rows each expert gets: small blocks for decode, where every
    expert holds a few rows and the weights' bytes dominate, large ones for prefill. The best of
    `benchmarks/moe_bench.py --sweep` on an H200 at the Qwen3-30B-A3B shape (docs/benchmarks.md)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert < 16:
        return MoEKernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert < 32:
        return MoEKernelConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return MoEKernelConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3)
    return MoEKernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


@dataclass(frozen=True)
class ExpertLayout:
    """Slots grouped by expert in blocks of block_m rows. Row r of block b holds slot
    sorted_slots[b * block_m + r] when b * block_m + r < block_row_end[b]; block_expert[b] is the
    block's expert, or E for blocks past the last expert's (they compute nothing)."""

    sorted_slots: torch.Tensor  # [num_blocks * block_m] int32
    block_expert: torch.Tensor  # [num_blocks] int32
    block_row_end: torch.Tensor  # [num_blocks] int32
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


@dataclass(frozen=True)
class ExpertRows:
    """Slots grouped by expert with no padding between groups: expert e's slots are
    sorted_slots[e * capacity : e * capacity + counts[e]], where capacity is the token count
    (a token sends at most one slot to an expert). The routing launch writes it as it ranks
    the slots, so no grouping launch follows; the GEMMs run one program per expert and block of
    columns, over its rows BLOCK_M at a time (what decode-sized batches use: a few rows each)."""

    sorted_slots: torch.Tensor  # [E * capacity] int32
    counts: torch.Tensor  # [E_PAD] int32
    capacity: int
    block_m: int


@dataclass
class SlotRanks:
    """Each slot's rank among the slots of its expert, and each expert's count of slots: what
    the grouping's scatter needs (from `_rank_kernel`, or from the routing launch)."""

    counts: torch.Tensor  # [E_PAD] int32
    rank: torch.Tensor  # [S] int32
    expert_rows: torch.Tensor | None = None  # [E * T] int32: ExpertRows.sorted_slots, when asked for


# ---- 1. routing ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["capacity"])
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, slot_ptr, stride_l, E,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    sorted_slots_ptr, block_expert_ptr, block_row_end_ptr, LAYOUT_BLOCK_M: tl.constexpr,
    counts_ptr, rank_ptr, RANK: tl.constexpr, expert_rows_ptr, capacity, BY_EXPERT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(valid, p, -1.0)
    koffs = tl.arange(0, BLOCK_K)
    values = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        values = tl.where(koffs == j, best, values)
        ids = tl.where(koffs == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        values = values / tl.sum(tl.where(koffs < TOP_K, values, 0.0), axis=0)
    kmask = koffs < TOP_K
    if HAS_SLOTS:  # a padding row (KV slot < 0) goes to no expert: id E, weight 0
        padding = tl.load(slot_ptr + row + koffs * 0) < 0
        ids = tl.where(padding, E, ids)
        values = tl.where(padding, 0.0, values)
    tl.store(weights_ptr + row * TOP_K + koffs, values, mask=kmask)
    tl.store(ids_ptr + row * TOP_K + koffs, ids, mask=kmask)
    if RANK:  # each slot's rank among its expert's slots, in the order the atomics come (ids distinct per token)
        rank = tl.atomic_add(counts_ptr + ids, 1, mask=kmask & (ids < E))
        tl.store(rank_ptr + row * TOP_K + koffs, rank, mask=kmask)
        if BY_EXPERT:  # the slot's row among its expert's (ExpertRows): the grouping is done
            tl.store(expert_rows_ptr + ids.to(tl.int64) * capacity + rank, (row * TOP_K + koffs).to(tl.int32),
                     mask=kmask & (ids < E))
    if LAYOUT_BLOCK_M > 0:  # one block per slot (small batches): no grouping launches
        slots = row * TOP_K + koffs
        tl.store(sorted_slots_ptr + slots * LAYOUT_BLOCK_M, slots.to(tl.int32), mask=kmask)
        tl.store(block_expert_ptr + slots, ids, mask=kmask)
        tl.store(block_row_end_ptr + slots, (slots * LAYOUT_BLOCK_M + 1).to(tl.int32), mask=kmask)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, slot_mapping: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k] int32) of softmax(router_logits)'s top_k.
    With slot_mapping [T] (the step's KV slots), rows whose slot is negative are the padding of
    a CUDA-graph batch: they get expert id E and weight 0, so no expert computes them."""
    weights, ids, _, _ = _route(router_logits, top_k, renormalize, slot_mapping, 0, False)
    return weights, ids


def route_and_rank(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, slot_mapping: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, SlotRanks]:
    """`route`, plus from the same launch each slot's rank within its expert and the experts'
    counts (`SlotRanks`, for `align_by_expert`): the grouping's first launch is not needed."""
    weights, ids, _, ranks = _route(router_logits, top_k, renormalize, slot_mapping, 0, True)
    return weights, ids, ranks


def route_one_slot_per_block(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, slot_mapping: torch.Tensor | None, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """`route`, plus the `ExpertLayout` of one block per slot (block s holds slot s alone) from
    the same launch: what small batches use instead of `align_by_expert`'s grouping."""
    weights, ids, layout, _ = _route(router_logits, top_k, renormalize, slot_mapping, block_m, False)
    return weights, ids, layout


def route_by_expert(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, slot_mapping: torch.Tensor | None, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, ExpertRows]:
    """`route`, plus the slots grouped by expert (`ExpertRows`) from the same launch."""
    weights, ids, _, ranks = _route(router_logits, top_k, renormalize, slot_mapping, 0, True, by_expert=True)
    return weights, ids, ExpertRows(ranks.expert_rows, ranks.counts, router_logits.shape[0], block_m)


def _route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, slot_mapping: torch.Tensor | None,
    layout_block_m: int, rank: bool, by_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout | None, SlotRanks | None]:
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, {num_experts}] (the experts)")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    num_slots = num_tokens * top_k
    layout = None
    if layout_block_m:
        layout = ExpertLayout(
            torch.empty(num_slots * layout_block_m, dtype=torch.int32, device=device),
            torch.empty(num_slots, dtype=torch.int32, device=device),
            torch.empty(num_slots, dtype=torch.int32, device=device),
            layout_block_m,
        )
    ranks = None
    if rank:
        ranks = SlotRanks(torch.zeros(triton.next_power_of_2(num_experts), dtype=torch.int32, device=device),
                          torch.empty(num_slots, dtype=torch.int32, device=device))
        if by_expert:
            ranks.expert_rows = torch.empty(num_experts * num_tokens, dtype=torch.int32, device=device)
    if num_tokens:
        launch(
            _route_kernel, (num_tokens,), router_logits, weights, ids,
            slot_mapping if slot_mapping is not None else ids, router_logits.stride(0), num_experts,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), HAS_SLOTS=slot_mapping is not None,
            sorted_slots_ptr=layout.sorted_slots if layout else ids,  # unused without a layout
            block_expert_ptr=layout.block_expert if layout else ids,
            block_row_end_ptr=layout.block_row_end if layout else ids, LAYOUT_BLOCK_M=layout_block_m,
            counts_ptr=ranks.counts if ranks else ids, rank_ptr=ranks.rank if ranks else ids, RANK=rank,
            expert_rows_ptr=ranks.expert_rows if by_expert else ids, capacity=num_tokens, BY_EXPERT=by_expert,
        )
    return weights, ids, layout, ranks


# ---- 2. grouping by expert ---------------------------------------------------------------------


# Counts that change with the batch are not specialised on (Triton would compile a variant for
# each divisibility by 16 mid-run); shapes fixed by the model still are.
@triton.jit(do_not_specialize=["S"])
def _rank_kernel(ids_ptr, counts_ptr, rank_ptr, S, E, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1)
    experts = tl.arange(0, E_PAD)
    onehot = ((ids[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32)  # [BLOCK, E_PAD]; id E: none
    before = tl.cumsum(onehot, axis=0) - onehot  # same-expert slots earlier in this chunk
    rank_in_chunk = tl.sum(before * onehot, axis=1)
    counts = tl.sum(onehot, axis=0)
    chunk_base = tl.atomic_add(counts_ptr + experts, counts, mask=experts < E)  # old counts
    base = tl.sum(onehot * chunk_base[None, :], axis=1)
    tl.store(rank_ptr + offs, base + rank_in_chunk, mask=offs < S)


@triton.jit(do_not_specialize=["S", "num_blocks"])
def _scatter_kernel(
    ids_ptr, rank_ptr, counts_ptr, sorted_slots_ptr, block_expert_ptr, block_row_end_ptr, S, E, num_blocks,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Each program lays out the padded groups from the experts' counts (a cumsum over E, cheap
    enough to repeat in every program), writes the rows of its chunk of BLOCK slots, and the
    expert and last valid row of its chunk of BLOCK_B blocks."""
    experts = tl.arange(0, E_PAD)
    real = experts < E
    counts = tl.load(counts_ptr + experts, mask=real, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=E)
    mask = (offs < S) & (ids < E)
    rank = tl.load(rank_ptr + offs, mask=mask, other=0)
    # Each slot's expert's padded start: the start of the expert whose id it holds.
    row = tl.sum(tl.where(experts[None, :] == ids[:, None], start[None, :], 0), axis=1) + rank
    tl.store(sorted_slots_ptr + row, offs, mask=mask)
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    first_row = blocks * BLOCK_M
    # A block's expert: how many experts end at or before its first row (E past the last).
    expert = tl.sum(((end[None, :] <= first_row[:, None]) & real[None, :]).to(tl.int32), axis=1)
    row_end = tl.sum(tl.where(experts[None, :] == expert[:, None], (start + counts)[None, :], 0), axis=1)
    tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    tl.store(block_row_end_ptr + blocks, row_end, mask=blocks < num_blocks)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded grouping can take at most: each non-empty expert wastes under one block."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, ranks: SlotRanks | None = None,
) -> ExpertLayout:
    """Group the slots of `expert_ids` ([T, top_k] int32, slot = token * top_k + choice) by
    expert; slots of id num_experts (padding rows) are left out. ranks: the slots' ranks from
    `route_and_rank` (else a launch of its own computes them)."""
    flat = expert_ids.reshape(-1)
    num_slots, device = flat.numel(), flat.device
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    if ranks is None:
        counts = torch.zeros(e_pad, dtype=torch.int32, device=device)
        rank = torch.empty(num_slots, dtype=torch.int32, device=device)
    else:
        counts, rank = ranks.counts, ranks.rank
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_row_end = torch.empty(num_blocks, dtype=torch.int32, device=device)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    if num_slots and ranks is None:
        launch(_rank_kernel, (triton.cdiv(num_slots, ALIGN_CHUNK),), flat, counts, rank, num_slots, num_experts,
               BLOCK=ALIGN_CHUNK, E_PAD=e_pad)
    if num_slots:  # without slots there are no blocks either
        block_b = max(16, min(128, 4096 // e_pad))
        programs = max(triton.cdiv(num_slots, ALIGN_CHUNK), triton.cdiv(num_blocks, block_b))
        launch(_scatter_kernel, (programs,), flat, rank, counts, sorted_slots, block_expert, block_row_end, num_slots,
               num_experts, num_blocks, BLOCK=ALIGN_CHUNK, BLOCK_M=block_m, E_PAD=e_pad, BLOCK_B=block_b)
    return ExpertLayout(sorted_slots, block_expert, block_row_end, block_m)


# ---- 3. and 4. the expert GEMMs ----------------------------------------------------------------


@triton.jit
def _gate_up_rows(
    x_ptr, w, out_ptr, sorted_slots_ptr, expert, m0, end, pid_n, N, K, stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows m0 .. min(m0 + BLOCK_M, end) of the sorted slots, columns of block pid_n."""
    rows = m0 + tl.arange(0, BLOCK_M)
    valid = rows < end
    slots = tl.load(sorted_slots_ptr + rows, mask=valid, other=0)
    tokens = (slots // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    if TMA:
        gate_row = expert * 2 * N + pid_n * BLOCK_N
        up_row = gate_row + N
    else:
        g_ptrs = w + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            g = w.load([gate_row, k0]).T
            u = w.load([up_row, k0]).T
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["capacity"])
def _gate_up_kernel(
    x_ptr, w, out_ptr, sorted_slots_ptr, block_expert_ptr, row_end_ptr, capacity,
    N, K, E, stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BY_EXPERT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[slot, n] = silu(x[slot // TOP_K] . w[e, n]) * (x[slot // TOP_K] . w[e, N + n]).

    A program takes one `ExpertLayout` block of rows, or with BY_EXPERT all of expert pid_m's
    rows (`ExpertRows`; row_end_ptr: its counts), BLOCK_M at a time. w: the expert weights
    [E, 2N, K] through a pointer, or with TMA a tensor descriptor over them seen as [E * 2N, K]
    (tiles [BLOCK_N, BLOCK_K]). A descriptor's tile that runs past its expert's N rows reads the
    next matrix's rows, whose columns the store masks off; past K or the last row, the
    descriptor reads zeros."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if BY_EXPERT:
        first = pid_m * capacity
        end = first + tl.load(row_end_ptr + pid_m)
        for m0 in range(first, end, BLOCK_M):
            _gate_up_rows(x_ptr, w, out_ptr, sorted_slots_ptr, pid_m, m0, end, pid_n, N, K, stride_xt, stride_we,
                          stride_wn, stride_ot, TOP_K, TMA, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < E:
            _gate_up_rows(x_ptr, w, out_ptr, sorted_slots_ptr, expert, pid_m * BLOCK_M, tl.load(row_end_ptr + pid_m),
                          pid_n, N, K, stride_xt, stride_we, stride_wn, stride_ot, TOP_K, TMA, IEEE, UPCAST, BLOCK_M,
                          BLOCK_N, BLOCK_K)


@triton.jit
def _down_rows(
    a_ptr, w, route_w_ptr, out_ptr, sorted_slots_ptr, expert, m0, end, pid_n, N, K,
    stride_at, stride_we, stride_wn, stride_ot,
    TMA: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows m0 .. min(m0 + BLOCK_M, end) of the sorted slots, columns of block pid_n."""
    rows = m0 + tl.arange(0, BLOCK_M)
    valid = rows < end
    slots = tl.load(sorted_slots_ptr + rows, mask=valid, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + slots[:, None] * stride_at + offs_k[None, :]
    if TMA:
        w_row = expert * N + pid_n * BLOCK_N
    else:
        w_ptrs = w + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            b = w.load([w_row, k0]).T
        else:
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0).to(dtype).to(tl.float32)
    out = acc.to(dtype).to(tl.float32) * route_w[:, None]
    tl.store(out_ptr + slots[:, None] * stride_ot + offs_n[None, :], out.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["capacity"])
def _down_kernel(
    a_ptr, w, route_w_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr, row_end_ptr, capacity,
    N, K, E, stride_at, stride_we, stride_wn, stride_ot,
    TMA: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BY_EXPERT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[slot, n] = (a[slot] . w[e, n]) * route_w[slot], over rows as _gate_up_kernel takes
    them. w: [E, N, K] through a pointer, or with TMA a tensor descriptor over it seen as
    [E * N, K] (rows past the expert's N are masked at the store, as in _gate_up_kernel)."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if BY_EXPERT:
        first = pid_m * capacity
        end = first + tl.load(row_end_ptr + pid_m)
        for m0 in range(first, end, BLOCK_M):
            _down_rows(a_ptr, w, route_w_ptr, out_ptr, sorted_slots_ptr, pid_m, m0, end, pid_n, N, K, stride_at,
                       stride_we, stride_wn, stride_ot, TMA, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < E:
            _down_rows(a_ptr, w, route_w_ptr, out_ptr, sorted_slots_ptr, expert, pid_m * BLOCK_M,
                       tl.load(row_end_ptr + pid_m), pid_n, N, K, stride_at, stride_we, stride_wn, stride_ot, TMA, IEEE,
                       UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _sum_kernel(down_ptr, ids_ptr, out_ptr, H, E, stride_dt, stride_ot, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over j of down[t * TOP_K + j], over the choices that went to an expert."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        routed = tl.load(ids_ptr + token * TOP_K + j + offs * 0) < E
        acc += tl.load(down_ptr + (token * TOP_K + j) * stride_dt + offs, mask=(offs < H) & routed, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x, w13 and w2 must share one of float32/float16/bfloat16, got "
                         f"{x.dtype}, {w13.dtype}, {w2.dtype}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[-1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(f"fused_moe: shapes x {list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)} "
                         "do not fit ([T, H], [E, 2I, H], [E, H, I])")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe: expert weights need a contiguous last axis")


@functools.lru_cache(maxsize=None)
def _has_tensor_memory_accelerator(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tma_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the expert weights can be read through tensor descriptors: 16-bit weights,
    contiguous and 16-byte aligned (the descriptor's rules), and a Triton that has them."""
    return (
        TensorDescriptor is not None and x.dtype in (torch.float16, torch.bfloat16)
        and w13.is_contiguous() and w2.is_contiguous()
        and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
        and (w13.shape[-1] * w13.element_size()) % 16 == 0 and (w2.shape[-1] * w2.element_size()) % 16 == 0
    )


def _reads_by_tma(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, tma: bool | None) -> bool:
    """tma=None: on a GPU with the tensor memory accelerator (Hopper and newer) where the
    weights allow it; True: always (an error where the weights do not allow it)."""
    if tma is None:
        return x.is_cuda and _has_tensor_memory_accelerator(x.device.index or 0) and tma_supported(x, w13, w2)
    if tma and not tma_supported(x, w13, w2):
        raise ValueError("fused_experts: MoEKernelConfig.tma=True needs contiguous, 16-byte aligned float16/bfloat16 weights "
                         "and a Triton with tensor descriptors")
    return tma


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: MoEKernelConfig | None = None, layout: ExpertLayout | ExpertRows | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token: [T, H] (an id
    of E, a padding row's, adds nothing). layout: the slots grouped by expert (`ExpertLayout`
    or `ExpertRows`), else grouped here by `align_by_expert`."""
    _check(x, w13, w2)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    config = config or default_config(num_tokens, num_experts, top_k)
    if layout is None:
        layout = align_by_expert(topk_ids, num_experts, config.block_m)
    elif layout.block_m != config.block_m:
        raise ValueError(f"fused_experts: layout.block_m={layout.block_m} != config.block_m={config.block_m}")
    by_expert = isinstance(layout, ExpertRows)
    if by_expert:  # one program per expert (and block of columns), over its rows
        programs, block_expert, row_end, capacity = num_experts, layout.counts, layout.counts, layout.capacity
    else:  # one program per block of rows
        programs, block_expert, row_end, capacity = layout.num_blocks, layout.block_expert, layout.block_row_end, 0
    num_slots = num_tokens * top_k
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    down = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    # The Triton interpreter multiplies 16-bit tl.dot operands wrongly (3.9); there they are
    # widened to fp32 first, which leaves the products exact.
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and not ieee
    tiles = dict(UPCAST=upcast, BY_EXPERT=by_expert, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    tma = _reads_by_tma(x, w13, w2, config.tma)
    if tma:
        tile = [config.block_n, config.block_k]
        w13_read = TensorDescriptor.from_tensor(w13.view(num_experts * two_inter, hidden), tile)
        w2_read = TensorDescriptor.from_tensor(w2.view(num_experts * hidden, inter), tile)
    else:
        w13_read, w2_read = w13, w2
    launch(
        _gate_up_kernel, (programs * triton.cdiv(inter, config.block_n),),
        x, w13_read, act, layout.sorted_slots, block_expert, row_end, capacity,
        inter, hidden, num_experts, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, TMA=tma, IEEE=ieee, **tiles,
    )
    launch(
        _down_kernel, (programs * triton.cdiv(hidden, config.block_n),),
        act, w2_read, topk_weights.reshape(-1), down, layout.sorted_slots, block_expert, row_end, capacity,
        hidden, inter, num_experts, act.stride(0), w2.stride(0), w2.stride(1), down.stride(0),
        TMA=tma, IEEE=ieee, **tiles,
    )
    return _sum_slots(down, topk_ids, x, hidden, num_experts, top_k)


def _sum_slots(down: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor, hidden: int, num_experts: int,
               top_k: int) -> torch.Tensor:
    out = torch.empty_like(x)
    block_h = min(1024, triton.next_power_of_2(hidden))
    launch(_sum_kernel, (x.shape[0], triton.cdiv(hidden, block_h)), down, topk_ids, out, hidden, num_experts,
           down.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h)
    return out


def fused_moe(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, config: MoEKernelConfig | None = None, slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole MoE MLP for x [T, H]: route, then `fused_experts`. Padding rows (slot_mapping
    < 0) give zeros."""
    num_tokens, num_experts = router_logits.shape
    config = config or default_config(num_tokens, num_experts, top_k)
    if num_tokens * top_k <= ONE_SLOT_PER_BLOCK_MAX_SLOTS:
        weights, ids, layout = route_one_slot_per_block(router_logits, top_k, renormalize, slot_mapping, config.block_m)
        return fused_experts(x, w13, w2, weights, ids, config, layout)
    if num_tokens * top_k <= BY_EXPERT_MAX_ROWS_PER_EXPERT * num_experts:
        weights, ids, rows = route_by_expert(router_logits, top_k, renormalize, slot_mapping, config.block_m)
        return fused_experts(x, w13, w2, weights, ids, config, rows)
    weights, ids, ranks = route_and_rank(router_logits, top_k, renormalize, slot_mapping)
    layout = align_by_expert(ids, num_experts, config.block_m, ranks)
    return fused_experts(x, w13, w2, weights, ids, config, layout)

