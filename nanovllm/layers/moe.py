"""The experts of a mixture-of-experts MLP: E gated-SiLU MLPs packed into two parameters, the
routing of each token to its top_k, and the weighted sum of their outputs.

Weights: `w13` [E, 2 * I, H] holds every expert's gate rows then up rows, `w2` [E, H, I] their
down projections. Checkpoints store one tensor per expert and projection (Hugging Face names
`experts.{e}.gate_proj.weight`, or Mixtral's `w1` / `w3` / `w2`), or, as transformers 5 holds
them and can save them, every expert's in two tensors laid out as ours (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]). Each is copied into its slice of the packed parameter
as it is read (`weight_loader`), so loading never holds a second copy of the experts.

Tensor parallelism: like a dense MLP, each expert's intermediate dimension is split across ranks
(gate/up column-parallel, down row-parallel) and the layer's output is summed with one
all-reduce. Every rank holds every expert (no expert parallelism).

Two paths behind one forward: on CUDA the Triton kernels of layers/fused_moe.py (routing,
grouping by expert and the grouped GEMMs, no host sync, CUDA-graph capturable); elsewhere, or
with fused ops off, `moe_reference`, which computes what Hugging Face's MoE blocks compute, expert
by expert. Tests add "cpu" to `fused_devices` to run the kernels under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, divide, tp_rank, tp_size
from nanovllm.layers.linear import check_shape

PARTS = ("gate", "up", "down")
# transformers' packed tensors of every expert -> (our parameter, shard id).
ALL_EXPERTS = {"gate_up_proj": ("w13", "gate_up"), "down_proj": ("w2", "down")}


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k]): softmax in fp32, top_k, optionally
    renormalised, as Hugging Face's routers."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    host_sync: bool | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), expert by expert in ascending order, as
    transformers adds them. host_sync (default: on the CPU): only the experts chosen run, their
    ids read on the host; otherwise every expert runs on every token with weight 0 where not
    chosen, which adds exact zeros and never syncs the host (CUDA graphs capture it)."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    if not (x.device.type == "cpu" if host_sync is None else host_sync):
        for expert in range(w13.shape[0]):
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
            routed = (weights * (ids == expert)).sum(dim=-1, keepdim=True)
            out += F.linear(F.silu(gate) * up, w2[expert]) * routed
        return out
    for expert in ids.unique().tolist():
        token, choice = torch.where(ids == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, choice, None]
        out.index_add_(0, token, y)
    return out


def moe_reference(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    weights, ids = route_reference(router_logits, top_k, renormalize)
    return experts_reference(x, w13, w2, weights, ids)


def kernel_config_from_env() -> Callable[[int], object] | None:
    """The fused kernels' block sizes from the JSON file NANOVLLM_MOE_CONFIG names (what
    `benchmarks/moe_bench.py --sweep` writes): {"<tokens>": {"block_m": .., "block_n": ..,
    "block_k": .., "num_warps": .., "num_stages": .., "tma": ..}, ...}; a step of T tokens takes the entry of
    the smallest key >= T, else the largest. None (the kernels' own choice) when unset. Read when
    the model is built."""
    path = os.environ.get("NANOVLLM_MOE_CONFIG")
    if not path:
        return None
    from nanovllm.layers.fused_moe import MoEKernelConfig

    with open(path) as f:
        table = {int(tokens): MoEKernelConfig(**config) for tokens, config in json.load(f).items()}
    if not table:
        raise ValueError(f"NANOVLLM_MOE_CONFIG={path!r} lists no configurations")
    keys = sorted(table)

    def pick(num_tokens: int) -> object:
        return table[next((k for k in keys if k >= num_tokens), keys[-1])]

    return pick


class FusedMoE(nn.Module):
    """`moe(x [T, H], router_logits [T, E]) -> [T, H]`, summed over tensor-parallel ranks.

    checkpoint_names: the checkpoint's names of the gate, up and down projections of one expert
    (`experts.{e}.{name}.weight`). kernel_config: None for the kernels' own block sizes by
    token count, or a function of the token count giving a `MoEKernelConfig` (benchmarks).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        fused: bool = False,
        checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.intermediate_size = intermediate_size
        inter = divide(intermediate_size, self.tp_size, "moe intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader
        self.checkpoint_names = dict(zip(PARTS, checkpoint_names))
        self.fused_devices: tuple[str, ...] = ("cuda",) if fused else ()
        self.kernel_config: Callable[[int], object] | None = kernel_config_from_env() if fused else None

    def checkpoint_tensors(self) -> dict[str, tuple[str, tuple[int, str]]]:
        """Checkpoint tensor name (relative to this module) -> (our parameter, shard id), one per
        expert and projection."""
        names = {}
        for expert in range(self.num_experts):
            for part, hf_name in self.checkpoint_names.items():
                names[f"{expert}.{hf_name}.weight"] = ("w2" if part == "down" else "w13", (expert, part))
        return names

    def packed_checkpoint_tensors(self) -> dict[str, tuple[str, str, list[str]]]:
        """The alternative: transformers' tensors of every expert (relative name) -> (our
        parameter, shard id, the `checkpoint_tensors` names it stands for)."""
        per_expert = self.checkpoint_tensors()
        return {
            name: (param, shard_id, [n for n, (p, _) in per_expert.items() if p == param])
            for name, (param, shard_id) in ALL_EXPERTS.items()
        }

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy one checkpoint tensor (full, unsharded) into its slice of `param`: one expert's
        gate, up or down weight (shard_id (expert, part)), or every expert's ("gate_up": [E, 2I, H],
        gate rows then up rows; "down": [E, H, I])."""
        if shard_id in ("gate_up", "down"):
            self._load_all_experts(param, loaded_weight, shard_id)
            return
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in PARTS
                and isinstance(shard_id[0], int) and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"FusedMoE weight needs shard_id (expert in 0..{self.num_experts - 1}, part in {PARTS}), "
                             f"got {shard_id!r}")
        expert, part = shard_id
        what = f"FusedMoE expert {expert} {part}"
        if part == "down":
            hidden, local = param.shape[1:]
            check_shape(what, loaded_weight, (hidden, local * self.tp_size))
            param.data[expert].copy_(loaded_weight.narrow(1, self.tp_rank * local, local))
            return
        local, hidden = param.shape[1] // 2, param.shape[2]
        check_shape(what, loaded_weight, (local * self.tp_size, hidden))
        offset = 0 if part == "gate" else local
        param.data[expert].narrow(0, offset, local).copy_(loaded_weight.narrow(0, self.tp_rank * local, local))

    def _load_all_experts(self, param: nn.Parameter, loaded_weight: torch.Tensor, part: str) -> None:
        local, hidden = self.w2.shape[2], self.w2.shape[1]
        full, start = local * self.tp_size, self.tp_rank * local
        if part == "down":
            check_shape("FusedMoE experts down_proj", loaded_weight, (self.num_experts, hidden, full))
            param.data.copy_(loaded_weight.narrow(2, start, local))
            return
        check_shape("FusedMoE experts gate_up_proj", loaded_weight, (self.num_experts, 2 * full, hidden))
        for half in range(2):  # gate rows, then up rows: this rank's slice of each
            param.data.narrow(1, half * local, local).copy_(loaded_weight.narrow(1, half * full + start, local))

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, slot_mapping: torch.Tensor | None = None
    ) -> torch.Tensor:
        """slot_mapping: the step's KV slots; rows with a negative slot are padding (CUDA-graph
        batches), which the fused path leaves out (zeros) and the reference computes anyway."""
        if x.device.type in self.fused_devices:
            from nanovllm.layers.fused_moe import fused_moe  # triton is optional; imported only where it runs

            config = self.kernel_config(x.shape[0]) if self.kernel_config is not None else None
            out = fused_moe(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize, config, slot_mapping)
        else:
            out = moe_reference(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)
        return all_reduce(out)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.w13.shape[2]}, "
                f"intermediate={self.w2.shape[2]} (of {self.intermediate_size}), renormalize={self.renormalize}, "
                f"tp={self.tp_size}")
