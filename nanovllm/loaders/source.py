"""Where a model comes from: a Hugging Face directory, a GGUF file, or the embedded default.

`ModelSource` hides the difference from the engine: it gives the HF config, a tokenizer (or None
when the directory has none: token-id prompts still work), the EOS ids, and an iterator of
weights under Hugging Face tensor names, which every model's `load_weights` understands.
A GGUF file's converted config and tokenizer and the model's loaded parameters come from the
cache when it has them (loaders/gguf_cache.py); the file is then not parsed at all.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger("nanovllm")


@dataclass
class ModelSource:
    path: str
    kind: str  # "hf" | "gguf"
    hf_config: Any
    _reader: Any = field(default=None, repr=False, compare=False)
    cache: Any = field(default=None, repr=False, compare=False)  # GGUFCacheEntry | None

    def __getstate__(self) -> dict:
        # A GGUF reader holds a memory map: worker processes open their own.
        return {**self.__dict__, "_reader": None}

    def gguf_reader(self):
        """The file's GGUFHeader (loaders/gguf_header.py), opened once."""
        if self._reader is None:
            from nanovllm.loaders.gguf import open_gguf

            self._reader = open_gguf(self.path)
        return self._reader

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.kind == "gguf":
            from nanovllm.loaders.gguf import iter_gguf_weights

            return iter_gguf_weights(self.path, self.hf_config, reader=self.gguf_reader())
        from nanovllm.loaders.safetensors import iter_safetensors

        return iter_safetensors(self.path)

    def load_into(self, model: torch.nn.Module, variant: str) -> None:
        """`model.load_weights(self.weights())`, or for a cached GGUF file its parameters as
        loaded before under the same `variant` (model class, dtype, shard: see gguf_cache.py)."""
        self.load_model(lambda: model, variant)

    def load_model(self, build: Callable[[], torch.nn.Module], variant: str,
                   convert: Callable[[torch.nn.Module, bool], None] | None = None) -> torch.nn.Module:
        """A model from `build()` holding this source's weights. `convert(model, layout_only)`
        turns loaded weights into the form the engine runs (int4 codes: layers/linear.py), or with
        layout_only=True gives the model that form's empty tensors; a cached GGUF file keeps the
        converted form, so a warm start neither reads the file nor converts again."""
        if self.cache is not None and self.cache.has_params(variant):
            model = build()
            if convert is not None:
                convert(model, True)
            if self.cache.load_params(model, variant):
                return model
        model = build()
        model.load_weights(self.weights())
        if convert is not None:
            convert(model, False)
        if self.cache is not None:
            self.cache.save_params(model, variant)
        return model

    def tokenizer(self):
        if self.kind == "gguf":
            cached = self.cache.load_tokenizer() if self.cache is not None else None
            if cached is not None:
                return cached
            from nanovllm.loaders.gguf import load_gguf_tokenizer

            tokenizer = load_gguf_tokenizer(self.path, reader=self.gguf_reader())
            if self.cache is not None:
                self.cache.save_tokenizer(tokenizer)
                # The saved copy, as every later start loads it (the same class, cold or warm).
                return self.cache.load_tokenizer() or tokenizer
            return tokenizer
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("no tokenizer in %s (%s); only token-id prompts will work", self.path, exc)
            return None
        if len(tokenizer) <= 1:  # transformers builds an empty one from config.json alone
            logger.warning("no tokenizer in %s (no vocabulary files); only token-id prompts will work", self.path)
            return None
        return tokenizer

    def eos_token_ids(self, tokenizer) -> list[int]:
        """EOS ids from the generation config, else the model config, else the tokenizer."""
        candidates: Any = None
        if self.kind == "hf":
            try:
                from transformers import GenerationConfig

                candidates = GenerationConfig.from_pretrained(self.path).eos_token_id
            except (OSError, ValueError):
                candidates = None
        if candidates is None:
            candidates = getattr(self.hf_config, "eos_token_id", None)
        if candidates is None and tokenizer is not None:
            candidates = tokenizer.eos_token_id
        if candidates is None:
            return []
        return [int(c) for c in (candidates if isinstance(candidates, (list, tuple)) else [candidates])]


def resolve_model(model: str | os.PathLike | None, hf_config: Any = None) -> ModelSource:
    if model is None:
        from nanovllm.loaders.default_model import default_model_path

        model = default_model_path()
    path = os.fspath(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from nanovllm.loaders.gguf_cache import GGUFCacheEntry

        source = ModelSource(path, "gguf", hf_config, cache=GGUFCacheEntry.for_file(path))
        if source.hf_config is None and source.cache is not None:
            source.hf_config = source.cache.load_config()
        if source.hf_config is None:
            from nanovllm.loaders.gguf import gguf_config_values, load_gguf_config

            # The cache's form of the config (SavedConfig) on a first start too, where it can
            # be built without the transformers config class (gguf_config_values).
            values = gguf_config_values(path, reader=source.gguf_reader())
            if values is not None:
                from nanovllm.loaders.gguf_cache import SavedConfig

                source.hf_config = SavedConfig(values)
            else:
                source.hf_config = load_gguf_config(path, reader=source.gguf_reader())
            if source.cache is not None:
                source.cache.save_config(source.hf_config)
        return source
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        if hf_config is None:
            from transformers import AutoConfig

            try:
                hf_config = AutoConfig.from_pretrained(path)
            except Exception as exc:  # noqa: BLE001 - invalid JSON, or a config transformers refuses
                raise ValueError(f"{os.path.join(path, 'config.json')} cannot be read as a model config: {exc}") from exc
        return ModelSource(path, "hf", hf_config)
    raise FileNotFoundError(
        f"model {path!r} is neither a Hugging Face model directory nor a .gguf file "
        "(model hubs are not contacted; pass a local path, or None for the embedded default model)"
    )
