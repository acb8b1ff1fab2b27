"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (none on o_proj or the MLP)."""
from __future__ import annotations

from typing import Any

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
