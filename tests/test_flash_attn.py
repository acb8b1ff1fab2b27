"""The optional flash-attn backend: refused clearly without flash-attn, and equal to the torch
reference where flash-attn is installed (it is not on our CPU or GPU machines)."""
import importlib.util

import pytest
import torch

from nanovllm.attention.backend import get_backend

HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@pytest.mark.skipif(HAVE_FLASH_ATTN, reason="flash-attn is installed here")
def test_flash_attn_backend_needs_flash_attn():
    with pytest.raises(ValueError, match="flash-attn"):
        get_backend("flash-attn", torch.device("cpu"))


@pytest.mark.skipif(not (HAVE_FLASH_ATTN and torch.cuda.is_available()), reason="needs flash-attn and a CUDA device")
def test_flash_attn_engine_equals_torch(checkpoint_factory):
    from nanovllm import LLM, SamplingParams

    path = checkpoint_factory("qwen3", head_dim=64)
    sp = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [[5] * 300, [7, 8, 9], list(range(3, 200))]
    outs = {}
    for backend in ("torch", "flash-attn"):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend=backend, kvcache_block_size=256,
                  enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=1024)
        outs[backend] = [o.outputs[0].token_ids[:4] for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["flash-attn"] == outs["torch"]
