"""Architecture name -> model class, imported lazily so loading one family never imports the others."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# HF `architectures[0]` -> (module, class name).
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("nanovllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("nanovllm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("nanovllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("nanovllm.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanovllm.models.moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("nanovllm.models.moe", "MixtralForCausalLM"),
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for `hf_config.architectures[0]`; ValueError for anything else."""
    architectures = getattr(hf_config, "architectures", None) or []
    supported = ", ".join(MODEL_CLASSES)
    if not architectures:
        raise ValueError(f"the model config names no architecture; supported architectures: {supported}")
    arch = architectures[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {arch!r}; supported architectures: {supported}")
    module_name, class_name = MODEL_CLASSES[arch]
    return getattr(importlib.import_module(module_name), class_name)
