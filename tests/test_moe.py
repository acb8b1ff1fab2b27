"""Mixture-of-experts models through the engine: the fused kernels inside a whole model, tensor
parallelism, `load_format="dummy"`, and the fast path declining them.

The logits against Hugging Face are checked in test_models.py (MoE cases of
test_prefill_then_decode_matches_hf); the kernels alone in test_fused_moe.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from checkpoints import load_model
from test_models import BLOCK_TABLES, bind_torch_caches, make_metadata
from test_tensor_parallel import assert_cleaned_up

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.cli import add_engine_args, engine_kwargs
from nanovllm.layers.moe import FusedMoE

# Both MoE features that meet tensor parallelism: sharded experts and a shared expert.
QWEN2_MOE = dict(arch="qwen2_moe", num_heads=2, num_kv_heads=2, head_dim=32, num_experts=5, num_experts_per_tok=2,
                 moe_intermediate_size=48, shared_expert_intermediate_size=32, norm_topk_prob=False)
QWEN3_MOE = dict(arch="qwen3_moe", num_experts=7, num_experts_per_tok=3, moe_intermediate_size=40,
                 norm_topk_prob=True, num_layers=3, decoder_sparse_step=2)


def greedy_tokens(llm: LLM, prompts, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels interpreted on the CPU; with CUDA, "
                    "test_fused_moe.py runs them compiled")
@pytest.mark.parametrize("shape", [QWEN3_MOE, QWEN2_MOE], ids=["qwen3-moe", "qwen2-moe-shared-expert"])
@torch.inference_mode()
def test_model_with_fused_moe_matches_reference_path(checkpoint_factory, shape):
    """The Triton path (interpreted on the CPU) inside a whole model gives the torch path's logits."""
    pytest.importorskip("triton", reason="triton is not importable")
    path = checkpoint_factory(**shape)
    device = torch.device("cpu")
    model, config = load_model(path, torch.float32, device)
    bind_torch_caches(model, config.num_hidden_layers)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(config.vocab_size, (9,), generator=gen), torch.randint(config.vocab_size, (5,), generator=gen)]
    lens = [len(p) for p in prompts]
    positions, meta = make_metadata(BLOCK_TABLES, lens, lens, num_decodes=0)
    results = []
    for devices in [(), (device.type,)]:
        for moe in moes:
            moe.fused_devices = devices
        results.append(model.compute_logits(model(torch.cat(prompts), positions, meta)))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [QWEN2_MOE, dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                                    intermediate_size=64)], ids=["qwen2-moe-shared-expert", "mixtral-8"])
