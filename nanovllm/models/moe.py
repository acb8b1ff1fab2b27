"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is the Llama decoder (llama.py) whose MLP, in some or all layers, is a sparse MoE block: a
router (`gate`, a [E, H] linear), the experts (layers/moe.py: top-k routing and E gated-SiLU
MLPs packed into [E, ...] parameters) and, in Qwen2-MoE, a shared expert whose output is scaled
by a sigmoid gate and added. They differ in attention (Qwen3: q/k norm; Qwen2: q/k/v biases;
Mixtral: neither), in which layers are sparse (Qwen: every `decoder_sparse_step`-th layer not in
`mlp_only_layers`; Mixtral: all), in whether the top-k weights are renormalised (Qwen:
`norm_topk_prob`; Mixtral: always) and in checkpoint names (Mixtral: `block_sparse_moe`,
experts' `w1` / `w3` / `w2`, except in transformers 5's packed form, which names them as ours).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.linear import RouterLinear
from nanovllm.layers.moe import FusedMoE
from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM, LlamaMLP


# Qwen2-MoE's shared expert as transformers builds and saves it when its width is 0: [0, H] and
# [H, 0] weights and a [1, H] gate, whose product adds exactly 0.
EMPTY_SHARED_EXPERT = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                       "shared_expert.down_proj.weight", "shared_expert_gate.weight")


class SparseMoeBlock(nn.Module):
    """router -> experts, plus `sigmoid(shared_expert_gate(x)) * shared_expert(x)` when
    shared_intermediate_size > 0.

    ignored_checkpoint_tensors: checkpoint tensors (names relative to the block) that the model's
    loader skips, for parts the block does without."""

    def __init__(
        self,
        config: Any,
        fused: bool,
        *,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        ignored_checkpoint_tensors: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.ignored_checkpoint_tensors = ignored_checkpoint_tensors
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}")
        self.gate = RouterLinear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts, top_k, config.hidden_size, intermediate_size, renormalize, fused, checkpoint_names
        )
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, DecoderOptions(), fused, intermediate_size=shared_intermediate_size)
            self.shared_expert_gate = RouterLinear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    wants_step_metadata = True  # the decoder layer passes the step's metadata (padding rows)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        out = self.experts(x, self.gate(x), meta.slot_mapping if meta is not None else None)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE: whether layer `layer_index` has experts (as transformers decides)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)

    def build_mlp(self, config: Any, options: DecoderOptions, layer_index: int, fused: bool) -> nn.Module | None:
        if not is_sparse_layer(config, layer_index):
            return LlamaMLP(config, options, fused)
        return SparseMoeBlock(
            config, fused, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
        )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    def build_mlp(self, config: Any, options: DecoderOptions, layer_index: int, fused: bool) -> nn.Module | None:
        if not is_sparse_layer(config, layer_index):
            return LlamaMLP(config, options, fused)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return SparseMoeBlock(
            config, fused, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
            shared_intermediate_size=shared, ignored_checkpoint_tensors=() if shared else EMPTY_SHARED_EXPERT,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    CHECKPOINT_RENAMES = ((".mlp.", ".block_sparse_moe."),)

    def __init__(self, config: Any) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError(f"MixtralForCausalLM: sliding-window attention is not supported "
                             f"(sliding_window={config.sliding_window})")
        super().__init__(config)

    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions()

    def build_mlp(self, config: Any, options: DecoderOptions, layer_index: int, fused: bool) -> nn.Module | None:
        return SparseMoeBlock(
            config, fused, num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size, renormalize=True, checkpoint_names=("w1", "w3", "w2"),
        )
