"""Reference attention in plain PyTorch: runs anywhere, and is what faster backends are
tested against.

Decodes (one query each) are done together in one batched gather over their block tables;
each prefill chunk is done on its own with a causal mask offset by its cached prefix. The loop
is over sequences, never over tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into their cache slots (slot -1 = padding, skipped)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., nblocks] block ids -> [..., nblocks * block_size, H, D] cached rows."""
    rows = cache[block_ids]  # [..., nblocks, block_size, H, D]
    return rows.flatten(-4, -3)


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_size = k_cache.shape[1]
        out = torch.empty_like(q)

        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            nblocks = (max_len + block_size - 1) // block_size
            block_ids = meta.block_tables[:nd, :nblocks].long()
            keys = _gather_context(k_cache, block_ids).float()  # [nd, L, Hkv, D]
            values = _gather_context(v_cache, block_ids).float()
            qd = q[:nd].float().view(nd, num_kv_heads, group, head_dim)
            scores = torch.einsum("bkgd,blkd->bkgl", qd, keys) * scale
            pos = torch.arange(keys.shape[1], device=q.device)
            mask = pos[None, :] < meta.seq_lens[:nd, None].to(pos.dtype)  # [nd, L]
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            od = torch.einsum("bkgl,blkd->bkgd", probs, values)
            out[:nd] = od.reshape(nd, num_heads, head_dim).to(q.dtype)

        start = nd  # decodes occupy the first nd tokens
        for i in range(nd, meta.num_seqs):
            qlen, ctx = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            nblocks = (ctx + block_size - 1) // block_size
            block_ids = meta.block_tables[i, :nblocks].long()
            keys = _gather_context(k_cache, block_ids)[:ctx]  # [ctx, Hkv, D]
            values = _gather_context(v_cache, block_ids)[:ctx]
            qi = q[start : start + qlen]
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [qlen, ctx]
            keys = keys.repeat_interleave(group, dim=1) if group > 1 else keys
            values = values.repeat_interleave(group, dim=1) if group > 1 else values
            oi = F.scaled_dot_product_attention(
                qi.transpose(0, 1).unsqueeze(0),
                keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
                values.to(q.dtype).transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
            )
            out[start : start + qlen] = oi.squeeze(0).transpose(0, 1)
            start += qlen
        return out
