"""The CPU linear (layers/cpu_linear.py) against F.linear: fp32 through oneDNN where available,
everything else through F.linear itself."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers import cpu_linear


@pytest.mark.parametrize("rows", [0, 1, 16, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    got = cpu_linear.linear(x, w, b)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_non_contiguous_input_and_other_dtypes():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=gen).t()  # [8, 96], a transposed view
    w = torch.randn(40, 96, generator=gen)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear.linear(xb, wb), F.linear(xb, wb))  # not fp32: F.linear itself


def test_onednn_is_used_on_x86():
    """On an x86 torch with oneDNN the fast path must be on: if a torch release drops the op,
    this says so instead of the CPU silently slowing down."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        pytest.skip(f"oneDNN linear is only used on x86 torch builds with oneDNN (this is {platform.machine()})")
    assert cpu_linear.ONEDNN_LINEAR, "torch.ops.mkldnn._linear_pointwise is missing from this torch"
