"""Tensor-parallel helpers over torch.distributed.

The process group *is* the state: ranks and world size are read from torch.distributed when it
is initialized, and default to a single rank otherwise, so every layer works unchanged with or
without tensor parallelism (NCCL on CUDA, gloo on CPU).

A collective over gloo (CPU tensors) does not trust gloo to notice a peer that is gone: it waits
in slices of WAIT_SLICE_S and, between them, asks the group's store whether the group was
marked failed (`mark_failed`: rank 0 does so when a rank on another node stops sending its
heartbeat, executor/multiproc.py), and raises GroupFailedError if so. A peer that is killed
usually fails the collective at once (its connection closes), but gloo can miss that, and a
node that becomes unreachable closes nothing.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

WAIT_SLICE_S = 1.0
FAILED_KEY = "nanovllm/group_failed"


class GroupFailedError(RuntimeError):
    """A collective gave up because its process group was marked failed (`mark_failed`)."""


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` across ranks in place (no-op on one rank)."""
    if tp_size() > 1:
        _collective(x, dist.all_reduce, x)
    return x


def _collective(x: torch.Tensor, op, *args) -> None:
    """Run op(*args) on x's ranks: as is on CUDA and while compiling; over gloo, launched and
    waited for in slices (`finish`)."""
    if x.is_cuda or torch.compiler.is_compiling():
        op(*args)
    else:
        finish(op(*args, async_op=True))


def finish(work) -> None:
    """Wait for a gloo collective's `work`, in slices, until it completes (its error, if any, is
    raised) or the group is marked failed (GroupFailedError)."""
    step = timedelta(seconds=WAIT_SLICE_S)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():  # its own error, or it completed as the slice ran out
                work.wait()
                return
        why = group_failure()
        if why is not None:
            raise GroupFailedError(why)


def mark_failed(why: str) -> None:
    """Mark the default process group failed: every rank's waiting gloo collective raises
    GroupFailedError(why) within WAIT_SLICE_S."""
    _get_default_store().set(FAILED_KEY, why.encode())


def group_failure() -> str | None:
    """Why the default process group was marked failed, or None."""
    store = _get_default_store()
    return store.get(FAILED_KEY).decode() if store.check([FAILED_KEY]) else None


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim on every rank (no-op on one rank)."""
    world = tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    _collective(x, dist.all_gather, parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division for sharding, with a clear error when a shape cannot be split."""
    if numerator % denominator:
        raise ValueError(f"cannot split {what}={numerator} evenly across {denominator} tensor-parallel ranks")
    return numerator // denominator
