"""RMSNorm's torch path (layers/norm.py) against transformers' Llama RMSNorm, bit for bit.

The torch path is what the CPU runs and what the fused kernels are tested against; Hugging Face's
module is the definition it follows (fp32 statistics, the normalised value rounded to the
activation dtype before the weight multiplies it), so the two must agree exactly in every dtype.
"""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.norm import RMSNorm

LlamaRMSNorm = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, tokens):
    hidden, eps = 576, 1e-5
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) * 0.3).to(dtype)
    ours = RMSNorm(hidden, eps).to(dtype)
    theirs = LlamaRMSNorm(hidden, eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, theirs(x + residual))
