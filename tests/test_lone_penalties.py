"""fastpath/penalties.py on the CPU (kernels under TRITON_INTERPRET=1): the lone stream's copy of
its token counts starts from the runner's PenaltyState row, counts what the filtered graphs
sample, and is written back before the runner's batches use the row again, so a sequence that
moves between the fast path and the per-op path keeps exact counts; its edits equal the per-op
sampler's over the same statistics."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the seam over CPU tensors with eager steps; on CUDA, "
                                "test_gpu.py's penalized-stream test runs it through the captured graphs")

from nanovllm.fastpath.penalties import LonePenalties
from nanovllm.layers.penalties import LogitBias, Penalties
from nanovllm.runner.penalty_state import PenaltyState
from nanovllm.sampling_params import SamplingParams
from nanovllm.step import ScheduledSeq

VOCAB = 300
CPU = torch.device("cpu")


def step(seq_id: int, params: SamplingParams, prompt: list[int] | None = None) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [5], 10, [0], True, params, None, None, penalty_prompt_ids=prompt)


def plain_counts(prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(VOCAB, dtype=torch.int32)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    return counts, seen


def row_of(state: PenaltyState, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot = state.slots[seq_id]
    return state.counts[slot], state.seen[slot]


def test_counts_move_between_the_fast_path_and_the_per_op_path_exactly():
    params = SamplingParams(temperature=0.6, top_k=20, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    state = PenaltyState(VOCAB, CPU)
    lone = LonePenalties(VOCAB, CPU)
    prompt = [3, 4, 4, 250]
    # The first sampling step on the per-op path starts the row from the prompt and counts 7.
    slots, _, _ = state.gather([step(1, params, prompt)])
    state.record(slots, torch.tensor([7]))
    output = [7]
    # Lone decode steps on the fast path: the copy starts from the row and counts each token.
    lone.load(step(1, params), state)
    for t in (9, 7, 299):
        lone.load(step(1, params), state)  # the same stream: nothing reloaded
        lone.count(torch.tensor([t]))
        output.append(t)
    assert lone.owner == 1
    want = plain_counts(prompt, output)
    assert torch.equal(lone.counts, want[0]) and torch.equal(lone.seen, want[1])
    # Another step (a batch) uses the row: written back first.
    lone.flush(state)
    assert lone.owner is None
    counts, seen = row_of(state, 1)
    assert torch.equal(counts, want[0]) and torch.equal(seen, want[1])
    slots, _, _ = state.gather([step(1, params)])
    state.record(slots, torch.tensor([9]))
    output.append(9)
    # Back on the fast path: loaded again, with the batch's token.
    lone.load(step(1, params), state)
    want = plain_counts(prompt, output)
    assert torch.equal(lone.counts, want[0]) and torch.equal(lone.seen, want[1])
    # An unpenalized stream's filtered steps count into the copy: the owner's row is safe first.
    lone.load(step(2, SamplingParams(temperature=0.6, top_k=20)), state)
    assert lone.owner is None
    lone.count(torch.tensor([1]))
    counts, seen = row_of(state, 1)
    assert torch.equal(counts, want[0]) and torch.equal(seen, want[1])
    # A finished sequence's row is gone: nothing is written back.
    lone.load(step(1, params), state)
    state.release([1])
    lone.flush(state)
    assert lone.owner is None and not state.slots


def test_a_first_sampling_step_on_the_fast_path_starts_from_the_prompt():
    params = SamplingParams(temperature=0, repetition_penalty=1.3)
    state = PenaltyState(VOCAB, CPU)
    lone = LonePenalties(VOCAB, CPU)
    lone.load(step(4, params, prompt=[1, 2, 2]), state)
    lone.count(torch.tensor([2]))
    want = plain_counts([1, 2, 2], [2])
    assert torch.equal(lone.counts, want[0]) and torch.equal(lone.seen, want[1])
    lone.flush(state)
    counts, seen = row_of(state, 4)
    assert torch.equal(counts, want[0]) and torch.equal(seen, want[1])


def test_edits_equal_the_per_op_sampler_and_the_bias_follows_the_stream():
    params = SamplingParams(temperature=0.6, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={3: 5.0, 17: -100.0})
    state = PenaltyState(VOCAB, CPU)
    lone = LonePenalties(VOCAB, CPU)
    slots, _, _ = state.gather([step(1, params, [3, 8, 9])])
    state.record(slots, torch.tensor([8]))
    lone.load(step(1, params), state)
    for t in (8, 40, 3):
        lone.count(torch.tensor([t]))
    logits = (torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    knobs = torch.tensor([params.presence_penalty, params.frequency_penalty, params.repetition_penalty])
    edited = lone.apply(logits, knobs).clone()
    per_op = logits.float()
    LogitBias.from_params([params], VOCAB, CPU).apply_(per_op)
    Penalties.from_params([params], lone.counts.unsqueeze(0).clone(), lone.seen.unsqueeze(0).clone()).apply_(per_op)
    assert torch.equal(edited, per_op)
    # Another stream without a bias: the bias is cleared, and no knobs leave the logits as they are.
    plain = SamplingParams(temperature=0.6, top_k=20)
    lone.load(step(2, plain), state)
    assert lone.bias_of is None and not lone.bias.any()
    assert torch.equal(lone.apply(logits, torch.tensor([0.0, 0.0, 1.0])), logits.float())
