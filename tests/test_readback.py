"""Sampled ids come back through pinned slots reused round-robin (step_result.ReadbackSlots):
each step's ids are its own while they are read in time, and a read after the slot was taken
again raises instead of returning another step's ids."""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.sampler import SamplerOutput
from nanovllm.step_result import PendingOutput, ReadbackSlots

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, events)")]


def launched(readback: ReadbackSlots, step: int, rows: int) -> PendingOutput:
    ids = torch.arange(rows, device="cuda") + 1000 * step
    return PendingOutput(list(range(rows)), SamplerOutput(ids, None, None, None), readback)


def test_each_step_reads_its_own_ids_and_a_stale_read_raises():
    readback = ReadbackSlots(slots=2)
    torch.cuda._sleep(100_000_000)  # the copies queue behind this: none has run when the next is taken
    with torch.inference_mode():  # the runner launches in inference mode; the deferred sampling's result is built outside
        first = launched(readback, 0, 8)
    second = launched(readback, 1, 3)
    assert first.result().token_ids == [1000 * 0 + i for i in range(8)]
    third = launched(readback, 2, 16)  # first's slot again, grown
    assert second.result().token_ids == [1000 + i for i in range(3)]
    assert third.result().token_ids == [2000 + i for i in range(16)]
    fourth = launched(readback, 3, 4)  # second's slot: second is read already
    fifth = launched(readback, 4, 4)  # third's slot, before third is read again
    assert fourth.result().token_ids == [3000 + i for i in range(4)]
    with pytest.raises(RuntimeError, match="reused"):
        third.result()
    assert fifth.result().token_ids == [4000 + i for i in range(4)]
