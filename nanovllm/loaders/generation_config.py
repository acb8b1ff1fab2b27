"""The sampling defaults a model ships with: generation_config.json, or a GGUF file's
`general.sampling.*` metadata.

Chat models are tuned for particular settings (Qwen3 asks for temperature 0.6, top_p 0.95,
top_k 20), so, as vLLM's `--generation-config auto` does, they fill every field a request
leaves unset. Only the fields vLLM takes are read; `max_new_tokens` becomes `max_tokens`.
A value SamplingParams would refuse is ignored with a warning naming it (and so is an
unreadable file), so that a model with a sloppy config still serves; top_k 0 means "off" in
both formats and becomes -1.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")

# generation_config.json key -> SamplingParams field
HF_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key -> SamplingParams field (llama.cpp's names)
GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def check_defaults(raw: dict[str, Any], fields: dict[str, str], where: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from `raw` (a config's key -> value): the keys in
    `fields` whose values SamplingParams accepts; every other such key is logged and dropped."""
    out: dict[str, Any] = {}
    for key, name in fields.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        if name == "top_k" and value == 0 and not isinstance(value, bool):
            value = -1
        if isinstance(value, float) and name in ("top_k", "max_tokens") and value.is_integer():
            value = int(value)
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as exc:
            logger.warning("%s: ignoring %s=%r, not a valid default: %s", where, key, value, exc)
            continue
        out[name] = value
    return out


def read_hf_defaults(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("%s: ignored, not readable JSON: %s", path, exc)
        return {}
    if not isinstance(raw, dict):
        logger.warning("%s: ignored, not a JSON object", path)
        return {}
    return check_defaults(raw, HF_FIELDS, path)


def read_gguf_defaults(reader: Any, where: str) -> dict[str, Any]:
    from nanovllm.loaders.gguf import metadata_value

    raw = {}
    for key in GGUF_FIELDS:
        try:
            value = metadata_value(reader, key)
        except ValueError as exc:
            logger.warning("%s: ignoring %s: %s", where, key, exc)
            continue
        raw[key] = _decimal(value) if isinstance(value, float) else value
    return check_defaults(raw, GGUF_FIELDS, where)


def _decimal(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores f32 metadata): 0.95, not 0.949999988."""
    import numpy as np

    return float(str(np.float32(x)))


def read_generation_defaults(source: Any) -> dict[str, Any]:
    """The model's sampling defaults as SamplingParams keyword arguments ({} where it has none);
    `source` is a loaders.source.ModelSource."""
    if source.kind == "gguf":
        raw = getattr(source.hf_config, "gguf_sampling", None)  # loaders/gguf.py: also from the start-up cache
        if isinstance(raw, dict):
            return check_defaults(raw, GGUF_FIELDS, source.path)
        return read_gguf_defaults(source.gguf_reader(), source.path)
    return read_hf_defaults(source.path)
