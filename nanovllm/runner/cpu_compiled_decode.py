"""Decode steps on the CPU as compiled code: `LLM(..., cpu_compile=True)`.

Why: decoding on the CPU, a lone sequence above all, is bound by dispatch more than arithmetic:
the eager model makes some fifty operator calls per layer, each a few microseconds of Python
and torch overhead, around four matmuls that take about as long together for one row. torch.compile (Inductor's CPU
code generation) turns a decoder layer into a handful of C++ kernels around the matmuls and the
attention (docs/benchmarks.md has the figures).

How: `_decode_layer` is one decoder layer over plain tensors (the layer's weights, its KV
cache, the step's block ids); it is compiled once and called for every layer (the layers share
shapes and strides, so one compiled variant serves them all). It compiles for one token per
sequence, any context length (the step's block count is a dynamic dimension), and one row or
any number of rows (two variants). The first calls compile:
seconds to a minute on a small machine; Inductor keeps the generated code on disk, so a later
process compiles faster. Inductor rounds as eager torch does (`emulate_precision_casts`).

Where the int4 mode's int8 LM head has no FBGEMM (layers/int8_head.py), a lone row's head runs
compiled too (`_int8_head`).

What it covers: the Llama-family dense decoders (Llama, SmolLM2, Qwen2, Qwen3) with fp32, bf16
or int4 weights, one rank. A step with a prefill runs the eager model, which stays the
reference: tests/test_cpu_compiled_decode.py compares the two. So does a step of
int4_linear.DENSE_MIN_ROWS sequences or more where the int4 weights have dense bf16 copies:
the eager layers multiply those faster than the compiled layer multiplies the codes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.int4_linear import DENSE_MIN_ROWS, Int4Weight
from nanovllm.layers.norm import weighted_rms_norm
from nanovllm.layers.rotary import rotate_halves

# Inductor's options: round every intermediate as eager torch would (bf16 models).
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot decode through the compiled layer, or None."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers):
        return "not a Llama-family decoder"
    for layer in layers:
        if getattr(layer, "mlp_reads_metadata", False) or not hasattr(layer.mlp, "gate_up_proj"):
            return "a mixture-of-experts layer"
    return None


def _weight(linear: nn.Module) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, int]:
    """A projection's weight as `_linear` takes it: a dense tensor, or an int4 weight's
    (packed codes, scales and zeros, group size)."""
    w = linear.weight
    if isinstance(w, Int4Weight):
        return (w.packed, w.scales_and_zeros, w.group_size)
    return w


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, tuple):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], w[2], w[1])
    else:
        y = F.linear(x, w)
    return y if bias is None else y + bias


def _decode_layer(
    hidden: torch.Tensor, residual: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, w: tuple,
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, context: torch.Tensor, eps: float,
    heads: int, kv_heads: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for B sequences decoding one token each (LlamaDecoderLayer's
    arithmetic, the torch attention backend's for decodes): (hidden [B, H], residual [B, H]) ->
    the next layer's pair, and the tokens' K and V rows [B, kv_heads, head_dim], which the
    caller stores (the K and V caches are views of one buffer, and compiled code may not write
    such inputs). Row b attends to its context[b] cached positions (its block_ids[b] blocks,
    padded), then to its own K and V."""
    ln1, ln2, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias, q_norm, k_norm = w
    rows, head_dim = hidden.shape[0], k_cache.shape[-1]
    residual = hidden + residual
    x = weighted_rms_norm(residual, ln1, eps)
    q, k, v = _linear(x, qkv, qkv_bias).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)
    if q_norm is not None:
        q, k = weighted_rms_norm(q, q_norm, eps), weighted_rms_norm(k, k_norm, eps)
    q, k = rotate_halves(q, cos2, sin2), rotate_halves(k, cos2, sin2)
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    positions = block_ids.shape[1] * k_cache.shape[1]

    def context_and_own(cache: torch.Tensor, own: torch.Tensor) -> torch.Tensor:  # [B, kv_heads, positions + 1, D]
        cached = cache.index_select(0, block_ids.reshape(-1)).view(rows, positions, kv_heads, head_dim)
        return torch.cat((cached, own.unsqueeze(1)), dim=1).float().transpose(1, 2)

    real = torch.cat((torch.arange(positions)[None, :] < context[:, None], torch.ones(rows, 1, dtype=torch.bool)), 1)
    mask = torch.zeros(rows, positions + 1).masked_fill(~real, float("-inf")).view(rows, 1, 1, positions + 1)
    attn = F.scaled_dot_product_attention(q.float().unsqueeze(2), context_and_own(k_cache, k),
                                          context_and_own(v_cache, v), attn_mask=mask, scale=scale,
                                          enable_gqa=heads != kv_heads).view(rows, heads * head_dim).to(q.dtype)
    hidden = _linear(attn, o, o_bias)
    residual = hidden + residual
    x = weighted_rms_norm(residual, ln2, eps)
    gate, up = _linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down, down_bias), residual, k, v


