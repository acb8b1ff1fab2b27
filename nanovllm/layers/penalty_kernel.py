"""Logit bias and vLLM's three penalties for one row of logits, as two graph-capturable launches
that read every setting from device memory (the lone-sequence graphs' records, fastpath/graphs.py).

- `penalize(logits, knobs, bias, counts, seen, out)`: out [1, V] fp32 = the row's logits plus
  `bias` (dense, 0 where a token has none), then the repetition penalty over the tokens `seen`
  (in the prompt or sampled), then the frequency and presence penalties over the output `counts`.
  knobs: [3] fp32 (presence, frequency, repetition); (0, 0, 1) leaves the row as it is.
- `count_token(token, counts, seen)`: counts[token] += 1 and seen[token] = True, `token` being
  the [1] int64 that the sampler just wrote on the device.

The arithmetic is layers/penalties.py's, step for step and rounded the same way in fp32
(x / r rounded to nearest, no fused multiply-add): on the same inputs both give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.precompile import launch

BLOCK = 1024
# The count launch works in a block of this many lanes, one of them live: a block smaller than
# the program's threads miscomputes on the GPU.
COUNT_BLOCK = 128


@triton.jit
def _penalize_kernel(logits_ptr, out_ptr, knobs_ptr, bias_ptr, counts_ptr, seen_ptr, vocab_size,
                     BLOCK_: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    live = cols < vocab_size
    presence = tl.load(knobs_ptr)
    frequency = tl.load(knobs_ptr + 1)
    repetition = tl.load(knobs_ptr + 2)
    x = tl.load(logits_ptr + cols, mask=live, other=0.0).to(tl.float32)
    x = x + tl.load(bias_ptr + cols, mask=live, other=0.0)
    seen = tl.load(seen_ptr + cols, mask=live, other=0) != 0
    r = tl.where(seen, repetition, 1.0)
    x = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
    counts = tl.load(counts_ptr + cols, mask=live, other=0)
    x = x - (frequency * counts.to(tl.float32) + presence * (counts > 0).to(tl.float32))
    tl.store(out_ptr + cols, x, mask=live)


@triton.jit
def _count_kernel(token_ptr, counts_ptr, seen_ptr, BLOCK_: tl.constexpr):
    token = tl.load(token_ptr)
    lanes = tl.arange(0, BLOCK_)
    first = lanes == 0
    at = token + lanes
    c = tl.load(counts_ptr + at, mask=first, other=0)
    tl.store(counts_ptr + at, c + 1, mask=first)
    tl.store(seen_ptr + at, tl.full((BLOCK_,), 1, tl.int8), mask=first)


def _seen_bytes(seen: torch.Tensor) -> torch.Tensor:
    return seen.view(torch.int8) if seen.dtype == torch.bool else seen


def penalize(logits: torch.Tensor, knobs: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor,
             seen: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [1, V] fp32 = logits [1, V] (any float dtype) edited as the module docstring says;
    knobs [3] fp32, bias [V] fp32, counts [V] int32, seen [V] bool. Returns out."""
    vocab = logits.shape[-1]
    if logits.stride(-1) != 1 or out.dtype != torch.float32 or out.shape[-1] != vocab or counts.shape[-1] != vocab \
            or seen.shape[-1] != vocab or bias.shape[-1] != vocab or knobs.numel() < 3:
        raise ValueError(f"penalize: logits {tuple(logits.shape)}, out {tuple(out.shape)} {out.dtype}, counts "
                         f"{tuple(counts.shape)}, seen {tuple(seen.shape)}, bias {tuple(bias.shape)}, knobs {knobs.numel()}")
    launch(_penalize_kernel, (triton.cdiv(vocab, BLOCK),), logits, out, knobs, bias, counts, _seen_bytes(seen), vocab,
           BLOCK_=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def count_token(token: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> None:
    """counts[token] += 1, seen[token] = True; token: [1] int64 on the device (no host sync)."""
    launch(_count_kernel, (1,), token, counts, _seen_bytes(seen), BLOCK_=COUNT_BLOCK, num_warps=4)
