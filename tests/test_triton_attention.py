"""Triton attention kernels vs the torch reference backend.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py before triton compiles), so
shapes are tiny; the same tests run compiled on a GPU. Outputs and unused cache slots are
poisoned with NaN before each run so any element a kernel fails to write, or any stale slot it
reads, shows up. Tests marked `gpu` use the real Qwen3-0.6B attention shape in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the Triton attention backend cannot run")

from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.kernels.paged_attention import TileConfig, choose_num_splits, paged_attention  # noqa: E402
from nanovllm.attention.kernels.store_kv import store_kv  # noqa: E402
from nanovllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanovllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (real shapes are too slow for the interpreter)")


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref_k_cache: torch.Tensor  # unused slots 0: the reference reads padded blocks
    ref_v_cache: torch.Tensor
    k_cache: torch.Tensor  # unused slots NaN: the kernels must never read them
    v_cache: torch.Tensor
    meta: AttentionMetadata
    used: torch.Tensor  # [num_blocks * block_size] bool, slots holding context after the step


def make_batch(
    decode_ctx: list[int],
    prefills: list[tuple[int, int]],  # (cached prefix length, chunk length)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Batch:
    """Decodes first, then prefill chunks; blocks scattered at random over a larger pool."""
    gen = torch.Generator().manual_seed(seed)
    ctx = list(decode_ctx) + [p + c for p, c in prefills]
    qlens = [1] * len(decode_ctx) + [c for _, c in prefills]
    prefix = [c - q for c, q in zip(ctx, qlens)]
    nblocks = [-(-c // block_size) for c in ctx]
    num_blocks = sum(nblocks) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx), max(max(nblocks), 1), dtype=torch.int32)  # padding rows point at block 0
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[start : start + n]
        start += n

    def slot(i: int, pos: int) -> int:
        return int(tables[i, pos // block_size]) * block_size + pos % block_size

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cached_k = torch.randn(shape, generator=gen).to(dtype)
    cached_v = torch.randn(shape, generator=gen).to(dtype)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    prefix_slots = [slot(i, p) for i in range(len(ctx)) for p in range(prefix[i])]
    used[prefix_slots] = True
    new_slots = [slot(i, p) for i in range(len(ctx)) for p in range(prefix[i], ctx[i])]
    used[new_slots] = True
    blank = torch.ones(num_blocks * block_size, dtype=torch.bool)  # every slot but the cached prefixes
    blank[prefix_slots] = False
    ref_k, ref_v, k_cache, v_cache = cached_k.clone(), cached_v.clone(), cached_k.clone(), cached_v.clone()
    for c in (ref_k, ref_v):
        c.view(-1, num_kv_heads, head_dim)[blank] = 0
    for c in (k_cache, v_cache):
        c.view(-1, num_kv_heads, head_dim)[blank] = float("nan")

    num_tokens = sum(qlens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64).to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(ctx, dtype=torch.int32).to(DEVICE),
        block_tables=tables.to(DEVICE),
        num_decodes=len(decode_ctx),
        max_query_len=max(qlens),
        max_seq_len=max(ctx),
        query_lens_cpu=qlens,
        seq_lens_cpu=ctx,
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return Batch(to(q), to(k), to(v), to(ref_k), to(ref_v), to(k_cache), to(v_cache), meta, used.to(DEVICE))


def run_both(batch: Batch, backend: TritonAttentionBackend, scale: float = 0.37) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference output, Triton output (written into a NaN-filled buffer); also checks the caches."""
    ref = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.ref_k_cache, batch.ref_v_cache, batch.meta, scale
    )
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))
    backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out)
    for mine, theirs in ((batch.k_cache, batch.ref_k_cache), (batch.v_cache, batch.ref_v_cache)):
        flat, ref_flat = mine.flatten(0, 1), theirs.flatten(0, 1)
        torch.testing.assert_close(flat[batch.used], ref_flat[batch.used], atol=0, rtol=0)
        assert torch.isnan(flat[~batch.used]).all(), "a slot outside the step's context was written"
    return ref, out


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


TINY_DECODE = TileConfig(block_m=16, block_n=16)

