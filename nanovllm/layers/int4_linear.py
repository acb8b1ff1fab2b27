"""Weight-only int4 linears for the CPU: `LLM(..., quantization="int4")`.

Why: decoding one sequence on a CPU reads every weight once per token, so it runs at the
memory's pace, and int4 codes are an eighth of fp32's bytes; at a batch of 16 rows int4 costs
about what bf16 does.

How: each weight row is cut into groups of GROUP_SIZE along K, stored as 4-bit codes q with one
scale and one offset per group: w ~ (q - 8) * scale + zero, the layout that torch's CPU kernel
`_weight_int4pack_mm_for_cpu` multiplies (the op torch's own int4 weight-only quantization
calls on CPUs). The codes come from each group's minimum and maximum. For GGUF Q4_1 weights
(the embedded default model) that gives back the file's own codes: Q4_1 quantizes every block of
32 from its minimum and maximum, so each block holds codes 0 and 15. What changes is the scale
and offset, which become bf16 values (the kernel takes them in the activations' dtype, and it
needs bf16 activations to be fast: fp32 ones take a slow path), chosen
to keep the error small (_codes). So the model runs in bf16 and its output differs from the
fp32 reference path (tests/test_int4_linear.py compares it with the same weights dequantized,
and checks the README question's answer on the embedded model).

The LM head and the embedding stay dense (layers/linear.py's quantize_int4 says why), as does a
linear whose K is not a multiple of GROUP_SIZE.

Large steps: torch's int4 kernel widens the codes for every few rows, so a prefill of hundreds of
tokens pays the widening many times over, while a CPU with native bf16 dot products (AVX512-BF16,
AMX) multiplies a dense bf16 matrix several times faster at such shapes. An Int4Weight may carry
`dense`, the weight the codes stand for in bf16 (`quantize(..., dense=True)`), which steps of
DENSE_MIN_ROWS rows or more multiply instead (a prefill; a batch of that many sequences); fewer
rows, a few sequences decoding, read the codes (a quarter of the bytes, and the memory's pace is
what bounds them; on a 2-vCPU Zen 4 VM the two break even at about 24 rows). The dense copy
rounds each weight to bf16 once more, so a large step's logits differ from the codes' by that
rounding: a sequence's tokens can depend on the size of the steps it runs in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.layers.cpu_features import cpu_flags

GROUP_SIZE = 32
# torch's CPU int4 packing takes weights whose out-features are a multiple of this.
OUT_FEATURES_MULTIPLE = 16
# Steps of at least this many rows multiply an Int4Weight's dense bf16 copy where it has one.
DENSE_MIN_ROWS = 32


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), which make dense
    bf16 matmuls faster than the int4 kernel for large steps."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def available() -> bool:
    """Whether this torch has the CPU int4 kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


@dataclass
class Int4Weight:
    """A [out, in] weight as int4 codes (packed by torch, [out, in / 2] uint8) and per-group
    (scale, zero) pairs [in / group_size, out, 2] in bf16."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    shape: torch.Size
    dense: torch.Tensor | None = None  # [out, in] bf16, the weight the codes stand for: large steps

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two values of `dtype` around x, as fp32: the nearest, and its neighbour on x's other side
    (the next one up where x is a value of `dtype`)."""
    near = x.to(dtype)
    down, up = torch.tensor(-float("inf"), dtype=dtype), torch.tensor(float("inf"), dtype=dtype)
    other = torch.where(near.float() > x, torch.nextafter(near, down), torch.nextafter(near, up))
    return near.float(), other.float()


# Rows quantized at a time: a chunk's fp32 temporaries stay in the CPU's caches (the embedded
# model's projections quantize about twice as fast as whole).
CHUNK_ROWS = 256


def _round_codes(groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, centre: int) -> torch.Tensor:
    """Codes in 0..15 (as floats) for groups [out, groups, size] under w = (q - centre) * scale +
    offset; a constant group (scale 0) gets code 8, so that the offset alone stands for it."""
    safe = torch.where(scale > 0, scale, 1.0)
    codes = groups - offset[..., None]  # then in place: the temporaries are the time here
    codes.div_(safe[..., None])
    if centre:
        codes.add_(centre)
    codes.round_().clamp_(0, 15)
    constant = ~(scale > 0)
    return codes.masked_fill_(constant[..., None], 8.0) if bool(constant.any()) else codes


