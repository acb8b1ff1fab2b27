"""Random weights for `load_format="dummy"` (vLLM's name): the model from config.json alone.

Every parameter is filled in place, where the model was built (the GPU for a CUDA engine), with
values uniform in [-1e-3, 1e-3], as vLLM's dummy loader: small enough that activations stay
finite in any dtype. Nothing is created on the host, so a 30B-parameter model is ready in the
time the device takes to write its memory. Each rank draws from its own seeded generator;
tensor-parallel shards are therefore not slices of one model, which a benchmark does not need.
"""
from __future__ import annotations

import torch
from torch import nn

LOW, HIGH = -1e-3, 1e-3
CHUNK_ELEMENTS = 1 << 28  # elements filled per call: bounds the RNG's temporaries on the CPU


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every floating-point parameter of `model` with uniform random values in place."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():  # tied parameters are listed once
        if not param.is_floating_point():
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        for chunk in param.data.view(-1).split(CHUNK_ELEMENTS):
            chunk.uniform_(LOW, HIGH, generator=generators[device])
