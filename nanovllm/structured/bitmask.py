"""The batch's grammar masks on the device: mask rows (`words`) and, for each batch row, the
mask row it samples under (`row_of`, -1 for a row without a grammar).

The fused sampler reads them as they are, in its scan (layers/fused_sampler.py). `apply_` sets
the disallowed logits to -inf for the reference sampler, in one launch: rows of sequences
without a grammar are untouched. xgrammar's `apply_token_bitmask_inplace` picks its kernel by
device: a Triton kernel on CUDA, a C++ loop on the CPU; `backend` forces one (tests run the
Triton kernel on the CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr


@dataclass
class TokenBitmask:
    # int32 [R, ceil(V / 32)] on the logits' device: bit t of a row set = token t allowed.
    words: torch.Tensor
    # int32 [B] on the same device: the row of `words` each batch row samples under, -1 for none.
    row_of: torch.Tensor
    rows: list[int]  # the batch rows that have a grammar
    backend: str = "auto"

    @classmethod
    def from_rows(cls, num_rows: int, masks: list[tuple[int, torch.Tensor]],
                  device: torch.device | str) -> TokenBitmask | None:
        """(batch row, host bitmask [1, W]) for each constrained row of a batch of num_rows ->
        tensors on `device`; None when no row has a grammar. (BitmaskStaging does the same
        through buffers it keeps, for a CUDA device every step.)"""
        if not masks:
            return None
        rows = [r for r, _ in masks]
        row_of = torch.full((num_rows,), -1, dtype=torch.int32)
        row_of[rows] = torch.arange(len(rows), dtype=torch.int32)
        return cls(torch.cat([m for _, m in masks]).to(device), row_of.to(device), rows)

    def per_row(self) -> torch.Tensor:
        """int32 [B, W]: each batch row's mask (a row without a grammar holds some other row's)."""
        return self.words.index_select(0, self.row_of.clamp(min=0))

    def apply_(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place (logits [B, V], fp32)."""
        xgr.apply_token_bitmask_inplace(logits, self.per_row(), vocab_size=logits.shape[-1],
                                        indices=self.rows, backend=self.backend)


class BitmaskStaging:
    """TokenBitmask.from_rows for a CUDA device, without memory allocated each step. The
    engine's masks are the first rows of its one pinned table (engine/grammars.py): those rows
    are copied to the device as they are, and each batch row names its own there. Masks that are not
    rows of one pinned table are gathered into a pinned buffer of this object's instead. Its
    pinned buffers are refilled once the last step's copies have run (an event marks them; in
    the engine they have, since that step's tokens came back first). The device copies land in
    buffers kept from step to step: a step's copies are queued on the stream after the last
    step's sampling, which read them. (Each CUDA call costs the host tens of microseconds.)"""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._masks: torch.Tensor | None = None  # pinned [capacity, W] int32
        self._row_of: torch.Tensor | None = None  # pinned [capacity] int32
        self._copied: torch.cuda.Event | None = None  # recorded after each step's copies
        self._words_dev: torch.Tensor | None = None  # [capacity, W] int32 on the device
        self._row_of_dev: torch.Tensor | None = None  # [capacity] int32 on the device
        self._pinned_table: torch.Tensor | None = None  # the last masks' table, known to be pinned

    def build(self, num_rows: int, masks: list[tuple[int, torch.Tensor]]) -> TokenBitmask | None:
        if not masks:
            return None
        if self._copied is None:
            self._copied = torch.cuda.Event()
        else:  # the last step's copies read the pinned buffers
            self._copied.synchronize()
        in_table = self._rows_of_pinned_table(masks)
        if in_table is not None:
            return self._from_table(num_rows, masks, *in_table)
        k, width = len(masks), masks[0][1].shape[-1]
        if self._masks is None or self._masks.shape[0] < k or self._masks.shape[1] != width:
            capacity = max(k, 64 if self._masks is None else 2 * self._masks.shape[0])
            self._masks = torch.empty((capacity, width), dtype=torch.int32, pin_memory=True)
        return self._from_table(num_rows, masks, self._masks, list(range(k)), fill=True)

    def _from_table(self, num_rows: int, masks: list[tuple[int, torch.Tensor]], table: torch.Tensor,
                    table_rows: list[int], fill: bool = False) -> TokenBitmask:
        """The masks as rows table_rows of `table`, a pinned [R, W] host table (filled here
        from `masks` first where `fill`): the table's rows up to the last one used are copied
        as they are, and each batch row names its own."""
        if self._row_of is None or self._row_of.shape[0] < num_rows:
            self._row_of = torch.empty(max(num_rows, 64), dtype=torch.int32, pin_memory=True)
        if fill:
            torch.cat([m for _, m in masks], out=table[: len(masks)])
        row_of = self._row_of.numpy()  # the pinned buffer itself
        row_of[:num_rows] = -1
        row_of[[r for r, _ in masks]] = table_rows
        used = max(table_rows) + 1
        words = self._device_buffers(used, table.shape[1], num_rows)
        words.copy_(table[:used], non_blocking=True)
        row_of_dev = self._row_of_dev[:num_rows]
        row_of_dev.copy_(self._row_of[:num_rows], non_blocking=True)
        self._copied.record()
        return TokenBitmask(words, row_of_dev, [r for r, _ in masks])

    def _device_buffers(self, rows: int, width: int, num_rows: int) -> torch.Tensor:
        """The kept device buffers, grown to hold `rows` mask rows of `width` words and row_of
        for num_rows batch rows; returns the first `rows` rows of the words buffer."""
        words = self._words_dev
        if words is None or words.shape[0] < rows or words.shape[1] != width:
            capacity = max(rows, 64 if words is None or words.shape[1] != width else 2 * words.shape[0])
            words = self._words_dev = torch.empty((capacity, width), dtype=torch.int32, device=self.device)
        if self._row_of_dev is None or self._row_of_dev.shape[0] < num_rows:
            self._row_of_dev = torch.empty(max(num_rows, 64), dtype=torch.int32, device=self.device)
        return words[:rows]


    def _rows_of_pinned_table(self, masks: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[int]] | None:
        """(table, each mask's row in it) when every mask is a whole row of one pinned 2-D table,
        else None. The table found pinned last is remembered (asking CUDA costs tens of
        microseconds, every step)."""
        table = masks[0][1]._base
        if table is None or table.dim() != 2 or not table.is_contiguous():
            return None
        if table is not self._pinned_table:
            if not table.is_pinned():
                return None
            self._pinned_table = table
        return _rows_in(table, masks)


def _rows_in(table: torch.Tensor, masks: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[int]] | None:
    """(table, each mask's row in it) when every mask is a whole row of the 2-D `table`, else None."""
    width, base = table.shape[1], table.storage_offset()
    rows = []
    for _, m in masks:
        offset = m.storage_offset() - base
        if m._base is not table or m.shape != (1, width) or not m.is_contiguous() or offset % width:
            return None
        rows.append(offset // width)
    return table, rows
