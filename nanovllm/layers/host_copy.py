"""Small host-to-device copies that do not make the host wait for the device.

A copy from pageable host memory returns only once it is done, and it is queued behind every
kernel already launched: between two steps that is a wait for the whole step in flight. Through
pinned memory and non_blocking, the copy is queued like a kernel and the host goes on (torch's
pinned-memory cache keeps the buffer until the copy has run).
"""
from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a small CPU tensor) on `device`, queued without a host wait on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
