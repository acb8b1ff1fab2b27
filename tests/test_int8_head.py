"""The LM head's int8 product (layers/int8_head.py): FBGEMM's kernel against the exact product
of the same codes and scales, and against torch's reference int8 kernel."""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.int8_head import Int8HeadMatmul, fbgemm_available


def codes_and_scales(vocab: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    scales = weight.abs().amax(dim=1) / 127
    codes = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales, codes.float() * scales[:, None]


@pytest.mark.skipif(not fbgemm_available(), reason="this torch has no FBGEMM (not an x86 build)")
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fbgemm_product_equals_the_exact_product_of_the_codes(rows):
    """Rows of different scales, one with an outlier dimension 30x the others (as hidden states
    have): every logit within 1e-3 of the largest logit's size of the exact product, which one
    8-bit pass over the activations (one scale for every row) misses by ~2%."""
    codes, scales, dequantized = codes_and_scales(1000, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * torch.arange(1, rows + 1)[:, None]
    x[:, 7] *= 30
    want = x @ dequantized.T
    got = Int8HeadMatmul(codes, scales, use_fbgemm=True)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.skipif(not fbgemm_available(), reason="this torch has no FBGEMM (not an x86 build)")
def test_fbgemm_and_reference_kernels_give_the_same_logits_up_to_bf16():
    """The reference kernel rounds the activations and the logits to bf16; the two agree to
    that rounding, and a zero row gives zero logits in both."""
    codes, scales, _ = codes_and_scales(512, 64, seed=2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    x[2] = 0
    fast = Int8HeadMatmul(codes, scales, use_fbgemm=True)(x)
    reference = Int8HeadMatmul(codes, scales, use_fbgemm=False)(x)
    torch.testing.assert_close(fast, reference, atol=3e-2, rtol=1e-2)
    assert torch.count_nonzero(fast[2]) == 0 and torch.count_nonzero(reference[2]) == 0


@pytest.mark.skipif(not fbgemm_available(), reason="this torch has no FBGEMM (not an x86 build)")
def test_a_process_that_ends_while_the_head_is_packed_exits_cleanly():
    """A program that ends right after building the head (an LLM() followed by an error, before
    any generate) exits with its own status: the packing it leaves running is waited for, not
    torn down with the interpreter (which aborted the process)."""
    import subprocess
    import sys

    code = ("import torch; from nanovllm.layers.int8_head import Int8HeadMatmul\n"
            "codes = torch.randint(-127, 128, (151936, 1024), dtype=torch.int8)\n"
            "Int8HeadMatmul(codes, torch.rand(151936) / 127)\n"
            "raise SystemExit(3)\n")
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # two at once: two tries at the race
    try:
        for run in runs:
            _, err = run.communicate(timeout=300)
            assert run.returncode == 3, err[-2000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
