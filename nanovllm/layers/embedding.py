"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is the largest matrix in a small model, so each rank keeps a contiguous slice of
ceil(vocab / tp) rows (the last slice zero-padded when the vocabulary does not divide evenly).
The embedding looks up only the ids its slice owns, zeroes the rest and all-reduces, so every
rank ends with the full embedding. The LM head multiplies by its slice and all-gathers the
logits along the vocabulary; the padding columns are cut off. Both share one weight layout, so
tied embeddings are just one Parameter used by both modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, gather_last_dim, tp_rank, tp_size
from nanovllm.layers.cpu_linear import linear
from nanovllm.layers.int8_head import Int8HeadMatmul
from nanovllm.layers.linear import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} weight is not packed; got shard_id={shard_id!r}")
        check_shape(f"{type(self).__name__} weight", loaded_weight, (self.num_embeddings, self.embedding_dim))
        owned = self.vocab_end - self.vocab_start
        param.data[:owned].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[owned:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(~owned, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~owned.unsqueeze(-1), 0)
        return all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


# The most rows ParallelLMHead multiplies by its int8 codes where the int8 kernel is torch's
# reference one (layers/int8_head.py); more go to the fp32 copy, whose kernel is the faster one
# once the rows share each read of the matrix.
INT8_HEAD_MAX_ROWS = 4
# Vocabulary rows quantized at a time (their fp32 form fits a core's cache).
QUANTIZE_CHUNK_ROWS = 4096


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (the rows given only).

    `quantize_int8()` (the int4 CPU mode, layers/int4_linear.py) multiplies by int8 codes of the
    weight, one symmetric scale per vocabulary row (layers/int8_head.py): every step where
    FBGEMM's dynamic int8 kernel is there (x86), else steps of INT8_HEAD_MAX_ROWS rows or fewer
    (one or a few sequences decoding, bound by the bytes of the matrix read once per row), with an
    fp32 copy of the weight for the others: torch's bf16 path for this, the largest matrix, is
    several times slower than the fp32 one at batched rows on a CPU without native bf16 matmuls.
    The codes and the copy are derived from the weight once it is loaded, and not persistent: a
    cache of the model's tensors (loaders/gguf_cache.py) holds the 16-bit weight only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("fp32_weight", None, persistent=False)
        self.int8: Int8HeadMatmul | None = None

    def quantize_int8(self) -> None:
        """Multiply by int8 codes of the weight as it is now (and by an fp32 copy of it where
        the int8 kernel serves a few rows only)."""
        weight = self.weight.detach()
        scales = weight.abs().amax(dim=1).float().clamp_(min=torch.finfo(torch.float32).tiny) / 127
        codes = torch.empty(weight.shape, dtype=torch.int8)
        for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS):  # fp32 a chunk at a time
            rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
            codes[rows] = weight[rows].float().div_(scales[rows, None]).round_().clamp_(-127, 127)
        self.int8 = Int8HeadMatmul(codes, scales)
        if not self.int8.serves_any_rows:
            self.register_buffer("fp32_weight", weight.float(), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and (self.int8.serves_any_rows or hidden_states.shape[0] <= INT8_HEAD_MAX_ROWS):
            logits = self.int8(hidden_states)
        elif self.fp32_weight is not None:
            logits = linear(hidden_states.float(), self.fp32_weight)
        else:
            logits = linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return gather_last_dim(logits)[..., : self.num_embeddings]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (same vocabulary split, so the layouts agree)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LM head {list(self.weight.shape)} to embedding {list(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
