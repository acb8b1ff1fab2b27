"""Zero-filled host tensors whose pages are not touched until used, laid out block by block.

`torch.zeros` on the CPU writes every byte: for the KV pool (1 GiB by default) that is start-up
time and the whole pool resident, although a short request uses a few blocks. numpy's zeros come from
calloc, which maps fresh pages that the kernel zero-fills on first touch, so only the blocks a
request writes ever cost anything.

The tensors (one per layer's K and V) interleave along their first axis, the cache block: block
b of every tensor lies next to block b of the others. A request's blocks therefore sit together
in memory whatever the number of layers, and its first writes touch one stretch of fresh pages
rather than one per tensor: on a virtual machine whose host backs guest memory on first touch
(a few milliseconds per 2 MiB region), that is what a short first request costs there. Each
tensor's rows within a block are contiguous and every block starts 64-byte aligned; the tensors
themselves are not contiguous (a block's stride spans all of them).
"""
from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 64


def lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` and `dtype` in host memory, as views of one buffer,
    interleaved along the first axis."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    blocks, row = shape[0], math.prod(shape[1:])
    row_bytes = -(-row * itemsize // _ALIGN) * _ALIGN
    buffer = torch.from_numpy(np.zeros(blocks * count * row_bytes + _ALIGN, dtype=np.uint8))
    start = -buffer.data_ptr() % _ALIGN
    grid = buffer[start : start + blocks * count * row_bytes].view(blocks, count, row_bytes)
    return [grid[:, i, : row * itemsize].view(dtype).view(shape) for i in range(count)]
