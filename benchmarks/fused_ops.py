"""Fused small-op kernels (nanovllm/layers/fused.py) vs the torch reference path, on the GPU.

Run from the repository root on the H200:

    python3 benchmarks/fused_ops.py [--tokens 1 256 8192]

Why: a CUDA-graph decode step of Qwen3-0.6B spent most of its time in ~1,500 tiny elementwise
kernels (RMSNorm ~7, rotary ~10, ...). This times each op both ways at the Qwen3-0.6B shapes
(hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072, bf16) for a single decode, a 256-token
decode batch and an 8192-token prefill, with triton.testing.do_bench_cudagraph (median; what a
captured step pays, without Python launch cost). Each row also gives the largest difference from
the torch output in units in the last place (0 = bit-identical). The last rows add one decoder
layer's small ops (2 norms, q/k norm + rotary, SiLU-and-mul) and multiply by 28 layers.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from nanovllm.layers import fused  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.norm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding, apply_qk_norm_rope  # noqa: E402

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
NUM_LAYERS, MAX_POSITION, THETA, EPS = 28, 40960, 1e6, 1e-6
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
SIZES = [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM]


def max_ulps(actual: torch.Tensor, expected: torch.Tensor, per_head: bool = False) -> float:
    """Largest difference in bf16 units in the last place, at max(|actual|, |expected|) or, for
    q/k (whose rotary differences can cancel), at each head's largest value."""
    a, e = actual.double(), expected.double()
    mag = torch.maximum(a.abs(), e.abs())
    if per_head:
        mag = torch.maximum(mag, e.abs().amax(dim=-1, keepdim=True))
    _, exponent = torch.frexp(mag.clamp_min(torch.finfo(DTYPE).tiny))
    return float(((a - e).abs() / torch.ldexp(torch.ones_like(a), exponent - 8)).max())


def bench(fn: Callable[[], object]) -> float:
    """Median µs per call inside a CUDA graph."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def make_norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, EPS).to(DEVICE, DTYPE)  # fused=False: the torch path
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    norm.weight.copy_(1.0 + 0.1 * torch.randn(size, generator=gen, device=DEVICE))
    return norm


def cases(tokens: int) -> list[tuple[str, Callable[[], object], Callable[[], object], float]]:
    """(name, torch fn, fused fn, max ulps between their outputs) at one token count."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)

    norm, q_norm, k_norm = make_norm(HIDDEN, 1), make_norm(HEAD_DIM, 2), make_norm(HEAD_DIM, 3)
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, THETA).to(DEVICE)
    silu = SiluAndMul()
    x, residual = randn(tokens, HIDDEN), randn(tokens, HIDDEN)
    gate_up = randn(tokens, 2 * INTER)
    qkv = randn(tokens, sum(SIZES))
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen, device=DEVICE)

    def qk(q_w: torch.Tensor | None, k_w: torch.Tensor | None) -> Callable[[], object]:
        q, k, _ = qkv.split(SIZES, dim=-1)
        return lambda: fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, q_w, k_w, EPS)

    def qk_torch(norms: tuple[RMSNorm | None, RMSNorm | None]) -> Callable[[], object]:
        q, k, _ = qkv.split(SIZES, dim=-1)
        return lambda: apply_qk_norm_rope(rotary, positions, q, k, *norms)

    def qk_ulps(norms: tuple[RMSNorm | None, RMSNorm | None]) -> float:
        ref_q, ref_k, _ = qkv.clone().split(SIZES, dim=-1)
        ref_q, ref_k = apply_qk_norm_rope(rotary, positions, ref_q, ref_k, *norms)
        q, k, _ = qkv.clone().split(SIZES, dim=-1)
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, *(n.weight if n else None for n in norms), EPS)
        q, k = q.reshape(tokens, -1, HEAD_DIM), k.reshape(tokens, -1, HEAD_DIM)
        ref_q, ref_k = ref_q.reshape(q.shape), ref_k.reshape(k.shape)
        return max(max_ulps(q, ref_q, per_head=True), max_ulps(k, ref_k, per_head=True))

    add_ref, _ = norm(x, residual.clone())
    add_out, _ = fused.fused_add_rms_norm(x, residual.clone(), norm.weight, EPS)
    return [
        ("rms_norm", lambda: norm(x), lambda: fused.rms_norm(x, norm.weight, EPS),
         max_ulps(fused.rms_norm(x, norm.weight, EPS), norm(x))),
        # residual is updated in place by the fused path; it only grows while timing.
        ("add_rms_norm", lambda: norm(x, residual), lambda: fused.fused_add_rms_norm(x, residual, norm.weight, EPS),
         max_ulps(add_out, add_ref)),
        ("qk_norm_rope", qk_torch((q_norm, k_norm)), qk(q_norm.weight, k_norm.weight), qk_ulps((q_norm, k_norm))),
        ("rope", qk_torch((None, None)), qk(None, None), qk_ulps((None, None))),
        ("silu_and_mul", lambda: silu(gate_up), lambda: fused.silu_and_mul(gate_up),
         max_ulps(fused.silu_and_mul(gate_up), silu(gate_up))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {DTYPE}")
    header = f"{'op':<14}{'tokens':>7}{'torch µs':>11}{'fused µs':>11}{'speedup':>9}{'max ulps':>10}"
    print(header)
    print("-" * len(header))
    per_layer = {"add_rms_norm": 2, "qk_norm_rope": 1, "silu_and_mul": 1}  # input + post-attention norm
    with torch.inference_mode():
        for tokens in args.tokens:
            layer_torch = layer_fused = 0.0
            for name, torch_fn, fused_fn, ulps in cases(tokens):
                t_torch, t_fused = bench(torch_fn), bench(fused_fn)
                print(f"{name:<14}{tokens:>7}{t_torch:>11.2f}{t_fused:>11.2f}{t_torch / t_fused:>8.1f}x{ulps:>10.0f}")
                layer_torch += per_layer.get(name, 0) * t_torch
                layer_fused += per_layer.get(name, 0) * t_fused
            print(
                f"{'x28 layers':<14}{tokens:>7}{NUM_LAYERS * layer_torch:>11.1f}{NUM_LAYERS * layer_fused:>11.1f}"
                f"{layer_torch / layer_fused:>8.1f}x"
            )
            print()


if __name__ == "__main__":
    main()
