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


# The most rows ParallelLMHead multiplies by its int8 codes (read_int8_for_few_rows); more go
# to the fp32 copy, whose kernel is the faster one once the rows share each read of the matrix.
INT8_HEAD_MAX_ROWS = 4


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (the rows given only).

    `compute_in_fp32()` gives it an fp32 copy of its weight, multiplied in fp32 whatever the
    activations' dtype: for a bf16 model on a CPU without native bf16 matmuls (the int4 CPU mode,
    layers/int4_linear.py), where torch's bf16 path for this, the largest matrix, is several times
    slower than the fp32 one at batched rows. The copy is derived from the weight once it is
    loaded, and not persistent: a cache of the model's tensors (loaders/gguf_cache.py) holds the
    16-bit weight only (converting it again costs less than writing and mapping twice the bytes).
    `read_int8_for_few_rows()` adds int8 codes of the weight for steps of a few rows (one
    sequence decoding), which are bound by the bytes of the matrix read once per row."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("fp32_weight", None, persistent=False)
        self.register_buffer("int8_codes", None, persistent=False)
        self.register_buffer("int8_scales", None, persistent=False)

    def compute_in_fp32(self) -> None:
        """Multiply in fp32 from now on, with an fp32 copy of the weight as it is now."""
        self.register_buffer("fp32_weight", self.weight.detach().float(), persistent=False)

    def read_int8_for_few_rows(self) -> None:
        """From now on, multiply INT8_HEAD_MAX_ROWS rows or fewer (the decode steps of one or a
        few sequences, each of which reads the whole matrix) by int8 codes of the weight as it is
        now, one symmetric scale per vocabulary row, in torch's int8 weight kernel with bf16
        activations: a quarter of the fp32 copy's bytes. The logits come out in bf16."""
        weight = self.fp32_weight if self.fp32_weight is not None else self.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny) / 127
        codes = (weight / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        self.register_buffer("int8_codes", codes, persistent=False)
        self.register_buffer("int8_scales", scales.bfloat16(), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.int8_codes is not None and hidden_states.shape[0] <= INT8_HEAD_MAX_ROWS:
            logits = torch.ops.aten._weight_int8pack_mm(hidden_states.bfloat16(), self.int8_codes,
                                                         self.int8_scales).float()
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
