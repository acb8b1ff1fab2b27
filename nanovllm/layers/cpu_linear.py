"""`linear(x, weight, bias)`: F.linear, except fp32 on an x86 CPU, which goes to oneDNN.

Why: torch's fp32 F.linear on the CPU calls MKL's sgemm, and the MKL that ships with torch
takes a generic code path on AMD processors, where oneDNN's matmul on the same dense weights
is markedly faster at decode shapes, with no copy of the weights. It is the op PyTorch's
own compiler emits for CPU linears (`torch.ops.mkldnn._linear_pointwise`), so it is used only
where this torch has it, and the result is fp32 like F.linear's, summed in another order
(tests/test_cpu_linear.py compares them).
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

from nanovllm.layers.int4_linear import Int4Weight, int4_linear


def _onednn_linear_available() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for x [tokens, in] (F.linear's contract); an Int4Weight (weights of
    `LLM(quantization="int4")`, layers/int4_linear.py) goes to torch's CPU int4 kernel."""
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight, bias)
    if ONEDNN_LINEAR and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] and weight.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