# (num_heads, num_kv_heads, head_dim, block_size, dtype, decode tile, prefill tile)
MIXED_CASES = [
    pytest.param(2, 2, 32, 8, torch.float32, TINY_DECODE, TileConfig(16, 16), id="mha-bs8-d32-fp32"),
    pytest.param(4, 2, 32, 16, torch.float32, TINY_DECODE, TileConfig(32, 16), id="gqa2-bs16-d32-fp32"),
    pytest.param(8, 2, 64, 8, torch.float32, TileConfig(16, 32), TileConfig(32, 32), id="gqa4-bs8-d64-fp32-tile4blocks"),
    pytest.param(4, 1, 32, 32, torch.float32, TINY_DECODE, TileConfig(16, 16), id="gqa4-bs32-d32-fp32-halfblock-tile"),
    pytest.param(6, 2, 32, 16, torch.float32, TINY_DECODE, TileConfig(16, 16), id="gqa3-bs16-d32-fp32"),
    pytest.param(4, 2, 64, 16, torch.float16, TINY_DECODE, TileConfig(32, 16), id="gqa2-bs16-d64-fp16"),
    pytest.param(4, 4, 32, 8, torch.float16, TINY_DECODE, TileConfig(16, 16), id="mha-bs8-d32-fp16"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,dec_cfg,pre_cfg", MIXED_CASES)
def test_mixed_batch_matches_torch(num_heads, num_kv_heads, head_dim, block_size, dtype, dec_cfg, pre_cfg):
    # Decodes of several lengths (block-aligned, one past a block, tiny), then prefill chunks: a
    # fresh prompt, a chunk after an unaligned prefix crossing block boundaries, an aligned prefix.
    bs = block_size
    batch = make_batch(
        decode_ctx=[1, bs, bs + 1, 3 * bs - 3],
        prefills=[(0, 13), (bs + 3, 2 * bs - 1), (2 * bs, 5), (5, 1)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=num_heads * 100 + block_size,
    )
    backend = TritonAttentionBackend(decode_config=dec_cfg, prefill_config=pre_cfg)
    ref, out = run_both(batch, backend)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("block_m", [16, 32])
def test_one_launch_over_decodes_and_prefills(block_m):
    """The kernel's tile-to-sequence search, with decodes and chunks in a single launch."""
    batch = make_batch([9, 1, 17], [(0, 7), (4, 19), (11, 1), (0, 3)], 4, 2, 32, 8, torch.float32, seed=11)
    ref, _ = run_both(batch, TritonAttentionBackend(decode_config=TINY_DECODE, prefill_config=TileConfig(16, 16)))
    out = torch.full_like(batch.q, float("nan"))
    m = batch.meta
    paged_attention(batch.q, batch.k_cache, batch.v_cache, out, m.block_tables, m.seq_lens, m.query_start_loc,
                    batch.q.shape[0], 0.37, TileConfig(block_m, 16))
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_prefill_only_and_forward_entry_point():
    batch = make_batch([], [(0, 20), (7, 9)], 4, 2, 32, 8, torch.float32, seed=3)
    backend = TritonAttentionBackend(prefill_config=TileConfig(32, 16))
    ref = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, batch.ref_k_cache, batch.ref_v_cache, batch.meta, 0.2)
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,splits",
    [(4, 2, 8, 4), (8, 2, 16, 2), (2, 2, 8, 8), (4, 1, 16, 16), (2, 1, 8, 32)],
)
def test_split_kv_matches_single_pass_and_torch(num_heads, num_kv_heads, block_size, splits):
    # Contexts from 1 token (most splits empty) to several tiles per split, unaligned ends.
    ctx = [1, 5, 4 * block_size + 3, 9 * block_size]
    batch = make_batch(ctx, [], num_heads, num_kv_heads, 32, block_size, torch.float32, seed=splits)
    split = TritonAttentionBackend(split_kv=True, num_splits=splits, decode_config=TINY_DECODE)
    ref, out_split = run_both(batch, split)
    torch.testing.assert_close(out_split, ref, **tolerance(torch.float32))
    single = TritonAttentionBackend(split_kv=False, decode_config=TINY_DECODE)
    out_single = torch.full_like(batch.q, float("nan"))
    single.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.37, out_single)
    torch.testing.assert_close(out_split, out_single, **tolerance(torch.float32))


def test_padded_decode_rows_are_finite():
    """CUDA-graph padding: a sequence of length 0 with slot -1 must give zeros, not NaN."""
    batch = make_batch([6, 11], [], 4, 2, 32, 8, torch.float32, seed=7)
    meta = batch.meta
    pad = AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1], device=DEVICE)]),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])]),
        num_decodes=3,
        max_query_len=1,
        max_seq_len=11,
        query_lens_cpu=[1, 1, 1],
        seq_lens_cpu=[6, 11, 0],
    )
    q = torch.cat([batch.q, torch.randn_like(batch.q[:1])])
    k = torch.cat([batch.k, torch.randn_like(batch.k[:1])])
    v = torch.cat([batch.v, torch.randn_like(batch.v[:1])])
    ref = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, batch.ref_k_cache, batch.ref_v_cache, meta, 0.37)
    for split in (False, True):
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        backend = TritonAttentionBackend(split_kv=split, num_splits=4 if split else None, decode_config=TINY_DECODE)
        out = backend.forward(q, k, v, kc, vc, pad, 0.37)
        torch.testing.assert_close(out[:2], ref, **tolerance(torch.float32))
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kv_writes_exactly_the_given_slots(block_size):
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 32, 10
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    # k/v as strided views of a fused projection, stored into an fp16 cache (cast in the kernel).
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE)
    k = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (2 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float16, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float16, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))

    keep = slots >= 0
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    for cache, src in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, num_kv_heads, head_dim).cpu()
        torch.testing.assert_close(flat[slots[keep]], src.cpu()[keep].half(), atol=0, rtol=0)
        assert torch.isnan(flat[~written]).all()


