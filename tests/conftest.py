"""Shared fixtures: tiny checkpoints built once per test run (pytest session scope).

Triton kernels run on CPU under TRITON_INTERPRET=1; it must be set before triton compiles
anything, so it is set here when there is no CUDA device.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import make_checkpoint, make_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Tests never read or write the user's cache of converted models (loaders/cache.py). CPU
    engines decode with the eager model unless a test asks for the compiled decode (cpu_compile=
    True, or NANOVLLM_CPU_COMPILE unset): building its packages for every tiny model's shape would
    take minutes, and tests/test_cpu_compiled_decode.py covers it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVLLM_CACHE_DIR", str(tmp_path_factory.mktemp("nanovllm-cache")))
        mp.setenv("NANOVLLM_CPU_COMPILE", "0")
        yield


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory, tokenizer_dir):
    """Returns build(arch='qwen3', **shape) -> path, caching identical requests."""
    cache: dict = {}

    def build(arch: str = "qwen3", **kwargs):
        key = (arch, repr(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(f"{arch}"), tokenizer_dir, arch, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def qwen3_tiny(checkpoint_factory):
    return checkpoint_factory("qwen3")
