"""Checkpoint forms transformers writes and reads, served by the engine: sharded directories with
an index (and other *.safetensors files beside the shards). Greedy fp32 output must equal
transformers' token for token.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_engine import hf_greedy

from nanovllm import LLM, SamplingParams
from nanovllm.loaders.safetensors import iter_safetensors

PROMPTS = [[5, 9, 17, 33, 2, 8], [40, 41, 42]]


def resave(source, target, **save_kwargs):
    """`source` loaded by transformers and saved to `target` with `save_kwargs`, beside the
    source's tokenizer and generation config."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(target, **save_kwargs)
    for f in source.iterdir():
        if not (target / f.name).exists():
            shutil.copy(f, target / f.name)
    return target


def greedy_tokens(path, n: int = 8, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_sharded_checkpoint_reads_only_the_files_its_index_lists(checkpoint_factory, tmp_path):
    """Mistral's repositories keep consolidated.safetensors (Mistral's own tensor names) beside
    the Hugging Face shards; the index says which files are the model's."""
    from safetensors.torch import save_file

    path = resave(checkpoint_factory("qwen3"), tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    save_file({"layers.0.attention.wq.weight": torch.zeros(128, 64)}, str(path / "consolidated.safetensors"))

    assert greedy_tokens(path) == hf_greedy(path, PROMPTS, 8)

    (path / shards[-1]).unlink()
    with pytest.raises(ValueError, match=f"lists shard file.*{shards[-1]}"):
        iter_safetensors(path)
