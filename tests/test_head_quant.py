"""The int8 copy of the LM head (fastpath/head_quant.py): its error bound must hold for every row,
or the persistent kernel's quantized head could miss the exact head's token. The bound is held
against the logits computed in float64 from the 16-bit weights, for random heads, heads with
outlier weights, zero rows, inputs with large and tiny entries, and a final norm whose weights
force the input's scale exponent above 0. The kernel itself (GPU only) is compared with the
16-bit head in test_persistent_decode.py."""
from __future__ import annotations

import pytest
import torch

from nanovllm.fastpath import head_quant


def held(weight: torch.Tensor, x: torch.Tensor, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(|exact - a|, b) per row for the head `weight` and input x."""
    q, meta = head_quant.quantize_head(weight, exponent)
    a, b = head_quant.approximate_logits(q, meta, x, exponent)
    exact = weight.double() @ x.double()
    return (exact - a.double()).abs(), b.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bound_holds_for_random_and_hard_heads(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 3000, 256
    weight = torch.randn(vocab, hidden, generator=gen) * 0.02
    weight[:50, 7] = 0.9  # one outlier column: a coarse scale for these rows
    weight[50:60] = 0.0  # zero rows quantize exactly
    weight[60:70] = torch.randn(10, hidden, generator=gen) * 1e-4
    weight = weight.to(dtype)
    for trial in range(6):
        x = torch.randn(hidden, generator=gen) * (10.0 ** (trial - 2))
        x[3] = 40.0 if trial % 2 else x[3]  # a massive activation
        err, bound = held(weight, x.to(dtype), 0)
        assert (err <= bound).all(), (trial, (err - bound).max().item())
        # Not a vacuous bound: for random rows ~||e_r|| ||x||, about 0.1 of the logits' spread at
        # 256 columns (Cauchy-Schwarz is loose by ~sqrt(H) against the typical error).
        logits = weight.double() @ x.to(dtype).double()
        assert bound[100:].median() < 0.2 * logits.std(), trial


def test_bound_covers_inputs_scaled_below_fp16s_normal_range():
    """A norm weight that forces E > 0 scales the input into fp16 with 2^-E; its tiny entries
    then become fp16 subnormals and lose bits, which the T term of the bound covers."""
    gen = torch.Generator().manual_seed(1)
    hidden = 128
    norm = torch.full((hidden,), 40000.0)
    exponent = head_quant.input_exponent(norm, hidden)
    assert exponent == 4  # sqrt(128) * 40,000 * 1.02 is 14 times 2^15
    x = torch.randn(hidden, generator=gen) * 1e-3
    x[:4] = 400000.0  # a large entry (within the norm's reach) must still fit fp16 after the scale
    x = x.to(torch.bfloat16)
    assert ((x.float() * 2.0**-exponent).half().float().isfinite()).all()
    weight = (torch.randn(500, hidden, generator=gen) * 0.05).to(torch.bfloat16)
    err, bound = held(weight, x, exponent)
    assert (err <= bound).all()
    _, meta = head_quant.quantize_head(weight, exponent)
    assert (meta[:, 2] > 0).all()  # the subnormal term is there


def test_quantized_rows_reconstruct_the_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(100, 128, generator=gen) * 0.1).to(torch.bfloat16)
    weight[5] = 0.0
    q, meta = head_quant.quantize_head(weight, 3)
    scale = meta[:, 0] / 2.0**3
    assert q.dtype == torch.int8 and q.abs().max() == 127 and (q[5] == 0).all()
    recon = q.double() * scale.double()[:, None]
    assert ((recon - weight.double()).abs() <= scale.double()[:, None] / 2 * (1 + 1e-6)).all()
    assert (meta[:, 3] == 0).all()


def test_input_exponent_is_zero_for_ordinary_norms_and_refuses_bad_shapes():
    assert head_quant.input_exponent(torch.ones(1024), 1024) == 0
    assert head_quant.input_exponent(torch.zeros(64), 64) == 0
    with pytest.raises(ValueError, match="vocab, hidden"):
        head_quant.quantize_head(torch.zeros(4, 4, 4), 0)
