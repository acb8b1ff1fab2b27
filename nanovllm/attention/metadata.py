"""What one forward's attention needs to know about the step, built by the model runner and
passed down the model explicitly (no module-level mutable state), so that CUDA graphs can
capture it as static buffers. A leaf: the backends, the layers and the runner import it.

Layout (all backends):
- KV cache per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
  Token `t` of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
- The batch is ordered decodes first: the first `num_decodes` sequences have query length 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 means "padding, do not store"
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies (Python ints) so a backend never has to sync to learn shapes.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from this metadata once and every layer reuses (the torch
    # backend's decode plan on the CPU). The metadata describes one step: its tensors are not
    # changed after the first layer has read them.
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class KVCacheWrite(NamedTuple):
    """A step's V rows and where they (and the rotated K rows) go: handed to the fused q/k
    norm + rotary kernel so that it stores K/V in the same launch (layers/fused.py)."""

    v: torch.Tensor  # [num_tokens, num_kv_heads * head_dim] or [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens]; -1 = padding, nothing stored


def split_decodes(meta: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A step that has both decodes and other sequences as two steps: (the first num_decodes
    sequences, one token each; the rest), each with its own metadata over its own tokens."""
    n = meta.num_decodes
    if not 0 < n < meta.num_seqs:
        raise ValueError(f"split_decodes: the step has {n} decodes of {meta.num_seqs} sequences")
    start = meta.query_start_loc
    decodes = AttentionMetadata(
        meta.slot_mapping[:n], start[:n + 1], meta.seq_lens[:n], meta.block_tables[:n], n, 1,
        max(meta.seq_lens_cpu[:n]), meta.query_lens_cpu[:n], meta.seq_lens_cpu[:n])
    rest = AttentionMetadata(
        meta.slot_mapping[n:], start[n:] - n, meta.seq_lens[n:], meta.block_tables[n:], 0,
        max(meta.query_lens_cpu[n:]), max(meta.seq_lens_cpu[n:]), meta.query_lens_cpu[n:], meta.seq_lens_cpu[n:])
    return decodes, rest
