"""A GGUF file's converted config and tokenizer and the model's loaded parameters, cached on disk
(loaders/cache.py).

Converting a GGUF file costs seconds on every start: parsing the header walks every token
string, transformers parses it again to build the tokenizer, and every tensor is dequantized.
The results depend only on the file's bytes, the code that converts and loads them, and (for
the tokenizer) the transformers release, so they are kept under
`<cache dir>/gguf/<file digest>/<code digest>/`, where the code digest covers this module,
loaders/gguf.py, models/ and layers/ (a change there could change the parameters' layout
without changing their names or shapes). Writing a new entry for a file removes its entries for
other code.

- `config.json`: the config's values: those `gguf_config_values` (loaders/gguf.py) gives a
  first start, or under transformers 4 the config class's. A start reads them into
  `SavedConfig`, a plain attribute holder, instead of the transformers config class, whose
  import pulls in most of transformers; the engine only reads attributes of the config.
- `tokenizer-transformers-<version>/`: the tokenizer as `save_pretrained` writes it.
- `params-<variant>.safetensors` + `.json`: the model's parameters right after `load_weights`
  (fused, sharded and cast as the model holds them; the variant names the model class, dtype
  and tensor-parallel rank), or after their conversion to int4 codes and scales (variant
  `...-int4`: ModelSource.load_model) and the file's digest (a truncated or altered file is rebuilt). A
  warm start maps them instead of dequantizing, and on the CPU uses the mapped pages as the
  parameters: first touches of fresh memory are what loading cost, not the copy. Parameters
  over MAX_CACHED_WEIGHT_BYTES are not cached (the copy would be many times the GGUF file).
"""
from __future__ import annotations

import json
import logging
import math
import mmap
import os
import shutil
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import xxhash

from nanovllm.loaders.cache import (
    atomic_dir, atomic_file, buffer_digest, cache_dir, cache_enabled, discard, file_digest,
)

logger = logging.getLogger("nanovllm")

# The code whose output is cached, relative to the nanovllm package (directories: their *.py).
_CODE = ("loaders/gguf.py", "loaders/gguf_header.py", "loaders/gguf_cache.py", "models", "layers")
MAX_CACHED_WEIGHT_BYTES = 4 << 30
# Properties of transformers configs that to_dict() leaves out but the engine may read.
_CONFIG_ALIASES = ("rope_scaling", "rope_theta")


def code_digest(package: Path | None = None) -> str:
    """xxh3-64 hex digest of the code listed in _CODE (paths and contents) under `package`."""
    package = package if package is not None else Path(__file__).resolve().parents[1]
    h = xxhash.xxh3_64()
    for rel in _CODE:
        path = package / rel
        for file in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            h.update(file.relative_to(package).as_posix().encode() + b"\0")
            h.update(file.read_bytes())
    return h.hexdigest()


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
        return cls(cache_dir() / "gguf" / digest / code_digest(), digest)

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
        """Write the config (the first file of a new entry) and drop the file's entries for other code."""
        if self.root.parent.is_dir():
            for other in self.root.parent.iterdir():
                if other.name != self.root.name and not other.name.startswith("."):
                    shutil.rmtree(other, ignore_errors=True)  # mapped files stay readable until unmapped
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
            from nanovllm.loaders.light_tokenizer import load_light_tokenizer

            tokenizer = load_light_tokenizer(path)
            if tokenizer is not None:
                return tokenizer
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
        # Any failure to write is a warning: the tokenizers library and safetensors report a
        # full disk with errors of their own, not OSError.
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not cache the tokenizer in %s: %s", self.tokenizer_dir, exc)

    # ---- loaded parameters ---------------------------------------------------------------
    def has_params(self, variant: str) -> bool:
        return self._params_paths(variant)[0].is_file()

    def load_params(self, model: torch.nn.Module, variant: str) -> bool:
        """Give `model` the parameters cached for `variant`; False (model untouched) when there
        are none, or they are damaged or do not fit. On the CPU the parameters become views of a
        private memory map of the file (nothing is copied; the pages are the page cache's)."""
        manifest, path = self._params_paths(variant)
        if not manifest.is_file():
            return False
        try:
            record = json.loads(manifest.read_text(encoding="utf-8"))
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if buffer_digest(mapped) != record["digest"]:
                raise ValueError("the parameter file does not match its recorded digest")
            tensors = _safetensors_views(mapped)
            params = model_tensors(model)
            if sorted(tensors) != sorted(params):
                raise ValueError("the cached parameters are not the model's")
            for name, param in params.items():
                if tensors[name].shape != param.shape or tensors[name].dtype != param.dtype:
                    raise ValueError(f"cached parameter {name} is {tensors[name].dtype} {list(tensors[name].shape)}, "
                                     f"the model's {param.dtype} {list(param.shape)}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            discard(manifest, exc)
            return False
        for name, param in params.items():
            if param.device.type == "cpu":
                param.data = tensors[name]
            else:
                param.data.copy_(tensors[name])
        return True

    def save_params(self, model: torch.nn.Module, variant: str) -> None:
        """Cache `model`'s parameters for `variant` (unless over MAX_CACHED_WEIGHT_BYTES)."""
        params = model_tensors(model)
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        if nbytes > MAX_CACHED_WEIGHT_BYTES:
            logger.info("parameters of %.1f GiB: not cached (over %d GiB)", nbytes / 2**30, MAX_CACHED_WEIGHT_BYTES >> 30)
            return
        from safetensors.torch import save_file

        manifest, path = self._params_paths(variant)
        digest: list[str] = []

        def write(tmp: Path) -> None:
            save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(tmp))
            digest.append(file_digest(tmp))

        if self._write(path, write):
            self._write(manifest, lambda tmp: tmp.write_text(json.dumps({"digest": digest[0]}), "utf-8"))

    def _params_paths(self, variant: str) -> tuple[Path, Path]:
        if not variant or not all(c.isalnum() or c in "-_." for c in variant):
            raise ValueError(f"bad cache variant name {variant!r}")
        return self.root / f"params-{variant}.json", self.root / f"params-{variant}.safetensors"

    def _write(self, dest: Path, write) -> bool:
        try:
            with atomic_file(dest) as tmp:
                write(tmp)
        except Exception as exc:  # noqa: BLE001 - as save_tokenizer: a full disk is not always an OSError
            logger.warning("could not write the cache file %s: %s", dest, exc)
            return False
        return True


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a cache entry holds of a model: its parameters and its persistent buffers (int4
    codes and scales where weights are quantized), by name."""
    tensors = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                tensors[f"{prefix}.{name}" if prefix else name] = buf
    return tensors


def _safetensors_views(mapped: mmap.mmap) -> dict[str, torch.Tensor]:
    """name -> tensor viewing its bytes in a safetensors file's memory map (the format: an 8-byte
    little-endian header length, a JSON header of dtype/shape/data_offsets, then the data)."""
    size = len(mapped)
    if size < 8:
        raise ValueError("not a safetensors file")
    header_len = int.from_bytes(mapped[:8], "little")
    if not 2 <= header_len <= size - 8:
        raise ValueError("bad safetensors header length")
    header = json.loads(bytes(mapped[8 : 8 + header_len]))
    header.pop("__metadata__", None)
    base, views = 8 + header_len, {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"unexpected dtype {info['dtype']} in the weight file")
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        if not 0 <= start <= end <= size - base or count * dtype.itemsize != end - start:
            raise ValueError(f"tensor {name} lies outside the weight file")
        if count != math.prod(info["shape"]):
            raise ValueError(f"tensor {name}'s shape does not match its size")
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
        views[name] = flat.view(info["shape"])
    return views
