"""Decode-size linear layers in cuBLAS: which call form is fastest at 1-16 tokens (bf16, H200).

`F.linear(x, W)` lets cuBLAS pick a kernel for [M, K] x [K, N]; at small M it sometimes picks a
slow one (Qwen3-0.6B's o_proj, N=1024 K=2048, took 12.7 us at M=1 against 4.8 us for the larger
qkv). The same product can be asked for as `(W @ x.T).T` (cuBLAS sees the transposed problem and
picks again) or with x padded to 8 rows. Each case captures 28 calls in a CUDA graph, each on
its own weight copy (one per layer, so weights come from HBM, not L2), and replays it.

    python benchmarks/small_gemm.py
    python benchmarks/small_gemm.py --rows 64 128 256     # W1's decode batches: F.linear, TFLOP/s
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import graph_time_us

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
ROWS = (1, 2, 4, 8, 16)
LAYERS = 28


def transposed(x, w):
    return (w @ x.T).T


def padded8(x, w):
    m = x.shape[0]
    if m >= 8:
        return F.linear(x, w)
    return F.linear(F.pad(x, (0, 0, 0, 8 - m)), w)[:m]


VARIANTS = {"F.linear": F.linear, "(W @ x.T).T": transposed, "pad to 8": padded8}


def batch_rows(weights: dict, rows: list[int]) -> None:
    """F.linear at larger M, as torch calls cuBLAS by default and with cuBLASLt preferred (other
    heuristics, other kernels): time, weight-read rate and matrix-unit rate per projection."""
    print(torch.cuda.get_device_name(), "us per call (GB/s of weight read, TFLOP/s)")
    libraries = ("cublas", "cublaslt")
    for m in rows:
        totals = dict.fromkeys(libraries, 0.0)
        for name, ws in weights.items():
            n, k = ws[0].shape
            x = torch.randn(m, k, device=ws[0].device, dtype=torch.bfloat16)
            cells = []
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_time_us(lambda i: F.linear(x, ws[i]), calls=LAYERS)
                totals[lib] += us
                cells.append(f"{lib} {us:6.2f} ({n * k * 2 / (us * 1e3):5.0f} GB/s, {2 * m * n * k / (us * 1e6):4.0f} TF)")
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"{name:8s} M={m:4d}  " + "   ".join(cells))
        print(f"four projections at M={m}, us per layer: " + ", ".join(f"{lib} {t:.1f}" for lib, t in totals.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", help="time F.linear at these M instead of the 1-16 variant table")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    if args.rows:
        batch_rows(weights, args.rows)
        return
    print(torch.cuda.get_device_name(), "us per call (GB/s of weight read)")
    print(f"{'proj':8s} {'M':>3s} " + " ".join(f"{v:>20s}" for v in VARIANTS))
    for m in ROWS:
        for name, ws in weights.items():
            x = torch.randn(m, ws[0].shape[1], device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            cells = []
            for fn in VARIANTS.values():
                err = (fn(x, ws[0]).float() - ref).abs().max().item()
                us = graph_time_us(lambda i: fn(x, ws[i]), calls=LAYERS)
                gbs = ws[0].numel() * 2 / (us * 1e-6) / 1e9
                cells.append(f"{us:7.2f} ({gbs:5.0f}){'!' if err > 0.05 else ' '}")
            print(f"{name:8s} {m:3d} " + " ".join(f"{c:>20s}" for c in cells))


if __name__ == "__main__":
    main()
