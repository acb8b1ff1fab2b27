"""The Llama decoder, written once for every family we serve.

Llama, SmolLM2, Llama 3.x, Qwen2 and Qwen3 are the same pre-norm decoder (RMSNorm, rotary
attention with grouped KV heads, gated SiLU MLP) that differ only in which projections carry a
bias and whether q/k get a per-head RMSNorm before rotary. Those differences are one small
`DecoderOptions` value chosen by the `options()` classmethod; qwen2.py and qwen3.py override
just that.

Contract (docs/architecture.md): `model(input_ids [T], positions [T], meta) -> hidden [T, H]`,
`compute_logits(hidden [N, H]) -> [N, vocab]`, and `load_weights` takes Hugging Face tensor names,
packing q/k/v into `qkv_proj` and gate/up into `gate_up_proj`. Tensor-parallel sharding happens
inside the layers; this file only wires them together.

Fused ops: on CUDA the small ops (RMSNorm with the residual add, q/k norm plus rotary, SiLU-and-mul)
run as single Triton launches (layers/fused.py); a decode step is otherwise ~1,500 tiny kernels.
The attention block applies q/k norm plus rotary before the attention layer; where that runs as
the fused launch, it also stores the step's K/V in the paged cache (`Attention.cache_write`).
`NANOVLLM_FUSED_OPS=0` keeps the torch reference path for debugging. It is read once, when the
model is built, and stored on the modules (`fused_devices`), never consulted per step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanovllm.attention.backend import Attention
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fusion import fused_ops_from_env
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, default_weight_loader
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding, apply_qk_norm_rope, build_rotary

# HF module name -> (our packed module name, shard id).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Buffers some checkpoints carry that we recompute instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# How many names of each kind a load error lists before it gives their count.
SHOWN_NAMES = 5


def first_few(names: Iterable[str]) -> str:
    """The first SHOWN_NAMES of `names` (sorted), and how many there are when that is not all."""
    names = sorted(names)
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown if len(names) <= SHOWN_NAMES else f"{shown}, ... ({len(names)} in all)"


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding, fused: bool) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, bias=options.qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=options.o_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, fused)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, fused)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # one module shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_write = self.attn.cache_write(v, meta) if self.rotary_emb.is_fused_for(positions) else None
        q, k = apply_qk_norm_rope(self.rotary_emb, positions, q, k, self.q_norm, self.k_norm, kv_write)
        out = self.attn(q, k, v, meta, kv_stored=kv_write is not None)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, fused: bool, intermediate_size: int | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=options.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=options.mlp_bias)
        self.act_fn = SiluAndMul(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention then an MLP: the dense LlamaMLP, or the `mlp` given (a mixture of experts)."""

    def __init__(
        self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding, fused: bool, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, options, rotary_emb, fused)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, options, fused)
        self.mlp_reads_metadata = bool(getattr(self.mlp, "wants_step_metadata", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if self.mlp_reads_metadata:
            return self.mlp(hidden_states, meta), residual
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """build_mlp(layer_index, fused) -> the layer's MLP module, or None for the dense LlamaMLP."""

    def __init__(
        self, config: Any, options: DecoderOptions, build_mlp: Callable[[int, bool], nn.Module | None] | None = None
    ) -> None:
        super().__init__()
        self.fused_ops = fused_ops_from_env()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = build_rotary(config, head_dim_of(config), self.fused_ops)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, options, rotary_emb, self.fused_ops, build_mlp(i, self.fused_ops) if build_mlp else None
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.fused_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        """Llama: `attention_bias` covers q/k/v and o; `mlp_bias` covers gate/up/down."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{type(self).__name__}: sliding-window attention is not supported")
        self.config = config
        options = self.options(config)
        self.model = LlamaModel(config, options, lambda i, fused: self.build_mlp(config, options, i, fused))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def build_mlp(self, config: Any, options: DecoderOptions, layer_index: int, fused: bool) -> nn.Module | None:
        """Layer `layer_index`'s MLP; None: the dense LlamaMLP (mixture-of-experts models override this)."""
        return None

    # (our name fragment, checkpoint name fragment) pairs where a family's checkpoints name a
    # module otherwise (Mixtral's MoE block is `block_sparse_moe`, ours `mlp`). Our names, which
    # transformers 5 saves with packed experts, are accepted as well.
    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def _checkpoint_name(self, name: str) -> str:
        for ours, theirs in self.CHECKPOINT_RENAMES:
            name = name.replace(ours, theirs)
        return name

    def _expected_weights(self) -> tuple[dict[str, tuple[str, object]], dict[str, tuple[str, object, list[str]]]]:
        """(every HF tensor name this model needs -> (our parameter name, shard id), names a
        checkpoint may hold instead -> (our parameter name, shard id, the needed names it stands
        for)). The alternatives are transformers' own names, which it can also save: experts
        packed into one tensor per projection, and ours where CHECKPOINT_RENAMES names a module
        otherwise."""
        unpacked: dict[str, list[tuple[str, object]]] = {}
        for hf_module, (packed, shard_id) in PACKED_MODULES.items():
            unpacked.setdefault(packed, []).append((hf_module, shard_id))
        needed: dict[str, tuple[str, object]] = {}
        alternatives: dict[str, tuple[str, object, list[str]]] = {}
        for name, _ in self.named_parameters():  # a tied lm_head is listed once, as the embedding
            module_path, _, leaf = name.rpartition(".")
            owner = self.get_submodule(module_path) if module_path else self
            if hasattr(owner, "checkpoint_tensors"):  # experts: a tensor per expert, or all in one
                for relative, (param_leaf, shard_id) in owner.checkpoint_tensors().items():
                    if param_leaf == leaf:
                        needed[f"{module_path}.{relative}"] = (name, shard_id)
                for relative, (param_leaf, shard_id, covers) in owner.packed_checkpoint_tensors().items():
                    if param_leaf == leaf:
                        covered = [self._checkpoint_name(f"{module_path}.{c}") for c in covers]
                        alternatives[f"{module_path}.{relative}"] = (name, shard_id, covered)
                continue
            parent, _, module = module_path.rpartition(".")
            for hf_module, shard_id in unpacked.get(module, [(module, None)]):
                hf_name = f"{parent}.{hf_module}.{leaf}" if parent else f"{hf_module}.{leaf}"
                needed[hf_name] = (name, shard_id)
        expected: dict[str, tuple[str, object]] = {}
        for hf_name, target in needed.items():
            theirs = self._checkpoint_name(hf_name)
            expected[theirs] = target
            if theirs != hf_name:
                alternatives[hf_name] = (*target, [theirs])
        return expected, alternatives

    def _ignored_weights(self) -> set[str]:
        """Checkpoint tensors that modules declare they do without (`ignored_checkpoint_tensors`)."""
        return {f"{path}.{name}" for path, module in self.named_modules()
                for name in getattr(module, "ignored_checkpoint_tensors", ())}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raise one ValueError listing the missing, unexpected and
        mis-shaped tensors (the first few of each, and how many)."""
        expected, alternatives = self._expected_weights()
        ignored = self._ignored_weights()
        params = dict(self.named_parameters())
        accounted: set[str] = set()  # expected names loaded, or found with the wrong shape
        unexpected: list[str] = []
        mismatched: dict[str, str] = {}
        for hf_name, tensor in weights:
            if hf_name.endswith(IGNORED_SUFFIXES) or hf_name in ignored:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if hf_name in expected:
                (name, shard_id), covers = expected[hf_name], [hf_name]
            elif hf_name in alternatives:
                name, shard_id, covers = alternatives[hf_name]
            else:
                unexpected.append(hf_name)
                continue
            accounted.update(covers)
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                mismatched[hf_name] = str(exc)
        missing = set(expected) - accounted
        problems = []
        if missing:
            problems.append(f"missing tensors: {first_few(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {first_few(unexpected)}")
        if mismatched:
            shown = sorted(mismatched)[:SHOWN_NAMES]
            problems.append("shape mismatches:" + "".join(f"\n  {k}: {mismatched[k]}" for k in shown)
                            + (f"\n  ... ({len(mismatched)} in all)" if len(mismatched) > SHOWN_NAMES else ""))
        if problems:
            raise ValueError(f"{type(self).__name__}.load_weights: " + "\n".join(problems))
