"""Stream tensors out of a Hugging Face checkpoint directory, one shard file at a time.

Tensors are yielded by name as they are read (memory-mapped by the safetensors package), so a
model can copy each into its own, possibly sharded, parameters without ever holding the whole
checkpoint twice.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The shard files of a checkpoint directory, sorted: those its model.safetensors.index.json
    names in its weight_map when it has one (as transformers reads it; other *.safetensors files
    beside them, such as Mistral's consolidated.safetensors, are not the model's), else every
    *.safetensors file. A path to a .safetensors file gives that file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        return indexed_files(index)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files found in {str(path)!r}")
    return files


def indexed_files(index: Path) -> list[Path]:
    """The files an index's weight_map names, sorted; ValueError for an unreadable index or a
    listed file that is not there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a readable safetensors index (JSON with a weight_map): {exc!r}") from exc
    files = [index.parent / name for name in names]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{index} lists shard file(s) that are not there: {absent}")
    if not files:
        raise ValueError(f"{index} lists no shard files")
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
