"""Linear layers that know how to shard themselves for tensor parallelism.

Megatron-style: a column-parallel layer splits its output features across ranks (no
communication), a row-parallel layer splits its input features and sums the partial outputs with
one all-reduce. An MLP is then column (gate_up) -> row (down), and attention is column (qkv) ->
row (o), so each block needs a single all-reduce.

Each layer reads its rank and world size from `nanovllm.distributed` once, at construction time,
and allocates only its own shard. Every parameter carries a `weight_loader(param, loaded_weight,
shard_id=None)` that receives the *full* Hugging Face tensor, checks its shape, and copies this
rank's slice in. Packed layers (q/k/v, gate/up) take a `shard_id` naming which HF tensor is
being loaded, so the model loader never needs to know how a layer is sharded.
"""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import all_reduce, divide, tp_rank, tp_size
from nanovllm.layers import int4_linear
from nanovllm.layers.cpu_linear import linear


def check_shape(what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise a ValueError naming `what` when a checkpoint tensor has the wrong shape."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: checkpoint tensor has shape {list(loaded.shape)}, expected {list(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole (unsharded) tensor into `param`, converting dtype and device."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {list(param.shape)} is not packed; got shard_id={shard_id!r}")
    check_shape("parameter", loaded_weight, tuple(param.shape))
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """`y = x @ W.T + b` with W of this rank's shape [out_local, in_local]."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _describe(self, param: nn.Parameter, shard_id: object = None) -> str:
        role = "bias" if param is self.bias else "weight"
        shard = "" if shard_id is None else f" shard {shard_id!r}"
        return f"{type(self).__name__} {role}{shard}"

    def _reject_shard_id(self, param: nn.Parameter, shard_id: object) -> None:
        if shard_id is not None:
            raise ValueError(f"{self._describe(param)} is not packed; got shard_id={shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        self._reject_shard_id(param, shard_id)
        check_shape(self._describe(param), loaded_weight, tuple(param.shape))
        param.data.copy_(loaded_weight)


class RouterLinear(ReplicatedLinear):
    """A mixture-of-experts router (or a shared expert's gate): replicated, and left in the
    model's dtype by quantization, as vLLM leaves it: routing picks experts by small differences
    between its logits, and its weight is a sliver of the model."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), f"{type(self).__name__} output_size"), bias)
        self.input_size = input_size
        self.output_size = output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        self._reject_shard_id(param, shard_id)
        local = param.shape[0]
        check_shape(self._describe(param), loaded_weight, (local * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * local, local))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed into one matmul (gate and up projections).

    Each rank holds its slice of every part, in order: [part0_local, part1_local, ...], so the
    output splits cleanly into the parts on every rank. `shard_id` is the part index.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        for i, size in enumerate(output_sizes):
            divide(size, tp_size(), f"{type(self).__name__} output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"{self._describe(param)} needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        full = self.output_sizes[shard_id]
        local = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        check_shape(self._describe(param, shard_id), loaded_weight, (full, *param.shape[1:]))
        param.data.narrow(0, offset, local).copy_(loaded_weight.narrow(0, self.tp_rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q/k/v projection, sharded by attention head.

    Each rank gets `num_heads / tp` query heads and `num_kv_heads / tp` key/value heads. When
    there are fewer KV heads than ranks, each KV head is replicated so every rank holds exactly
    one, and query head groups stay with the KV head they attend to. The local output is laid out
    [q_local | k_local | v_local]; `shard_id` is "q", "k" or "v".
    """

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        world = tp_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, world, "num_attention_heads")
        if total_num_kv_heads >= world:
            self.num_kv_heads = divide(total_num_kv_heads, world, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if world % total_num_kv_heads:
                raise ValueError(
                    f"cannot replicate num_key_value_heads={total_num_kv_heads} over {world} tensor-parallel "
                    f"ranks: the rank count must be a multiple of the KV head count"
                )
            self.num_kv_heads = 1
            self.kv_replicas = world // total_num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * world
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            full_heads, offset, size = self.total_num_heads, 0, self.q_size
            start = self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            full_heads, size = self.total_num_kv_heads, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"{self._describe(param)} needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(self._describe(param, shard_id), loaded_weight, (full_heads * self.head_dim, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce.

    The input is expected to be already sharded (the output of a column-parallel layer). The
    bias is kept whole on every rank and added after the reduction, so it is counted once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_size(), f"{type(self).__name__} input_size"), output_size, bias)
        self.input_size = input_size
        self.output_size = output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        self._reject_shard_id(param, shard_id)
        if param is self.bias:
            check_shape(self._describe(param), loaded_weight, tuple(param.shape))
            param.data.copy_(loaded_weight)
            return
        local = param.shape[1]
        check_shape(self._describe(param), loaded_weight, (param.shape[0], local * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        y = all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def quantize_int4(model: nn.Module, group_size: int = int4_linear.GROUP_SIZE, layout_only: bool = False,
                  dense: bool = False) -> tuple[int, int]:
    """Replace the weight of every projection that int4_linear.quantizable allows (routers
    aside: RouterLinear) by its Int4Weight, whose codes and scales become the module's buffers `weight_packed` and
    `weight_scales_and_zeros` (so a cache of the model's tensors holds them); with layout_only,
    empty ones of the right shapes (for a cache to fill). The LM head (and the embedding) stay
    dense: the vocabulary matrix is the one quantizers keep finer (the embedded GGUF file stores
    it as Q8_0 beside Q4_1 projections), and as int4 it flipped the near tie of the README's
    first greedy token. dense: each Int4Weight also keeps the weight its codes stand for in bf16
    (buffer `weight_dense`), which large steps multiply (layers/int4_linear.py). Returns (layers
    quantized, layers kept dense)."""
    done = kept = 0
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        weight = module.weight
        if not isinstance(weight, torch.Tensor):
            continue  # quantized already
        if isinstance(module, RouterLinear) or not int4_linear.quantizable(weight.shape, group_size):
            kept += 1
            continue
        if layout_only:
            int4 = int4_linear.empty_like_quantized(weight.shape, group_size, weight.dtype, dense)
        else:
            int4 = int4_linear.quantize(weight.data, group_size, weight.dtype, dense)
        del module._parameters["weight"]
        module.register_buffer("weight_packed", int4.packed)
        module.register_buffer("weight_scales_and_zeros", int4.scales_and_zeros)
        if int4.dense is not None:
            module.register_buffer("weight_dense", int4.dense)
        module.weight = int4
        done += 1
    return done, kept
