"""The batch's grammar masks applied to the logits on the device, in one launch.

Rows of sequences without a grammar are untouched. xgrammar's `apply_token_bitmask_inplace`
picks its kernel by device: a Triton kernel on CUDA, a C++ loop on the CPU; `backend` forces
one (tests run the Triton kernel on the CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr


@dataclass
class TokenBitmask:
    # int32 [B, ceil(V / 32)] on the logits' device: bit t of row r set = token t allowed. Rows
    # without a grammar are not visited (only `rows` are), whatever they hold.
    bitmask: torch.Tensor
    rows: list[int]  # the batch rows that have a grammar
    backend: str = "auto"

    @classmethod
    def from_rows(cls, num_rows: int, masks: list[tuple[int, torch.Tensor]],
                  device: torch.device | str) -> TokenBitmask | None:
        """(batch row, host bitmask [1, W]) for each constrained row of a batch of num_rows ->
        one tensor on `device`; None when no row has a grammar. (BitmaskStaging does the same
        through buffers it keeps, for a CUDA device every step.)"""
        if not masks:
            return None
        host = torch.full((num_rows, masks[0][1].shape[-1]), -1, dtype=torch.int32)
        rows = [r for r, _ in masks]
        host[rows] = torch.cat([m for _, m in masks])
        return cls(host.to(device), rows)

    def apply_(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place (logits [B, V], fp32)."""
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[-1],
                                        indices=self.rows, backend=self.backend)


class BitmaskStaging:
    """TokenBitmask.from_rows for a CUDA device, without a host wait or host memory allocated
    each step. The engine's masks are rows of its one pinned table (engine/grammars.py): the
    table is copied to the device as it is, and each batch row takes its sequence's row there
    (one gather; rows without a grammar take any row, since only `rows` are applied). Masks
    that are not rows of one pinned table are gathered into a pinned buffer of this object's
    instead, reused once the last step's copy has run (an event marks it)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._masks: torch.Tensor | None = None  # pinned [capacity, W] int32
        self._rows: torch.Tensor | None = None  # pinned [capacity] int64
        self._copied: torch.cuda.Event | None = None

    def build(self, num_rows: int, masks: list[tuple[int, torch.Tensor]]) -> TokenBitmask | None:
        if not masks:
            return None
        in_table = _rows_of_pinned_table(masks)
        if in_table is not None:
            return self._from_table(num_rows, masks, *in_table)
        k, width = len(masks), masks[0][1].shape[-1]
        if self._copied is not None:
            self._copied.synchronize()
        if self._masks is None or self._masks.shape[0] < k or self._masks.shape[1] != width:
            capacity = max(k, 64 if self._masks is None else 2 * self._masks.shape[0])
            self._masks = torch.empty((capacity, width), dtype=torch.int32, pin_memory=True)
            self._rows = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        rows = [r for r, _ in masks]
        torch.cat([m for _, m in masks], out=self._masks[:k])
        self._rows[:k] = torch.tensor(rows, dtype=torch.int64)
        staged = self._masks[:k].to(self.device, non_blocking=True)
        index = self._rows[:k].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        bitmask = torch.full((num_rows, width), -1, dtype=torch.int32, device=self.device)
        bitmask.index_copy_(0, index, staged)
        return TokenBitmask(bitmask, rows)

    def _from_table(self, num_rows: int, masks: list[tuple[int, torch.Tensor]], table: torch.Tensor,
                    table_rows: list[int]) -> TokenBitmask:
        gather = [0] * num_rows
        for (r, _), t in zip(masks, table_rows):
            gather[r] = t
        on_device = table[: max(gather) + 1].to(self.device, non_blocking=True)
        index = torch.tensor(gather, dtype=torch.int64).to(self.device, non_blocking=True)
        return TokenBitmask(on_device.index_select(0, index), [r for r, _ in masks])


def _rows_of_pinned_table(masks: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[int]] | None:
    """(table, each mask's row in it) when every mask is a whole row of one pinned 2-D table,
    else None."""
    table = masks[0][1]._base
    if table is None or table.dim() != 2 or not table.is_contiguous() or not table.is_pinned():
        return None
    width, base = table.shape[1], table.storage_offset()
    rows = []
    for _, m in masks:
        offset = m.storage_offset() - base
        if m._base is not table or m.shape != (1, width) or not m.is_contiguous() or offset % width:
            return None
        rows.append(offset // width)
    return table, rows
