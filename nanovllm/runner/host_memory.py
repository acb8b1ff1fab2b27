"""Zero-filled host tensors whose pages are not touched until used.

`torch.zeros` on the CPU writes every byte: for the KV pool (1 GiB by default) that is start-up
time and the whole pool resident, although a short request uses a few blocks. numpy's zeros come from
calloc, which maps fresh pages that the kernel zero-fills on first touch, so only the blocks a
request writes ever cost anything. The tensors are views of one buffer, each 64-byte aligned.
"""
from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 64


def lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` and `dtype` in host memory, as views of one buffer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-math.prod(shape) * itemsize // _ALIGN) * _ALIGN
    buffer = torch.from_numpy(np.zeros(count * nbytes + _ALIGN, dtype=np.uint8))
    start = -buffer.data_ptr() % _ALIGN
    return [
        buffer[start + i * nbytes : start + i * nbytes + math.prod(shape) * itemsize].view(dtype).view(shape)
        for i in range(count)
    ]
