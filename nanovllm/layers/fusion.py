"""The one switch for fused Triton kernels (model small ops and the sampler's fast path).

`NANOVLLM_FUSED_OPS=0` (or false / off / no) keeps every torch reference path, for debugging.
It is read when a model or sampler is built, never at module import.
"""
from __future__ import annotations

import importlib.util
import os

FUSED_OPS_ENV = "NANOVLLM_FUSED_OPS"


def fused_ops_from_env() -> bool:
    """Whether CUDA tensors take the fused Triton kernels: yes unless NANOVLLM_FUSED_OPS is 0 /
    false / off / no, or triton is not installed."""
    if os.environ.get(FUSED_OPS_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return importlib.util.find_spec("triton") is not None
