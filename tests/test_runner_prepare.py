"""The runner's step inputs for a step of one token of one sequence (ModelRunner._prepare_lone,
every decode step of a lone stream) against the batch derivation of any step
(ModelRunner._prepare_batch), its reference."""
from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.step import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput

BLOCKS = [7, 3, 11, 2]  # 16 positions each


@pytest.fixture(scope="module", params=[
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def runner(qwen3_tiny, request):
    llm = LLM(qwen3_tiny, device=request.param, num_kvcache_blocks=16, enforce_eager=True)
    yield llm.engine.executor.runner
    llm.shutdown()


def _on_host(prepared: tuple) -> tuple:
    ids, pos, meta, idx, pend, src = prepared
    host = lambda t: None if t is None else t.cpu()  # noqa: E731
    meta = dataclasses.replace(meta, **{f: host(getattr(meta, f)) for f in
                                        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    return host(ids), host(pos), meta, idx, host(pend), host(src)


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert a is not None and b is not None, (a, b)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    else:
        assert a == b


@pytest.mark.parametrize("position", [0, 5, 15, 16, 40, 63])
@pytest.mark.parametrize("pending, sample, num_decodes", [
    pytest.param(True, True, 1, id="decode-of-the-token-in-flight"),
    pytest.param(False, True, 1, id="decode"),
    pytest.param(False, False, 0, id="prompt-chunk-of-one-token"),
    pytest.param(False, True, 0, id="one-token-prompt"),
])
def test_lone_token_inputs_equal_the_batch_derivation(runner, position, pending, sample, num_decodes):
    token = PLACEHOLDER_TOKEN if pending else 123
    item = ScheduledSeq(4, [token], position, BLOCKS, sample, SamplingParams(), None, None)
    out = SchedulerOutput([item], num_decodes, 1)
    runner.prev_rows = {4: 0}
    # Copied to the host at once: on CUDA the next prepare's upload reuses the staging buffers.
    lone = _on_host(runner._prepare_lone(item, num_decodes))
    batch = _on_host(runner._prepare_batch(out))
    (ids_l, pos_l, meta_l, idx_l, pend_l, src_l), (ids_b, pos_b, meta_b, idx_b, pend_b, src_b) = lone, batch
    assert (pend_l is None) == (pend_b is None) == (not pending)
    if pending:
        _same(pend_l, pend_b)
        _same(src_l, src_b)
        mask = torch.ones_like(ids_l, dtype=torch.bool)
        mask[pend_l] = False  # the placeholder's value is gathered over later
        _same(ids_l[mask], ids_b[mask])
    else:
        _same(ids_l, ids_b)
    _same(pos_l, pos_b)
    _same(idx_l, idx_b)
    for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "num_decodes", "max_query_len",
                  "max_seq_len", "query_lens_cpu", "seq_lens_cpu"):
        _same(getattr(meta_l, field), getattr(meta_b, field))