def test_choose_num_splits():
    # On a 132-SM GPU a batch of 64 already fills it; 32 and 16 sequences run fastest at 2 and 4
    # splits; one sequence at 8-16.
    assert choose_num_splits(256, 8, 132) == 1
    assert choose_num_splits(64, 8, 132) == 1
    assert choose_num_splits(32, 8, 132) == 2
    assert choose_num_splits(16, 8, 132) == 4
    assert choose_num_splits(4, 8, 132) == 16
    assert choose_num_splits(1, 8, 132) == 16
    assert choose_num_splits(1, 8, 132, max_splits=8) == 8
    assert choose_num_splits(0, 8, 132) <= 16
    for seqs in range(1, 300):  # never fewer programs than SMs unless capped, never a split too many
        s = choose_num_splits(seqs, 8, 132)
        assert s & (s - 1) == 0 and (seqs * 8 * s >= 132 or s == 16)
        assert s == 1 or seqs * 8 * (s // 2) < 3 * 132


def test_bad_shapes_raise():
    batch = make_batch([3], [], 4, 2, 32, 8, torch.float32)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError):
        TritonAttentionBackend().attend(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.meta, 1.0, out)


# ---------------------------------------------------------------- real shapes, CUDA only

QWEN3 = dict(num_heads=16, num_kv_heads=8, head_dim=128)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "decode_ctx,prefills",
    [
        pytest.param([900, 1500, 2047, 33, 1], [], id="decode-only"),
        pytest.param([], [(0, 1024), (517, 700)], id="prefill-only"),
        pytest.param([4000, 1200, 17], [(0, 300), (1999, 512), (64, 1)], id="mixed"),
    ],
)
def test_real_shape_bf16(block_size, decode_ctx, prefills):
    batch = make_batch(decode_ctx, prefills, block_size=block_size, dtype=torch.bfloat16, seed=block_size, **QWEN3)
    ref, out = run_both(batch, TritonAttentionBackend(), scale=128**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("split_kv", [False, True])
def test_real_shape_long_decode_split(split_kv):
    batch = make_batch([4096, 3000, 8191, 1], [], block_size=16, dtype=torch.bfloat16, seed=1, **QWEN3)
    ref, out = run_both(batch, TritonAttentionBackend(split_kv=split_kv), scale=128**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@needs_cuda
@pytest.mark.gpu
def test_real_shape_fp32_is_ieee():
    batch = make_batch([700, 2], [(300, 200)], block_size=16, dtype=torch.float32, seed=2, **QWEN3)
    ref, out = run_both(batch, TritonAttentionBackend(), scale=128**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("split_kv", [False, True])
def test_decode_cuda_graph_replays_any_context_length(split_kv):
    """Capture once at short contexts, replay at long ones: the grid must not bake in lengths."""
    short = make_batch([5, 40, 17, 2], [], block_size=16, dtype=torch.bfloat16, seed=5, spare_blocks=600, **QWEN3)
    long = make_batch([3000, 40, 1700, 4095], [], block_size=16, dtype=torch.bfloat16, seed=6, **QWEN3)
    backend = TritonAttentionBackend(split_kv=split_kv)
    num_blocks = max(short.k_cache.shape[0], long.k_cache.shape[0])
    k_cache = torch.zeros((num_blocks,) + tuple(short.k_cache.shape[1:]), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = short.q.clone(), short.k.clone(), short.v.clone()
    meta = short.meta
    width = long.meta.block_tables.shape[1]
    tables = torch.zeros(4, width, dtype=torch.int32, device=DEVICE)
    tables[:, : meta.block_tables.shape[1]] = meta.block_tables
    static = AttentionMetadata(meta.slot_mapping.clone(), meta.query_start_loc.clone(), meta.seq_lens.clone(), tables,
                               4, 1, meta.max_seq_len, meta.query_lens_cpu, meta.seq_lens_cpu)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, k_cache, v_cache, static, 128**-0.5)  # warm-up compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, static, 128**-0.5)

    # Load the long batch into the static buffers and the shared cache, then replay.
    k_cache[: long.k_cache.shape[0]].copy_(long.ref_k_cache)
    v_cache[: long.v_cache.shape[0]].copy_(long.ref_v_cache)
    q.copy_(long.q), k.copy_(long.k), v.copy_(long.v)
    static.slot_mapping.copy_(long.meta.slot_mapping)
    static.seq_lens.copy_(long.meta.seq_lens)
    static.block_tables.copy_(long.meta.block_tables)
    graph.replay()
    ref = TorchAttentionBackend().forward(long.q, long.k, long.v, long.ref_k_cache, long.ref_v_cache, long.meta, 128**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))
