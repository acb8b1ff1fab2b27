"""An int8 copy of the LM head that picks the exact head's token (the persistent decode kernel's
quantized head, head.py).

Why: at one sequence the LM head is the largest single read of a decode step (Qwen3-0.6B: 311
MB of bf16, about an eighth of the step's reads). A greedy or plain-temperature pick does not need
every logit, only the best row. So the kernel streams an int8 copy of the weight (half the
bytes), computes every row's logit approximately with a bound on its error, and recomputes
exactly, from the 16-bit weight, only the rows whose upper bound reaches the best lower bound of
their program's rows: a handful. The token is the one the 16-bit head would give (argmax of the
logits rounded to the model's dtype, lowest id on ties; or the same Gumbel-max sample).

The bound, per row r (weights w = bf16 or fp16, x the staged normed hidden state):
    int8 rows q_r = round(w_r / s_r), s_r = max|w_r| / 127, residual e_r = w_r - s_r q_r;
    the kernel takes x' = fp16(x * 2^-E) (exact in fp16's normal range; E >= 0 keeps |x| 2^-E
    below 2^15, from the final norm's weight: |x_j| <= sqrt(H) max|gamma|), and
    a_r = s_r 2^E * sum_j q_rj x'_j (fp32 sums on the tensor cores).
    |a_r - w_r . x| <= ||e_r|| ||x||                     (Cauchy-Schwarz)
                     + s_r ||q_r||_1 2^(E-25)           (x' rounded where it is an fp16 subnormal)
                     + fp32 rounding of both sums        (each below H 2^-24 ||w_r|| ||x|| for H terms;
                                                          taken as H 2^-20 ||w_r|| ||x|| in all)
so with meta = (s_r 2^E, B_r = ||e_r|| + H 2^-20 ||w_r||, T_r = s_r ||q_r||_1 2^(E-24)) the kernel
uses b_r = (B_r ||x|| + T_r)(1 + 2^-16) + 2^-20 |a_r|, the last terms covering the fp32 roundings
of a and b themselves. Random bf16 rows of 1,024 give B_r ~ 0.008 ||w_r||: ~0.25 standard
deviations of the logits, a few candidates per 1,151-row program.
"""
from __future__ import annotations

import math

import torch

# Rows quantized at a time (the float64 norms of a whole 151,936 x 1,024 head would take 1.2 GB).
_CHUNK_ROWS = 8192
META_FIELDS = 4  # scale, B, T, and a word the kernel keeps each row's upper bound in


def input_exponent(norm_weight: torch.Tensor, hidden: int) -> int:
    """E >= 0 such that the head's input scaled by 2^-E stays below 2^15 (fp16's largest finite
    value is 65,504): RMSNorm's output is at most sqrt(hidden) times the largest norm weight
    (each |h_j| / rms(h) <= sqrt(hidden)), with 2% for the roundings to the dtype."""
    bound = math.sqrt(hidden) * float(norm_weight.detach().abs().max()) * 1.02
    return max(0, math.ceil(math.log2(bound / 2.0**15))) if bound > 0 else 0


def quantize_head(weight: torch.Tensor, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [V, H] int8, meta [V, 4] float32) for a 16-bit LM head weight [V, H] and the input's
    scale exponent E (input_exponent): per row the int8 values, then (s_r 2^E, B_r, T_r, 0) as
    the module docstring defines them, B_r and T_r rounded up."""
    if weight.dim() != 2:
        raise ValueError(f"the LM head weight must be [vocab, hidden], got {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    margin = hidden * 2.0**-20  # the sums' fp32 roundings, relative to ||w_r|| ||x|| (docstring)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    meta = torch.zeros((vocab, META_FIELDS), dtype=torch.float32, device=weight.device)
    up = 1.0 + 2.0**-20  # float64 -> float32 rounds to nearest: a relative step up covers it
    for r0 in range(0, vocab, _CHUNK_ROWS):
        w = weight[r0 : r0 + _CHUNK_ROWS].double()
        scale = (w.abs().amax(dim=1) / 127).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero row: q = 0, exact
        qs = torch.round(w / scale.double()[:, None]).clamp_(-127, 127)
        residual = w - scale.double()[:, None] * qs
        bound = residual.norm(dim=1) + margin * w.norm(dim=1)
        subnormal = scale.double() * qs.abs().sum(dim=1) * 2.0 ** (exponent - 24)
        q[r0 : r0 + _CHUNK_ROWS] = qs.to(torch.int8)
        meta[r0 : r0 + _CHUNK_ROWS, 0] = scale * 2.0**exponent
        meta[r0 : r0 + _CHUNK_ROWS, 1] = (bound * up).float()
        meta[r0 : r0 + _CHUNK_ROWS, 2] = (subnormal * up).float()
    return q, meta


def approximate_logits(q: torch.Tensor, meta: torch.Tensor, x: torch.Tensor, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) as the kernel computes them, in torch: the approximate logits of input x ([H], the
    model's dtype) and their error bounds (the module docstring). The reference the tests hold
    the bound against; the kernel's own sums run in another order, which the bound covers."""
    xs = (x.float() * 2.0**-exponent).half().float()
    a = (q.float() @ xs) * meta[:, 0]
    nx = x.float().square().sum().sqrt() * (1.0 + 2.0**-10)
    b = (meta[:, 1] * nx + meta[:, 2]) * (1.0 + 2.0**-16) + a.abs() * 2.0**-20
    return a, b
