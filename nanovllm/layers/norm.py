"""RMSNorm with an optional fused residual add.

Numerics follow Hugging Face's Llama/Qwen RMSNorm exactly: the residual sum is formed in the
activation dtype (as HF's `residual + hidden_states`), normalised in fp32, cast back to the
activation dtype, and only then multiplied by the weight. Passing `residual` returns the new
residual stream too, so a decoder layer carries one (hidden, residual) pair instead of doing the
add itself.

With `fused=True`, tensors on a device type listed in `fused_devices` (CUDA) take one Triton
launch (layers/fused.py) instead of ~7 elementwise kernels; that path writes the new residual into
`residual` in place, so callers always use the returned pair. The torch code here stays the
reference the kernels are tested against, and runs on CPU or when fused ops are turned off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x), as RMSNorm computes it on the CPU. torch's rms_norm there runs these
    very operations (to fp32, pow, mean, add, rsqrt, mul, back to x's dtype) in one call instead
    of one Python dispatch each: bit for bit the same, and a decoded token on the CPU dispatches
    60 of them."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # Device types whose tensors take the Triton kernel; tests add "cpu" to run it interpreted.
        self.fused_devices: tuple[str, ...] = ("cuda",) if fused else ()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:
            return weighted_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.device.type in self.fused_devices:
            from nanovllm.layers import fused  # triton is optional; imported only where it runs

            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
