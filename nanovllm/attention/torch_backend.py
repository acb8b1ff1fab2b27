"""Reference attention in plain PyTorch: runs anywhere, and is what faster backends are
tested against.

Decodes (one query each) are done together in one batched gather over their block tables;
each prefill chunk is done on its own with a causal mask offset by its cached prefix. The loop
is over sequences, never over tokens.

On the CPU, what every layer would derive again from the step's metadata (whether every slot is
real, the slots' blocks and offsets, the decodes' block ids and mask) is derived by the first
layer and kept in `meta.derived` (_step_plan): each of those small ops costs its dispatch,
several per layer. Not on CUDA, where this path may run under graph capture, which must record
every op of every layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.metadata import AttentionMetadata


def blocks_apart(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches' blocks are apart in memory (the CPU pool interleaves layers:
    runner/host_memory.py), so that slots are addressed as (block, offset in the block)."""
    return not (k_cache.is_contiguous() and v_cache.is_contiguous())


def in_blocks(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots as (block, offset in the block)."""
    return slots // block_size, slots % block_size


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    all_valid: bool | None = None, block_offset: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write new K/V rows into their cache slots (slot -1 = padding, skipped). all_valid: whether
    no slot is -1, if the caller knows (else it is checked); block_offset: the valid slots as
    (block, offset in the block), if the caller has them."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if not all_valid:
        valid = slot_mapping >= 0
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    if not blocks_apart(k_cache, v_cache):
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    if block_offset is None:
        block_offset = in_blocks(slot_mapping, k_cache.shape[1])
    k_cache.index_put_(block_offset, k.to(k_cache.dtype))
    v_cache.index_put_(block_offset, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[n, nblocks] block ids -> [n, nblocks * block_size, H, D] cached rows. index_select copies
    whole blocks (contiguous rows); advanced indexing was ~2x slower on the CPU."""
    n, nblocks = block_ids.shape
    rows = cache.index_select(0, block_ids.view(-1))
    return rows.view(n, nblocks * cache.shape[1], cache.shape[2], cache.shape[3])


class _StepPlan:
    """What attention derives from one step's metadata, the same in every layer: whether every
    slot is real, and for the decodes their block ids ([decodes, blocks] int64, contiguous) and
    the additive mask of their real positions ([decodes, 1, 1, blocks * block_size] fp32: 0 at a
    real position, -inf past the end; SDPA would make the same from a bool mask in every call)."""

    def __init__(self, meta: AttentionMetadata, block_size: int) -> None:
        self._slot_mapping = meta.slot_mapping
        self._block_size = block_size
        self._all_valid: bool | None = None
        self._block_offset: tuple[torch.Tensor, torch.Tensor] | None = None
        nd = meta.num_decodes
        self.block_ids = self.mask = None
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            nblocks = (max_len + block_size - 1) // block_size
            self.block_ids = meta.block_tables[:nd, :nblocks].long().contiguous()
            pos = torch.arange(nblocks * block_size, device=meta.seq_lens.device)
            real = (pos[None, :] < meta.seq_lens[:nd, None].to(pos.dtype))[:, None, None, :]
            self.mask = torch.zeros(real.shape, device=real.device).masked_fill_(~real, float("-inf"))

    @property
    def all_valid(self) -> bool:
        """Whether no slot is -1 (padding). Asked only where K/V are stored here: on CUDA it
        syncs with the device, which a step whose K/V the fused kernel stored never does."""
        if self._all_valid is None:
            self._all_valid = bool((self._slot_mapping >= 0).all())
        return self._all_valid

    @property
    def block_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid slots as (block, offset in the block), for caches whose blocks are apart."""
        if self._block_offset is None:
            slots = self._slot_mapping if self.all_valid else self._slot_mapping[self._slot_mapping >= 0]
            self._block_offset = in_blocks(slots, self._block_size)
        return self._block_offset


def _step_plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    """This step's _StepPlan: kept in meta.derived on the CPU (see the module docstring), built
    per layer elsewhere."""
    if meta.seq_lens.device.type != "cpu":
        return _StepPlan(meta, block_size)
    key = f"torch_step_plan:{block_size}"
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _StepPlan(meta, block_size)
    return plan


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        block_size = k_cache.shape[1]
        plan = _step_plan(meta, block_size)
        if not kv_stored:
            block_offset = plan.block_offset if blocks_apart(k_cache, v_cache) else None
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.all_valid, block_offset)
        gqa = q.shape[1] != k_cache.shape[2]

        nd = meta.num_decodes
        if nd:
            # One SDPA call over every decode, in fp32, on [seqs, heads, positions, head_dim]
            # views of the gathered blocks (no transposing copies of K and V into bmm layout,
            # which would grow with the context). Query head h reads KV head
            # h // (heads / kv_heads), as everywhere in the engine.
            keys = _gather_context(k_cache, plan.block_ids).float().transpose(1, 2)  # [nd, Hkv, L, D]
            values = _gather_context(v_cache, plan.block_ids).float().transpose(1, 2)
            od = F.scaled_dot_product_attention(
                q[:nd].float().unsqueeze(2), keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=gqa,
            ).squeeze(2).to(q.dtype)
            if nd == q.shape[0]:  # decodes only, no padding rows
                return od
        out = torch.empty_like(q)
        if nd:
            out[:nd] = od

        start = nd  # decodes occupy the first nd tokens
        for i in range(nd, meta.num_seqs):
            qlen, ctx = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            nblocks = (ctx + block_size - 1) // block_size
            block_ids = meta.block_tables[i : i + 1, :nblocks].long()
            keys = _gather_context(k_cache, block_ids)[0, :ctx]  # [ctx, Hkv, D]
            values = _gather_context(v_cache, block_ids)[0, :ctx]
            qi = q[start : start + qlen]
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [qlen, ctx]
            oi = F.scaled_dot_product_attention(
                qi.transpose(0, 1).unsqueeze(0),
                keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
                values.to(q.dtype).transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start : start + qlen] = oi.squeeze(0).transpose(0, 1)
            start += qlen
        return out