def _int8_head(hidden: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ParallelLMHead's int8 product (torch's `_weight_int8pack_mm`: hidden . codes per vocabulary
    row, summed in fp32, times the row's scale, rounded to bf16) as one compiled reduction, which
    streams the codes at the memory's pace: [1, H] -> [1, V] fp32 (one row: a lone sequence)."""
    return ((hidden.float().view(1, 1, -1) * codes.float()).sum(-1) * scales.float()).to(scales.dtype).float()


class CompiledCpuDecode:
    """`decode(input_ids [B], positions [B], meta) -> hidden [B, H]` for a step of B sequences
    decoding one token each, through the compiled layer."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cpu_compile: this model cannot decode compiled ({reason})")
        decoder = model.model
        self.embed_tokens, self.norm = decoder.embed_tokens, decoder.norm
        self.attentions = [layer.self_attn.attn for layer in decoder.layers]
        first = decoder.layers[0].self_attn
        self.rotary_emb = first.rotary_emb
        self.heads, self.kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.attn.scale
        self.eps = decoder.layers[0].input_layernorm.eps
        # Int4 weights with dense bf16 copies: steps of DENSE_MIN_ROWS rows or more run eagerly.
        down = decoder.layers[0].mlp.down_proj.weight
        self.rows_below = DENSE_MIN_ROWS if isinstance(down, Int4Weight) and down.dense is not None else None
        self.weights = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.weights.append((
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                _weight(attn.qkv_proj), attn.qkv_proj.bias, _weight(attn.o_proj), attn.o_proj.bias,
                _weight(mlp.gate_up_proj), mlp.gate_up_proj.bias, _weight(mlp.down_proj), mlp.down_proj.bias,
                attn.q_norm.weight if attn.q_norm is not None else None,
                attn.k_norm.weight if attn.k_norm is not None else None,
            ))
        self.layer = torch.compile(_decode_layer, dynamic=False, options=COMPILE_OPTIONS)
        self.lm_head = model.lm_head
        self.head = torch.compile(_int8_head, dynamic=False, options=COMPILE_OPTIONS)

    def takes(self, num_seqs: int, num_decodes: int, num_tokens: int) -> bool:
        """Whether a step of this shape decodes compiled: every sequence decodes one token, and
        the step is smaller than those the int4 weights' dense bf16 copies serve, where the model
        has them (the eager layers multiply those faster than the compiled layer the codes)."""
        return num_seqs == num_decodes == num_tokens >= 1 and (self.rows_below is None or num_seqs < self.rows_below)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)
        cos2, sin2 = self.rotary_emb.cos_sin(positions, hidden.dtype)
        block_size = self.attentions[0].k_cache.shape[1]
        slot = meta.slot_mapping
        where = (slot // block_size, slot % block_size)  # the tokens' cache slots as (block, offset)
        context = meta.seq_lens - 1  # the positions cached before each token
        blocks = max(1, -(-(max(meta.seq_lens_cpu) - 1) // block_size))
        block_ids = meta.block_tables[:, :blocks].long()
        torch._dynamo.mark_dynamic(block_ids, 1)
        if len(input_ids) > 1:  # one compiled variant for every batch of two rows or more
            for t in (hidden, residual, cos2, sin2, block_ids, context):
                torch._dynamo.mark_dynamic(t, 0)
        for weights, attn in zip(self.weights, self.attentions):
            hidden, residual, k, v = self.layer(hidden, residual, cos2, sin2, weights, attn.k_cache, attn.v_cache,
                                                block_ids, context, self.eps, self.heads, self.kv_heads, self.scale)
            attn.k_cache.index_put_(where, k)
            attn.v_cache.index_put_(where, v)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head for `__call__`'s hidden state: for one row, its int8 codes through the
        compiled reduction where the head's int8 kernel is torch's reference one (FBGEMM's is
        faster still), else the head itself."""
        int8 = self.lm_head.int8
        if int8 is None or int8.serves_any_rows or hidden.shape[0] != 1:
            return self.lm_head(hidden)
        return self.head(hidden, int8.codes, int8.scales_bf16)
