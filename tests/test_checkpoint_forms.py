"""Checkpoint forms transformers writes and reads, served by the engine: sharded directories with
an index (and other *.safetensors files beside the shards), and MoE experts packed as
transformers 5 holds them (`save_pretrained(..., save_original_format=False)`), with one rank and
with two, and Qwen2-MoE's empty shared expert. Greedy fp32 output must equal transformers' token
for token.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_engine import hf_greedy

from nanovllm import LLM, SamplingParams
from nanovllm.loaders.safetensors import iter_safetensors

PACKED_MOE = [
    pytest.param(dict(arch="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True), id="qwen3-moe"),
    pytest.param(dict(arch="mixtral", num_local_experts=3, num_experts_per_tok=2, intermediate_size=40), id="mixtral"),
]
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


@pytest.fixture(scope="module")
def packed_moe(checkpoint_factory, tmp_path_factory):
    """shape -> the checkpoint saved with every expert's weights in two packed tensors (built once)."""
    cache = {}

    def build(shape):
        key = repr(sorted(shape.items()))
        if key not in cache:
            cache[key] = resave(checkpoint_factory(**shape), tmp_path_factory.mktemp("packed"),
                                save_original_format=False)
        return cache[key]

    return build


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("shape", PACKED_MOE)
def test_packed_experts_match_transformers(packed_moe, shape, tp):
    path = packed_moe(shape)
    names = set(dict(iter_safetensors(path)))
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight"} <= names
    assert greedy_tokens(path, tensor_parallel_size=tp) == hf_greedy(path, PROMPTS, 8)


def test_packed_experts_of_the_wrong_shape_or_absent_are_named(packed_moe):
    """A mis-shaped packed tensor is named with its shape; absent ones are listed as the names a
    checkpoint needs, the first few and how many."""
    from test_models import _fresh_model

    path = packed_moe(PACKED_MOE[0].values[0])
    weights = dict(iter_safetensors(path))
    weights["model.layers.1.mlp.experts.gate_up_proj"] = weights["model.layers.1.mlp.experts.gate_up_proj"][:, 1:]
    del weights["model.layers.0.mlp.experts.down_proj"], weights["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(ValueError) as info:
        _fresh_model(path).load_weights(weights.items())
    message = str(info.value)
    assert "model.layers.1.mlp.experts.gate_up_proj: FusedMoE experts gate_up_proj" in message
    assert "[5, 47, 64], expected [5, 48, 64]" in message
    assert "missing tensors: model.layers.0.mlp.experts.0.down_proj.weight, " in message
    assert "... (10 in all)" in message and "layers.1.mlp.experts.0.down_proj" not in message


def test_qwen2_moe_without_shared_expert_matches_transformers(checkpoint_factory):
    """shared_expert_intermediate_size=0: transformers still saves the shared expert, empty ([0, H]
    and [H, 0] weights) with a [1, H] gate, and adds its output, exactly 0."""
    path = checkpoint_factory("qwen2_moe", num_heads=2, num_kv_heads=1, num_experts=3, num_experts_per_tok=2,
                              moe_intermediate_size=24, shared_expert_intermediate_size=0, norm_topk_prob=True)
    shapes = {name: list(t.shape) for name, t in iter_safetensors(path)}
    assert shapes["model.layers.0.mlp.shared_expert.up_proj.weight"] == [0, 64]
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == [1, 64]
    assert greedy_tokens(path) == hf_greedy(path, PROMPTS, 8)
