"""Attention backend built on our own Triton kernels (no flash-attn needed).

A step is: store the new K/V rows (one `store_kv` launch, unless the fused q/k norm + rotary
kernel already stored them: `kv_stored`), then attend.
- Decode-only steps (what CUDA graphs capture) take either the single-pass kernel, one program per
  (sequence, kv head), or the split-KV kernels when that grid would leave SMs idle. The choice and
  the number of splits depend only on num_seqs and static shapes, so one captured graph serves
  every context length.
- Mixed steps launch the same paged kernel twice: once over the decodes (which come first in the
  batch) with a 16-row tile, once over the prefill chunks with a large tile. One launch for both
  would give every decode a 128-row tile of which 2 rows are real.
Nothing here reads a device tensor on the host; shapes come from the metadata's host ints.
"""
from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.kernels.paged_attention import (
    TileConfig,
    choose_num_splits,
    decode_tile_config,
    paged_attention,
    paged_attention_split_kv,
    prefill_tile_config,
)
from nanovllm.attention.kernels.store_kv import store_kv

# SM count assumed when no CUDA device can be asked (the Triton interpreter in tests): an H100/H200.
_DEFAULT_NUM_SMS = 132


class TritonAttentionBackend:
    """Paged attention with Triton kernels.

    split_kv: None picks per step (decode-only steps whose grid would not fill the GPU); True or
    False forces it on or off for decode-only steps. num_splits overrides the computed split count.
    decode_config / prefill_config override the tile shapes (tests use tiny tiles on CPU).
    """

    name = "triton"

    def __init__(
        self,
        split_kv: bool | None = None,
        num_splits: int | None = None,
        decode_config: TileConfig | None = None,
        prefill_config: TileConfig | None = None,
    ) -> None:
        self.split_kv = split_kv
        self.num_splits = num_splits
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self._num_sms: dict[int, int] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.attend(q, k_cache, v_cache, meta, scale, out)
        return out

    def num_sms(self, device: torch.device) -> int:
        if device.type != "cuda":
            return _DEFAULT_NUM_SMS
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]

    def decode_num_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """Splits for a decode-only step of num_seqs sequences (1 = single-pass kernel)."""
        if self.split_kv is False:
            return 1
        if self.num_splits is not None:
            return self.num_splits
        splits = choose_num_splits(num_seqs, num_kv_heads, self.num_sms(device))
        if self.split_kv is True:
            return max(2, splits)
        return splits

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [T, H, D], written in place
    ) -> None:
        num_seqs, nd = meta.num_seqs, meta.num_decodes
        group, head_dim = q.shape[1] // k_cache.shape[2], q.shape[2]
        if nd:
            decode_cfg = self.decode_config or decode_tile_config(group, head_dim, q.dtype)
            dec_block_tables = meta.block_tables[:nd]
            dec_seq_lens = meta.seq_lens[:nd]
            dec_qsl = meta.query_start_loc[: nd + 1]
            splits = self.decode_num_splits(nd, k_cache.shape[2], q.device) if nd == num_seqs else 1
            if splits > 1:
                paged_attention_split_kv(
                    q, k_cache, v_cache, out, dec_block_tables, dec_seq_lens, dec_qsl, scale, splits, decode_cfg
                )
            else:
                paged_attention(
                    q, k_cache, v_cache, out, dec_block_tables, dec_seq_lens, dec_qsl, nd, scale, decode_cfg,
                    decode_only=True,
                )
        if nd < num_seqs:
            prefill_cfg = self.prefill_config or prefill_tile_config(group, head_dim, q.dtype)
            paged_attention(
                q,
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                q.shape[0] - nd,
                scale,
                prefill_cfg,
                seq_offset=nd,
                num_seqs=num_seqs - nd,
            )
