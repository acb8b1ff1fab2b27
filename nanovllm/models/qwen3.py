"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary; biases only if
`attention_bias` is set (it is not, in the released dense models)."""
from __future__ import annotations

from typing import Any

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
