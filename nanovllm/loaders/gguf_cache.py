"""A GGUF file's converted config, tokenizer and fp32 weights, cached on disk (loaders/cache.py).

Converting a GGUF file costs seconds on every start: parsing the header walks every token
string, transformers parses it again to build the tokenizer, and every tensor is dequantized.
The results depend only on the file's bytes (and, for the tokenizer, on the transformers
release), so they are kept under `<cache dir>/gguf-v<FORMAT_VERSION>/<file digest>/`:

- `config.json`: the HF config's values. A warm start reads them into `SavedConfig`, a plain
  attribute holder, instead of the transformers config class, whose import pulls in most of
  transformers (seconds); the engine only reads attributes of the config.
- `tokenizer-transformers-<version>/`: the tokenizer as `save_pretrained` writes it.
- `weights.safetensors` + `weights.json`: the HF-named fp32 tensors exactly as `iter_gguf_weights`
  yields them, in its order, and the weight file's digest (a truncated or altered file is
  rebuilt). Files whose fp32 weights exceed MAX_CACHED_WEIGHT_BYTES are not cached: the copy
  would be 4-8x the GGUF file on disk.

Bump FORMAT_VERSION whenever loaders/gguf.py changes what it produces.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from nanovllm.loaders.cache import atomic_dir, atomic_file, cache_dir, cache_enabled, discard, file_digest

logger = logging.getLogger("nanovllm")

FORMAT_VERSION = 1
MAX_CACHED_WEIGHT_BYTES = 4 << 30
# Properties of transformers configs that to_dict() leaves out but the engine may read.
_CONFIG_ALIASES = ("rope_scaling", "rope_theta")


class SavedConfig:
    """An HF config's values as attributes (what the engine reads of a config), from config.json."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"SavedConfig({self.__dict__!r})"


@dataclass(frozen=True)
class GGUFCacheEntry:
    root: Path
    digest: str

    @classmethod
    def for_file(cls, path: str | os.PathLike[str]) -> GGUFCacheEntry | None:
        """The entry of a GGUF file, or None when caching is disabled."""
        if not cache_enabled():
            return None
        digest = file_digest(path)
        return cls(cache_dir() / f"gguf-v{FORMAT_VERSION}" / digest, digest)

    # ---- config --------------------------------------------------------------------------
    def load_config(self) -> SavedConfig | None:
        path = self.root / "config.json"
        if not path.is_file():
            return None
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(values, dict) or "architectures" not in values:
                raise ValueError("not a model config")
        except (OSError, ValueError) as exc:
            discard(path, exc)
            return None
        return SavedConfig(values)

    def save_config(self, config: Any) -> None:
        values = config.to_dict()
        for name in _CONFIG_ALIASES:
            if name not in values and hasattr(config, name):
                values[name] = getattr(config, name)
        self._write(self.root / "config.json", lambda tmp: tmp.write_text(json.dumps(values, indent=1), "utf-8"))

    # ---- tokenizer -----------------------------------------------------------------------
    @property
    def tokenizer_dir(self) -> Path:
        return self.root / f"tokenizer-transformers-{version('transformers')}"

    def load_tokenizer(self):
        path = self.tokenizer_dir
        if not path.is_dir():
            return None
        try:
            import transformers

            with open(path / "tokenizer_config.json", encoding="utf-8") as f:
                class_name = json.load(f).get("tokenizer_class") or "PreTrainedTokenizerFast"
            tokenizer_class = getattr(transformers, class_name)
            return tokenizer_class.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load means a bad entry: rebuild it
            discard(path, exc)
            return None

    def save_tokenizer(self, tokenizer) -> None:
        try:
            with atomic_dir(self.tokenizer_dir) as tmp:
                tokenizer.save_pretrained(str(tmp))
        except OSError as exc:
            logger.warning("could not cache the tokenizer in %s: %s", self.tokenizer_dir, exc)

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The cached weights, checked against their recorded digest, or None."""
        manifest, weights = self.root / "weights.json", self.root / "weights.safetensors"
        if not manifest.is_file():
            return None
        try:
            record = json.loads(manifest.read_text(encoding="utf-8"))
            names = record["names"]
            if file_digest(weights) != record["digest"]:
                raise ValueError("the weight file does not match its recorded digest")
            from safetensors import safe_open

            handle = safe_open(str(weights), framework="pt")
            if sorted(handle.keys()) != sorted(names):
                raise ValueError("the weight file's tensors differ from its record")
        except Exception as exc:  # noqa: BLE001 - any failure to open means a bad entry: rebuild it
            discard(manifest, exc)
            return None
        return ((name, handle.get_tensor(name)) for name in names)

    def saving_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the weights through; once all have gone by, write them to the cache (unless they
        exceed MAX_CACHED_WEIGHT_BYTES). The tensors are kept until then."""
        kept: dict[str, torch.Tensor] | None = {}
        total = 0
        for name, tensor in weights:
            if kept is not None:
                total += tensor.numel() * tensor.element_size()
                if total > MAX_CACHED_WEIGHT_BYTES:
                    logger.info("weights over %d GiB: not cached", MAX_CACHED_WEIGHT_BYTES >> 30)
                    kept = None
                else:
                    kept[name] = tensor
            yield name, tensor
        if kept is not None:
            self._save_weights(kept)

    def _save_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        weights = self.root / "weights.safetensors"
        digest: list[str] = []

        def write(tmp: Path) -> None:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))
            digest.append(file_digest(tmp))

        if self._write(weights, write):
            record = {"names": list(tensors), "digest": digest[0]}
            self._write(self.root / "weights.json", lambda tmp: tmp.write_text(json.dumps(record), "utf-8"))

    def _write(self, dest: Path, write) -> bool:
        try:
            with atomic_file(dest) as tmp:
                write(tmp)
        except OSError as exc:
            logger.warning("could not write the cache file %s: %s", dest, exc)
            return False
        return True

