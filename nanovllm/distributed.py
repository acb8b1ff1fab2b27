"""Tensor-parallel helpers over torch.distributed.

The process group *is* the state: ranks and world size are read from torch.distributed when it
is initialized, and default to a single rank otherwise, so every layer works unchanged with or
without tensor parallelism (NCCL on CUDA, gloo on CPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` across ranks in place (no-op on one rank)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim on every rank (no-op on one rank)."""
    world = tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division for sharding, with a clear error when a shape cannot be split."""
    if numerator % denominator:
        raise ValueError(f"cannot split {what}={numerator} evenly across {denominator} tensor-parallel ranks")
    return numerator // denominator
