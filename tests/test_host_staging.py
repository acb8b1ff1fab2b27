"""Pinned staging slots (runner/host_staging.py): a slot is written again only after the copy
that read it has run, however far the host is ahead of the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.runner.host_staging import HostStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, events)")]


def test_slots_are_reused_only_after_their_copy_ran():
    device = torch.device("cuda")
    staging = HostStaging(device, slots=2)
    torch.cuda._sleep(200_000_000)  # hold the stream (~0.1 s): every copy below queues behind it
    expected, uploaded = [], []
    for i in range(6):  # three rounds over two slots: rounds 2 and 3 must wait for round 1's copies
        values = np.arange(1000, dtype=np.int64) + 1000 * i
        host = staging.take(values.nbytes)
        host.view(np.int64)[:] = values
        uploaded.append(staging.upload(0, values.nbytes).view(torch.int64))
        expected.append(values)
    torch.cuda.synchronize()
    for got, values in zip(uploaded, expected):
        assert np.array_equal(got.cpu().numpy(), values)


def test_upload_into_a_given_tensor_and_growing_slots():
    device = torch.device("cuda")
    staging = HostStaging(device, slots=1)
    small = staging.take(16)
    small[:] = np.arange(16, dtype=np.uint8)
    out = torch.zeros(24, dtype=torch.uint8, device=device)
    staging.upload(4, 16, out=out[:12])  # bytes 4..15 of the slot into the first 12 of `out`
    big = staging.take(10_000)  # larger than the slot: it grows (after its copy ran)
    big[:] = 7
    grown = staging.upload(0, 10_000)
    torch.cuda.synchronize()
    assert out[:12].tolist() == list(range(4, 16)) and out[12:].tolist() == [0] * 12
    assert grown.cpu().numpy().tolist() == [7] * 10_000
