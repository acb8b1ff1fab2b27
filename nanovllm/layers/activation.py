"""The gated SiLU of Llama/Qwen MLPs, applied to the packed gate_up projection output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * d] laid out [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
