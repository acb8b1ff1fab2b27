"""layers/penalty_kernel.py: the one-row penalty and count kernels equal a plain torch reference
(vLLM's definitions, written out here in fp32) bit for bit, and the runner's per-op penalties
(layers/penalties.py) on the same inputs; on the CPU they run under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.penalties import LogitBias, Penalties
from nanovllm.layers.penalty_kernel import count_token, penalize
from nanovllm.sampling_params import SamplingParams

VOCAB = 1500  # two blocks of the penalty kernel, the second one partial
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run where the fast path does


def reference(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """logits [V] fp32 + bias, then repetition over `seen`, then frequency and presence over `counts`."""
    x = logits.clone()
    for t, b in (params.logit_bias or {}).items():
        x[t] = x[t] + b
    r = torch.full_like(x, 1.0)
    r[seen] = params.repetition_penalty
    x = torch.where(x > 0, x / r, x * r)
    c = counts.to(torch.float32)
    return x - (params.frequency_penalty * c + params.presence_penalty * (c > 0).to(torch.float32))


def knobs_of(params: SamplingParams) -> torch.Tensor:
    return torch.tensor([params.presence_penalty, params.frequency_penalty, params.repetition_penalty],
                        dtype=torch.float32)


def dense_bias(params: SamplingParams) -> torch.Tensor:
    bias = torch.zeros(VOCAB, dtype=torch.float32)
    for t, b in (params.logit_bias or {}).items():
        bias[t] = b
    return bias


def statistics(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 4
    logits[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 100.0, -100.0])
    counts = torch.randint(0, 4, (VOCAB,), generator=g, dtype=torch.int32) * (torch.rand(VOCAB, generator=g) < 0.2)
    counts = counts.to(torch.int32)
    seen = (counts > 0) | (torch.rand(VOCAB, generator=g) < 0.1)  # the prompt's tokens too
    return logits, counts, seen


CASES = [
    SamplingParams(temperature=0.6, presence_penalty=0.5),
    SamplingParams(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                   logit_bias={3: 5.0, 1499: -100.0, 700: 0.25}),
    SamplingParams(temperature=0.6, frequency_penalty=-0.7, presence_penalty=-1.1, repetition_penalty=0.83),
    SamplingParams(temperature=0.6, repetition_penalty=1.7),
    SamplingParams(temperature=0.6, logit_bias={0: 1.0, 5: -2.5}),
    SamplingParams(temperature=0.6),  # nothing to apply: the row as it is
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalize_equals_the_reference_and_the_per_op_penalties(case, dtype):
    params = CASES[case]
    logits, counts, seen = statistics(case)
    logits = logits.to(dtype)
    out = torch.full((1, VOCAB), float("nan"), device=DEV)
    penalize(logits.unsqueeze(0).to(DEV), knobs_of(params).to(DEV), dense_bias(params).to(DEV), counts.to(DEV),
             seen.to(DEV), out)
    out = out.cpu()
    want = reference(logits.float(), params, counts, seen)
    assert torch.equal(out[0], want)
    # The runner's per-op path (sampler.py: bias, then penalties) on the same row.
    per_op = logits.float().unsqueeze(0).clone()
    bias = LogitBias.from_params([params], VOCAB, torch.device("cpu"))
    if bias is not None:
        bias.apply_(per_op)
    penalties = Penalties.from_params([params], counts.unsqueeze(0), seen.unsqueeze(0))
    if penalties is not None:
        penalties.apply_(per_op)
    assert torch.equal(out, per_op)


def test_count_token_adds_the_sampled_token():
    counts = torch.zeros(VOCAB, dtype=torch.int32, device=DEV)
    seen = torch.zeros(VOCAB, dtype=torch.bool, device=DEV)
    seen[10] = True  # a prompt token
    for t in (7, 7, VOCAB - 1, 0, 7):
        count_token(torch.tensor([t], device=DEV), counts, seen)
    counts, seen = counts.cpu(), seen.cpu()
    want = torch.zeros(VOCAB, dtype=torch.int32)
    want[7], want[VOCAB - 1], want[0] = 3, 1, 1
    assert torch.equal(counts, want)
    assert seen.nonzero().flatten().tolist() == [0, 7, 10, VOCAB - 1]


def test_penalize_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="penalize"):
        penalize(torch.zeros(1, VOCAB), torch.tensor([0.0, 0.0, 1.0]), torch.zeros(VOCAB),
                 torch.zeros(VOCAB - 1, dtype=torch.int32), torch.zeros(VOCAB, dtype=torch.bool), torch.zeros(1, VOCAB))
