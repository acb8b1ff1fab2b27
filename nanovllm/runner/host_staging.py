"""Pinned host buffers that carry each step's arrays to the GPU, reused round-robin.

Why: a non-blocking host-to-device copy needs pinned (page-locked) host memory. Pinning a fresh
array every step (`Tensor.pin_memory()`) costs a pointer-attribute query and an allocation per
copy, a large share of a lone sequence's host time per step. Here each slot is pinned once and
grows when a step needs more.

A slot is reused only after the copy that read it has run: each copy records an event, and
taking the slot again waits for it (already passed in steady state: the slots outnumber the
steps in flight, one with async scheduling).
"""
from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    """`take(nbytes)` -> a pinned slot's bytes as numpy (fill them), then `upload` copies them."""

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._next = 0
        self._current = 0

    def take(self, nbytes: int) -> np.ndarray:
        """The next slot's first nbytes (uint8), free to write: its last copy has run."""
        i = self._current = self._next
        self._next = (i + 1) % len(self._buffers)
        self._events[i].synchronize()  # returns at once for an event never recorded
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.numel()), 4096)
            buf = self._buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf.numpy()[:nbytes]

    def upload(self, start: int, end: int, out: torch.Tensor | None = None,
               stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Copy bytes [start, end) of the slot last taken to the device (into `out`, uint8 of that
        length, or a new tensor) on `stream` (None: the current one) without blocking the host;
        returns the device bytes."""
        src = self._buffers[self._current][start:end]
        if out is None:
            out = torch.empty(end - start, dtype=torch.uint8, device=self.device)
        if stream is None:  # the copy runs on the device's current stream as it is
            out.copy_(src, non_blocking=True)
            self._events[self._current].record(torch.cuda.current_stream(self.device))
            return out
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)
            self._events[self._current].record(stream)
        return out
