"""Stream tensors out of a Hugging Face checkpoint directory, one shard file at a time.

Tensors are yielded by name as they are read (memory-mapped by the safetensors package), so a
model can copy each into its own, possibly sharded, parameters without ever holding the whole
checkpoint twice.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(path: str | Path) -> list[Path]:
    """Every *.safetensors file of a checkpoint directory (or the file itself), sorted."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files found in {str(path)!r}")
    return files


def iter_safetensors(model_dir: str | Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor in every shard of `model_dir`.

    The shard list is resolved now, so a missing checkpoint fails at the call, not at first use.
    """
    return _iter_files(safetensors_files(model_dir), device)


def _iter_files(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            reader = safe_open(str(file), framework="pt", device=device)
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types: a damaged or truncated file
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
        with reader as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