def test_int4_runs_moe_models_and_leaves_their_routers_as_loaded(checkpoint_factory, shape):
    """Routers of 5 or 8 experts and a shared expert's [1, H] gate are shapes int4 cannot pack;
    quantization leaves every router in the model's dtype, as loaded."""
    from safetensors.torch import load_file

    path = checkpoint_factory(**shape)
    llm = LLM(path, device="cpu", quantization="int4", cpu_compile=False, num_kvcache_blocks=16)
    out = llm.generate([[5, 9, 17, 33]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    saved = load_file(f"{path}/model.safetensors")
    routers = {n: m for n, m in llm.engine.executor.runner.model.named_modules() if n.endswith("gate")}
    assert routers
    for name, module in routers.items():
        suffix = name.split("model.", 1)[-1] + ".weight"  # Mixtral's checkpoint says block_sparse_moe for mlp
        loaded = next(w for k, w in saved.items() if k.replace(".block_sparse_moe.", ".mlp.").endswith(suffix))
        torch.testing.assert_close(module.weight, loaded.to(torch.bfloat16), atol=0, rtol=0)
    llm.shutdown()


def test_tp2_matches_tp1(checkpoint_factory):
    path = str(checkpoint_factory(**QWEN2_MOE))
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42], list(range(3, 30))]
    expected = greedy_tokens(LLM(path, device="cpu"), prompts)
    llm = LLM(path, device="cpu", tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    try:
        assert greedy_tokens(llm, prompts) == expected
    finally:
        llm.shutdown()
    assert_cleaned_up(pids)


def test_tp_refuses_an_expert_width_that_does_not_split(checkpoint_factory, monkeypatch):
    import nanovllm.layers.moe as moe

    monkeypatch.setattr(moe, "tp_size", lambda: 2)
    monkeypatch.setattr(moe, "tp_rank", lambda: 0)
    with pytest.raises(ValueError, match="moe intermediate_size=7"):
        FusedMoE(num_experts=3, top_k=1, hidden_size=8, intermediate_size=7, renormalize=True)


def test_expert_weights_are_checked_by_shape_and_shard(checkpoint_factory):
    moe = FusedMoE(num_experts=3, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
    with pytest.raises(ValueError, match=r"expert 1 up: .*\[5, 8\], expected \[6, 8\]"):
        moe.weight_loader(moe.w13, torch.zeros(5, 8), (1, "up"))
    with pytest.raises(ValueError, match="shard_id"):
        moe.weight_loader(moe.w13, torch.zeros(6, 8), (3, "up"))
    up = torch.randn(6, 8)
    moe.weight_loader(moe.w13, up, (2, "up"))
    assert torch.equal(moe.w13[2, 6:], up)


def test_packed_experts_load_this_ranks_slices(monkeypatch):
    """transformers' [E, 2I, H] gate_up_proj and [E, H, I] down_proj of every expert: rank 1 of 2
    takes the second half of the gate rows, of the up rows and of down's columns."""
    import nanovllm.layers.moe as moe

    monkeypatch.setattr(moe, "tp_size", lambda: 2)
    monkeypatch.setattr(moe, "tp_rank", lambda: 1)
    layer = FusedMoE(num_experts=3, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
    gate_up, down = torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    layer.weight_loader(layer.w13, gate_up, "gate_up")
    layer.weight_loader(layer.w2, down, "down")
    assert torch.equal(layer.w13, torch.cat([gate_up[:, 3:6], gate_up[:, 9:12]], dim=1))
    assert torch.equal(layer.w2, down[:, :, 3:])
    with pytest.raises(ValueError, match=r"gate_up_proj: .*\[3, 6, 8\], expected \[3, 12, 8\]"):
        layer.weight_loader(layer.w13, gate_up[:, :6], "gate_up")


def test_load_format_dummy_builds_the_model_from_config_json_alone(checkpoint_factory, tmp_path):
    source = checkpoint_factory(**QWEN3_MOE)
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path), device="cpu")
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy")
    model = llm.engine.executor.runner.model
    for name, param in model.named_parameters():
        assert param.abs().max() <= 1e-3 and param.std() > 1e-4, name  # random, small, not constant
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    out = greedy_tokens(llm, [[1, 2, 3]], n=4)[0]
    assert len(out) == 4 and all(0 <= t < vocab for t in out)
    # no tokenizer files: text prompts are refused as such (not read as an empty prompt)
    with pytest.raises(ValueError, match="no tokenizer: pass prompts as lists of token ids"):
        llm.generate(["Hello world"], use_tqdm=False)
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), device="cpu", load_format="pt")


def test_cli_takes_load_format():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--load-format", "dummy"])
    assert engine_kwargs(args)["load_format"] == "dummy"


def test_persistent_kernel_declines_moe_models(checkpoint_factory):
    from nanovllm.fastpath.decoder import unsupported_reason

    model, _ = load_model(checkpoint_factory(**QWEN3_MOE), torch.float32, torch.device("cpu"))
    assert unsupported_reason(model) == "mixture-of-experts MLP layers"
    dense, _ = load_model(checkpoint_factory("qwen3"), torch.float32, torch.device("cpu"))
    assert unsupported_reason(dense) is None


def test_reference_without_host_reads_gives_the_same_sum():
    """The reference as it runs off the CPU (every expert on every token, no host sync) equals
    the one that runs only the chosen experts."""
    from nanovllm.layers import moe

    gen = torch.Generator().manual_seed(0)
    x, logits = torch.randn(6, 16, generator=gen), torch.randn(6, 5, generator=gen)
    w13, w2 = torch.randn(5, 24, 16, generator=gen), torch.randn(5, 16, 12, generator=gen)
    weights, ids = moe.route_reference(logits, 2, True)
    sparse = moe.experts_reference(x, w13, w2, weights, ids, host_sync=True)
    dense = moe.experts_reference(x, w13, w2, weights, ids, host_sync=False)
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)
    assert not torch.equal(sparse, torch.zeros_like(sparse))
