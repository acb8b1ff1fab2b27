"""The batch's grammar masks applied to the logits on the device, in one launch.

Rows of sequences without a grammar are untouched. xgrammar's `apply_token_bitmask_inplace`
picks its kernel by device: a Triton kernel on CUDA, a C++ loop on the CPU; `backend` forces
one (tests run the Triton kernel on the CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr

from nanovllm.layers.host_copy import to_device


@dataclass
class TokenBitmask:
    # int32 [B, ceil(V / 32)] on the logits' device: bit t of row r set = token t allowed. Rows
    # without a grammar are all ones, and are not visited (`rows`).
    bitmask: torch.Tensor
    rows: list[int]  # the batch rows that have a grammar
    backend: str = "auto"

    @classmethod
    def from_rows(cls, num_rows: int, masks: list[tuple[int, torch.Tensor]],
                  device: torch.device | str) -> TokenBitmask | None:
        """(batch row, host bitmask [1, W]) for each constrained row of a batch of num_rows ->
        one device tensor, in one copy; None when no row has a grammar."""
        if not masks:
            return None
        host = torch.full((num_rows, masks[0][1].shape[-1]), -1, dtype=torch.int32)
        rows = [r for r, _ in masks]
        host[rows] = torch.cat([m for _, m in masks])
        return cls(to_device(host, device), rows)

    def apply_(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place (logits [B, V], fp32)."""
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[-1],
                                        indices=self.rows, backend=self.backend)
