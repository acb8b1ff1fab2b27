"""The gated SiLU of Llama/Qwen MLPs, applied to the packed gate_up projection output.

With `fused=True`, CUDA tensors take one Triton launch (layers/fused.py) instead of three kernels
and a [T, I] temporary; the torch code stays the reference (CPU, or fused ops turned off).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * d] laid out [gate | up] -> silu(gate) * up, [..., d]."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        # Device types whose tensors take the Triton kernel; tests add "cpu" to run it interpreted.
        self.fused_devices: tuple[str, ...] = ("cuda",) if fused else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type in self.fused_devices:
            from nanovllm.layers.fused import silu_and_mul  # triton is optional; imported only where it runs

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