def _codes(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] int32 in 0..15, scale [out, groups], zero [out, groups]; scale and zero
    are values of `dtype`). Codes from each group's minimum and maximum, in fp32; then, of the
    two `dtype` values around the scale, the one that with its best `dtype` offset (the rounded
    least-squares one or a neighbour) leaves the smallest squared error, and the codes again for
    those. On the embedded model's projections the weights then carry 1.3-1.6x the RMS error
    of bf16 weights; rounding the scale alone to bf16 and taking min + 8 * scale left 2.9-3.6x,
    and flipped the README question's first greedy token (a near tie)."""
    out_features, in_features = weight.shape
    if out_features > CHUNK_ROWS:  # every step is per row: the same codes, chunk by chunk
        codes = torch.empty(out_features, in_features, dtype=torch.int32)
        scale = torch.empty(out_features, in_features // group_size)
        zero = torch.empty_like(scale)
        for i in range(0, out_features, CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            codes[rows], scale[rows], zero[rows] = _codes(weight[rows], group_size, dtype)
        return codes, scale, zero
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(-1)
    scale = (groups.amax(-1) - low) / 15
    centred = _round_codes(groups, scale, low, 0).sub_(8)
    best_err = best_scale = best_zero = None
    for s in _neighbours(scale, dtype):
        s = torch.where(scale > 0, s, 0.0)
        scaled = centred * s[..., None]
        ideal = (groups - scaled).mean(-1)
        for z in _neighbours(ideal, dtype):
            err = (scaled + z[..., None]).sub_(groups).pow_(2).sum(-1)
            if best_err is None:
                best_err, best_scale, best_zero = err, s, z
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, s, best_scale)
                best_zero = torch.where(better, z, best_zero)
    # The codes again for the scale and offset chosen (the same for Q4_1 blocks).
    codes = _round_codes(groups, best_scale, best_zero, 8)
    return codes.reshape(out_features, in_features).to(torch.int32), best_scale, best_zero


def quantizable(shape: torch.Size, group_size: int = GROUP_SIZE) -> bool:
    """Whether a [out, in] weight can be packed: in-features in whole groups, out-features a
    multiple of OUT_FEATURES_MULTIPLE."""
    return len(shape) == 2 and shape[1] % group_size == 0 and shape[0] % OUT_FEATURES_MULTIPLE == 0


def quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.bfloat16,
             dense: bool = False) -> Int4Weight:
    """Int4Weight of a 2-D weight that is `quantizable`; with dense, also the weight its codes
    stand for, in bf16, for large steps."""
    if not quantizable(weight.shape, group_size):
        raise ValueError(f"int4 weights need a 2-D weight with in-features a multiple of {group_size} and "
                         f"out-features a multiple of {OUT_FEATURES_MULTIPLE}, got {list(weight.shape)}")
    codes, scale, zero = _codes(weight, group_size, dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    pairs = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    dense_copy = None
    if dense:  # (q - 8) * scale + zero per group, as the kernel widens a code, then to bf16
        out_features, in_features = weight.shape
        groups = codes.view(out_features, in_features // group_size, group_size).float().sub_(8)
        dense_copy = groups.mul_(scale.float()[..., None]).add_(zero.float()[..., None]).view(weight.shape).bfloat16()
    return Int4Weight(packed, pairs, group_size, weight.shape, dense_copy)


def empty_like_quantized(shape: torch.Size, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.bfloat16,
                         dense: bool = False) -> Int4Weight:
    """An Int4Weight of a [out, in] weight with uninitialised codes and scales, and with dense a
    dense copy (all to be filled)."""
    out_features, in_features = shape
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    pairs = torch.empty(in_features // group_size, out_features, 2, dtype=dtype)
    dense_copy = torch.empty(out_features, in_features, dtype=torch.bfloat16) if dense else None
    return Int4Weight(packed, pairs, group_size, torch.Size(shape), dense_copy)


def dequantize(weight: Int4Weight) -> torch.Tensor:
    """The weight an Int4Weight stands for, as the kernel computes it (rounded to the weight's
    dtype, returned as fp32; tests compare it with dense references). Needs the codes, which
    torch's packing does not give back, so it multiplies the identity instead."""
    eye = torch.eye(weight.shape[1], dtype=weight.dtype)
    return int4_linear(eye, weight).float().t().contiguous()


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for 2-D bf16 x: through the dense copy for DENSE_MIN_ROWS rows or more
    where the weight has one, else the codes."""
    if weight.dense is not None and x.shape[0] >= DENSE_MIN_ROWS:
        return torch.nn.functional.linear(x, weight.dense, bias)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight.packed, weight.group_size, weight.scales_and_zeros)
    return y if bias is None else y + bias
