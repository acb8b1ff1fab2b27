"""The fused MoE kernels (layers/fused_moe.py) against the torch reference (layers/moe.py).

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by conftest.py) at small shapes: odd
expert counts, top-k of 1 and 8, renormalised or not, sizes that are not multiples of the blocks.
The grouping by expert is checked against a plain Python grouping of the same ids. The `gpu`
test runs the Qwen3-30B-A3B layer shape in bf16 at decode and prefill token counts.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the fused MoE kernels cannot run")

from nanovllm.layers import fused_moe  # noqa: E402
from nanovllm.layers.moe import experts_reference, moe_reference, route_reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# (tokens, experts, top_k, hidden, intermediate, renormalize)
SHAPES = [
    pytest.param(5, 5, 2, 32, 48, False, id="t5-e5-k2-odd-inter"),
    pytest.param(3, 7, 1, 48, 32, True, id="t3-e7-k1-renorm"),
    pytest.param(6, 8, 8, 32, 16, True, id="t6-e8-k8-all-experts"),
    pytest.param(20, 3, 2, 16, 24, False, id="t20-e3-k2-multi-block"),
]


def make_inputs(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return [t.to(DEVICE, dtype) for t in (x, logits, w13, w2)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, renormalize", SHAPES)
def test_route_matches_softmax_topk(tokens, experts, top_k, hidden, inter, renormalize):
    _, logits, _, _ = make_inputs(tokens, experts, top_k, hidden, inter, torch.float32)
    weights, ids = fused_moe.route(logits, top_k, renormalize)
    want_weights, want_ids = route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, device=DEVICE))


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("experts, top_k, tokens", [(7, 3, 23), (40, 3, 150)],
                         ids=["one-program", "several-programs"])  # slots and blocks over several programs
def test_align_groups_every_slot_once_in_its_experts_blocks(block_m, experts, top_k, tokens):
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[:10, 0] = 2  # one crowded expert spanning several blocks
    ids[:10, 1:] = torch.tensor([4, 5], dtype=torch.int32)
    layout = fused_moe.align_by_expert(ids.to(DEVICE), experts, block_m)
    flat = ids.reshape(-1).tolist()
    block_expert = layout.block_expert.cpu().tolist()
    assert layout.num_blocks == fused_moe.max_blocks(len(flat), experts, block_m)
    expected_blocks = []
    for e in range(experts):
        count = flat.count(e)
        expected_blocks += [e] * (-(-count // block_m))
    used = [b for b in block_expert if b < experts]
    assert used == expected_blocks  # blocks in expert order, each expert's count rounded up
    assert all(b == experts for b in block_expert[len(used):])
    assert sorted(_slots_in_their_experts_blocks(layout, flat, experts)) == list(range(len(flat)))


def _slots_in_their_experts_blocks(layout, flat: list[int], experts: int) -> list[int]:
    """The slots the layout's blocks of real experts hold, each checked to be its expert's."""
    sorted_slots, row_end = layout.sorted_slots.cpu().tolist(), layout.block_row_end.cpu().tolist()
    seen = []
    for b, e in enumerate(layout.block_expert.cpu().tolist()):
        if e < experts:
            for r in range(b * layout.block_m, min((b + 1) * layout.block_m, row_end[b])):
                assert flat[sorted_slots[r]] == e
                seen.append(sorted_slots[r])
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, renormalize", SHAPES)
def test_fused_moe_matches_reference(tokens, experts, top_k, hidden, inter, renormalize, dtype):
    x, logits, w13, w2 = make_inputs(tokens, experts, top_k, hidden, inter, dtype)
    got = fused_moe.fused_moe(x, logits, w13, w2, top_k, renormalize)
    want = moe_reference(x, logits, w13, w2, top_k, renormalize)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


def test_explicit_kernel_config_gives_the_same_result():
    x, logits, w13, w2 = make_inputs(9, 5, 2, 40, 40, torch.float32)
    configs = [fused_moe.MoEKernelConfig(16, 16, 16), fused_moe.MoEKernelConfig(32, 32, 64, num_warps=2)]
    results = [fused_moe.fused_moe(x, logits, w13, w2, 2, True, c) for c in configs]
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0], moe_reference(x, logits, w13, w2, 2, True), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_value_errors():
    x, logits, w13, w2 = make_inputs(4, 5, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe.route(logits, 6, True)
    with pytest.raises(ValueError, match="shapes"):
        fused_moe.fused_experts(x[:, :16], w13, w2, *route_reference(logits, 2, True))
    with pytest.raises(ValueError, match="share"):
        fused_moe.fused_experts(x.double(), w13, w2, *route_reference(logits, 2, True))
    with pytest.raises(ValueError, match="block_n"):
        fused_moe.MoEKernelConfig(block_n=48)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the 30B-A3B layer shape is too slow interpreted)")
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
def test_qwen3_30b_layer_shape_bf16(tokens):
    x, logits, w13, w2 = make_inputs(tokens, 128, 8, 2048, 768, torch.bfloat16)
    got = fused_moe.fused_moe(x, logits, w13, w2, 8, True)
    want = experts_reference(x, w13, w2, *route_reference(logits, 8, True))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_padding_rows_skip_the_experts_and_give_zeros():
    """Rows whose KV slot is -1 (CUDA-graph padding) are routed to no expert: their output is 0,
    the other rows' equals the reference, and the grouping holds only the real rows' slots."""
    tokens, experts, top_k = 6, 5, 2
    x, logits, w13, w2 = make_inputs(tokens, experts, top_k, 32, 24, torch.float32)
    slots = torch.tensor([7, 3, 12, -1, -1, -1], device=DEVICE)
    weights, ids = fused_moe.route(logits, top_k, True, slots)
    assert (ids[3:] == experts).all() and (weights[3:] == 0).all()
    layout = fused_moe.align_by_expert(ids, experts, 16)
    ends = layout.block_row_end.cpu().tolist()
    real = [s for b, e in enumerate(layout.block_expert.cpu().tolist()) if e < experts
            for s in layout.sorted_slots.cpu().tolist()[b * 16:ends[b]]]
    assert sorted(real) == list(range(3 * top_k))
    got = fused_moe.fused_moe(x, logits, w13, w2, top_k, True, slot_mapping=slots)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))
    torch.testing.assert_close(got[:3], moe_reference(x[:3], logits[:3], w13, w2, top_k, True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, top_k", [(8, 8), (9, 8)], ids=["one-slot-per-block", "grouped"])
def test_small_and_large_batches_around_the_layout_switch(tokens, top_k):
    """Up to 64 slots each slot gets its own block from the routing launch; above, the slots are
    grouped by expert. Both give the reference, padding rows included."""
    x, logits, w13, w2 = make_inputs(tokens, 11, top_k, 32, 24, torch.float32)
    slots = torch.arange(tokens, device=DEVICE)
    slots[-2:] = -1
    got = fused_moe.fused_moe(x, logits, w13, w2, top_k, False, slot_mapping=slots)
    assert torch.equal(got[-2:], torch.zeros_like(got[-2:]))
    want = moe_reference(x[:-2], logits[:-2], w13, w2, top_k, False)
    torch.testing.assert_close(got[:-2], want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(fused_moe.TensorDescriptor is None, reason="this Triton has no tensor descriptors")
@pytest.mark.parametrize("config", [fused_moe.MoEKernelConfig(16, 16, 16), fused_moe.MoEKernelConfig(16, 32, 32)],
                         ids=["tiles-16", "tiles-32-past-the-edges"])
@pytest.mark.parametrize("tokens", [5, 30], ids=["one-slot-per-block", "grouped"])
def test_weights_read_through_tensor_descriptors_give_the_pointer_path_result(config, tokens):
    """The TMA kernels (weights through tensor descriptors) against the pointer kernels and the
    reference, bf16. Intermediate 24 and hidden 40 are not multiples of 32: a tile runs into the
    next expert's rows (masked at the store) and past K (read as zeros); the last expert's tile
    runs past the tensor's end."""
    x, logits, w13, w2 = make_inputs(tokens, 5, 2, 40, 24, torch.bfloat16)
    weights, ids = fused_moe.route(logits, 2, True)
    by_pointer = fused_moe.fused_experts(x, w13, w2, weights, ids, replace(config, tma=False))
    by_descriptor = fused_moe.fused_experts(x, w13, w2, weights, ids, replace(config, tma=True))
    torch.testing.assert_close(by_descriptor, by_pointer, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(by_descriptor, moe_reference(x, logits, w13, w2, 2, True), atol=3e-2, rtol=3e-2)


def test_tensor_descriptor_reads_refuse_fp32_weights():
    x, logits, w13, w2 = make_inputs(4, 5, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="tma=True"):
        fused_moe.fused_experts(x, w13, w2, *route_reference(logits, 2, True), fused_moe.MoEKernelConfig(tma=True))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the 30B-A3B layer shape is too slow interpreted)")
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
def test_qwen3_30b_layer_shape_tma_and_pointer_reads_agree(tokens):
    x, logits, w13, w2 = make_inputs(tokens, 128, 8, 2048, 768, torch.bfloat16)
    weights, ids = fused_moe.route(logits, 8, True)
    if not fused_moe.tma_supported(x, w13, w2):
        pytest.skip("this Triton has no tensor descriptors")
    config = fused_moe.default_config(tokens, 128, 8)
    by_pointer = fused_moe.fused_experts(x, w13, w2, weights, ids, replace(config, tma=False))
    by_descriptor = fused_moe.fused_experts(x, w13, w2, weights, ids, replace(config, tma=True))
    torch.testing.assert_close(by_descriptor, by_pointer, atol=1e-2, rtol=1e-2)
    want = experts_reference(x, w13, w2, *route_reference(logits, 8, True))
    torch.testing.assert_close(by_descriptor, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_m", [16, 32])
def test_ranks_from_the_routing_launch_group_every_slot_once(block_m):
    """route_and_rank's atomic ranks, given to align_by_expert, lay out every real slot once in a
    block of its expert (padding rows' slots nowhere), as the rank launch's do; and fused_moe,
    which groups so, equals the reference."""
    tokens, experts, top_k = 40, 7, 3
    x, logits, w13, w2 = make_inputs(tokens, experts, top_k, 32, 24, torch.float32)
    slots = torch.arange(tokens, device=DEVICE)
    slots[-4:] = -1
    weights, ids, ranks = fused_moe.route_and_rank(logits, top_k, True, slots)
    want_weights, want_ids = fused_moe.route(logits, top_k, True, slots)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    flat = ids.reshape(-1).tolist()
    assert ranks.counts[:experts].tolist() == [flat.count(e) for e in range(experts)]
    layout = fused_moe.align_by_expert(ids, experts, block_m, ranks)
    assert sorted(_slots_in_their_experts_blocks(layout, flat, experts)) == list(range((tokens - 4) * top_k))
    got = fused_moe.fused_moe(x, logits, w13, w2, top_k, True, slot_mapping=slots)
    assert torch.equal(got[-4:], torch.zeros_like(got[-4:]))
    torch.testing.assert_close(got[:-4], moe_reference(x[:-4], logits[:-4], w13, w2, top_k, True), atol=1e-5, rtol=1e-5)


def test_routing_launch_groups_every_real_slot_once_in_its_experts_rows():
    """route_by_expert: each expert's rows hold exactly the slots routed to it (padding rows'
    nowhere), in whatever order the atomics gave."""
    tokens, experts, top_k = 30, 6, 3
    _, logits, _, _ = make_inputs(tokens, experts, top_k, 16, 16, torch.float32)
    slots = torch.arange(tokens, device=DEVICE)
    slots[-5:] = -1
    weights, ids, rows = fused_moe.route_by_expert(logits, top_k, True, slots, 16)
    want_weights, want_ids = fused_moe.route(logits, top_k, True, slots)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    flat = ids.reshape(-1).tolist()
    counts, sorted_slots = rows.counts.tolist(), rows.sorted_slots.tolist()
    assert rows.capacity == tokens
    for e in range(experts):
        mine = sorted_slots[e * tokens:e * tokens + counts[e]]
        assert sorted(mine) == [s for s, i in enumerate(flat) if i == e]
    assert sum(counts[:experts]) == (tokens - 5) * top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_experts_over_their_rows_in_several_blocks_match_the_reference(dtype, block_m):
    """With `ExpertRows` a program runs its expert's rows block_m at a time: a crowded expert
    (40 rows here) takes several passes. The result equals the reference, padding rows zero."""
    tokens, experts, top_k = 48, 5, 2
    x, logits, w13, w2 = make_inputs(tokens, experts, top_k, 40, 24, dtype)
    logits[:40, 3] += 10.0  # expert 3 is every token's first choice for 40 tokens
    slots = torch.arange(tokens, device=DEVICE)
    slots[-3:] = -1
    config = fused_moe.MoEKernelConfig(block_m=block_m, block_n=16, block_k=16)
    weights, ids, rows = fused_moe.route_by_expert(logits, top_k, True, slots, block_m)
    assert rows.counts[3].item() >= 40
    got = fused_moe.fused_experts(x, w13, w2, weights, ids, config, rows)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))
    want = moe_reference(x[:-3], logits[:-3], w13, w2, top_k, True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got[:-3], want, **tol)


@pytest.mark.parametrize("tokens, by_expert", [(40, True), (65, False)], ids=["by-expert", "blocks"])
def test_fused_moe_on_both_sides_of_the_grouping_switch(tokens, by_expert):
    """Past ONE_SLOT_PER_BLOCK_MAX_SLOTS slots and up to BY_EXPERT_MAX_ROWS_PER_EXPERT slots
    per expert the routing launch groups the slots; above, align_by_expert's blocks do. Both
    give the reference."""
    experts, top_k = 16, 2
    slots = tokens * top_k
    assert slots > fused_moe.ONE_SLOT_PER_BLOCK_MAX_SLOTS
    assert (slots <= fused_moe.BY_EXPERT_MAX_ROWS_PER_EXPERT * experts) == by_expert
    x, logits, w13, w2 = make_inputs(tokens, experts, top_k, 32, 24, torch.float32)
    got = fused_moe.fused_moe(x, logits, w13, w2, top_k, False)
    torch.testing.assert_close(got, moe_reference(x, logits, w13, w2, top_k, False), atol=1e-5, rtol=1e-5)

