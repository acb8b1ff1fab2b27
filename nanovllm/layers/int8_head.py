"""The LM head's int8 product on the CPU: codes [V, H] int8 with one symmetric scale per
vocabulary row, times hidden states [M, H] -> logits [M, V] fp32.

Two kernels behind one seam (`Int8HeadMatmul`):
- the reference, torch's int8 weight kernel (`_weight_int8pack_mm`): bf16 activations, each code
  widened and multiplied in fp32, logits rounded to bf16. It streams the matrix once per row, so
  the head gives it a few rows only (ParallelLMHead sends more to an fp32 copy of its weight);
- where torch has FBGEMM (x86 builds), FBGEMM's int8 linear: unsigned 8-bit activations times
  the codes in integer instructions (VNNI where the CPU has them), summed in int32, for any
  number of rows. One 8-bit pass over a hidden state would round its ordinary dimensions
  coarsely next to its outlier dimensions, so each row goes in twice, stacked into one call
  (which reads the codes once): the row scaled to a maximum of 1, and what its 8-bit codes
  leave out, scaled to a maximum of 1 too; the two products add up to the exact product of
  the codes within about 1e-4 of the largest logit (tests/test_int8_head.py).

Without VNNI, FBGEMM multiplies the activations by the codes in 16-bit pairs, which can
saturate; the activations then take 7 bits (its reduce_range). The packing goes through torch's
quantized tensors, an older torch API: a torch without them falls back to the reference.
"""
from __future__ import annotations

import functools
import logging
import threading
import warnings

import torch

from nanovllm.layers.cpu_features import cpu_flags

logger = logging.getLogger("nanovllm")


@functools.lru_cache(maxsize=None)
def fbgemm_available() -> bool:
    """Whether this torch has FBGEMM's int8 linear with fp32 activations in and logits out (x86 builds)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


def _cpu_has_vnni() -> bool:
    return not cpu_flags().isdisjoint({"avx512_vnni", "avx_vnni"})


def _fbgemm_pack(codes: torch.Tensor, scales: torch.Tensor):
    """FBGEMM's packed form of the codes and scales, or None where this torch cannot make it."""
    zeros = torch.zeros(codes.shape[0], dtype=torch.long)
    try:
        with warnings.catch_warnings():  # quantized tensors serve here as FBGEMM's packing input only
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zeros, 0)
            return torch.ops.quantized.linear_prepack(weight, None)
    except (AttributeError, RuntimeError):
        return None


class Int8HeadMatmul:
    """`(hidden [M, H]) -> logits [M, V] fp32` for int8 codes [V, H] and fp32 scales [V]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, use_fbgemm: bool | None = None) -> None:
        self.codes = codes
        self.scales_bf16 = scales.bfloat16()
        self.use_fbgemm = fbgemm_available() if use_fbgemm is None else use_fbgemm
        self._reduce_range = not _cpu_has_vnni()
        self._packed = None
        self._packing: threading.Thread | None = None
        if self.use_fbgemm:
            # Packing takes a few hundred milliseconds for a large vocabulary; it runs beside the
            # rest of start-up (it releases the GIL), and the first product waits for it. Not a
            # daemon: a process that ends first waits for it (a daemon thread still packing at
            # the interpreter's exit aborted the process).
            self._packing = threading.Thread(target=self._pack, args=(codes, scales), name="int8-head-pack")
            self._packing.start()

    def _pack(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self._packed = _fbgemm_pack(codes, scales)

    def _fbgemm_ready(self) -> bool:
        """Wait for the packing, if it runs; False (the reference from now on) if it failed."""
        if self._packing is not None:
            self._packing.join()
            self._packing = None
            if self._packed is None:
                logger.warning("the LM head's int8 codes could not be packed for FBGEMM; torch's int8 kernel serves")
                self.use_fbgemm = False
        return self.use_fbgemm

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        """Each row scaled to a maximum of 1 and quantized with a step of 1/HALF; what those
        codes leave out is another row, scaled to a maximum of 1 too: one call over 2M rows
        (it reads the codes once whatever the rows), whose two halves add up."""
        half = 63 if self._reduce_range else 127  # unsigned codes 1..2*half around the zero point half + 1
        rows = x.shape[0]
        tiny = torch.finfo(torch.float32).tiny
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_(min=tiny)
        stacked = torch.empty((2 * rows, x.shape[1]), dtype=torch.float32)
        first, rest = stacked[:rows], stacked[rows:]
        torch.div(x, row_max, out=first)
        torch.sub(first, first.mul(half).round_().div_(half), out=rest)
        rest_max = rest.abs().amax(dim=1, keepdim=True).clamp_(min=tiny)
        rest.div_(rest_max)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(stacked, 1.0 / half, half + 1, self._packed)
        return y[:rows].addcmul_(y[rows:], rest_max).mul_(row_max)

    @property
    def serves_any_rows(self) -> bool:
        """Whether it is the faster product at every row count (else: for a few rows only)."""
        return self.use_fbgemm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.use_fbgemm and self._fbgemm_ready():
            return self._fbgemm(hidden.float())
        return torch.ops.aten._weight_int8pack_mm(hidden.bfloat16(), self.codes, self.scales_bf16).float()
