"""The token statistics that penalties need, one row per penalized sequence, on the device.

A penalized sequence (SamplingParams.penalized) owns a row of two pooled tensors: how often
each token was sampled (output counts, int32) and whether it is in the prompt or was sampled
(seen, bool). The row starts from the prompt at the sequence's first sampling step
(ScheduledSeq.penalty_prompt_ids) and each sampled token is added on the device right after
the sampler picks it, so the counts are exact under async scheduling (the host's copy of the
last token may still be a placeholder) without sending a sequence's history every step, and
they survive preemption (the rows are dropped when the sequence finishes).

Why incremental rather than rebuilt per step from the token ids: a rebuild ships and scatters
a sequence's whole output every step (host work that grows with its length), while an update
is one scatter of one token per row; the price is V * 5 bytes of device memory per penalized
sequence.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nanovllm.layers.host_copy import to_device
from nanovllm.step import ScheduledSeq


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.slots: dict[int, int] = {}  # seq_id -> row of counts / seen
        self.free: list[int] = []

    def _new_slot(self, seq_id: int) -> int:
        if not self.free:  # grow by doubling: a rare copy, not one per new sequence
            old = self.counts.shape[0]
            new = max(4, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old] = self.counts
            seen[:old] = self.seen
            self.counts, self.seen = counts, seen
            self.free.extend(range(new - 1, old - 1, -1))
        slot = self.free.pop()
        self.slots[seq_id] = slot
        return slot

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            slot = self.slots.pop(seq_id, None)
            if slot is not None:
                self.free.append(slot)

    def gather(self, rows: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots [P] int64, output counts [P, V], seen [P, V]) of the penalized rows, in order;
        rows at their first sampling step start from their prompt here."""
        slots, starts, start_tokens = [], [], []
        for s in rows:
            if not s.params.penalized:
                continue
            if s.penalty_prompt_ids is not None:
                slot = self.slots.get(s.seq_id)
                slot = self._new_slot(s.seq_id) if slot is None else slot
                starts.append(slot)
                start_tokens.append(s.penalty_prompt_ids)
            elif s.seq_id not in self.slots:
                raise RuntimeError(f"sequence {s.seq_id} samples with penalties but its first sampling step never came")
            slots.append(self.slots[s.seq_id])
        if starts:
            index = to_device(torch.tensor(starts, dtype=torch.int64), self.device)
            self.counts.index_fill_(0, index, 0)
            self.seen.index_fill_(0, index, False)
            lengths = [len(ids) for ids in start_tokens]
            pairs = np.stack([np.repeat(np.asarray(starts, dtype=np.int64), lengths),
                              np.fromiter((t for ids in start_tokens for t in ids), dtype=np.int64, count=sum(lengths))])
            pairs_dev = to_device(torch.from_numpy(pairs), self.device)
            self.seen[pairs_dev[0], pairs_dev[1]] = True
        slot_index = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        # Plain indexing: on the CPU, index_select of long rows is an order of magnitude slower.
        return slot_index, self.counts[slot_index], self.seen[slot_index]

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add each slot's sampled token ([P] int64, on the device): no host sync."""
        self.counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)
        self.seen[slots, token_ids] = True
