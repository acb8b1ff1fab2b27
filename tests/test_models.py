"""Our Llama/Qwen2/Qwen3 models against Hugging Face transformers, on tiny random checkpoints.

Each case loads one checkpoint with `iter_safetensors` + `load_weights`, runs a batched prefill of
two sequences of different lengths through the paged torch attention backend, then one decode
step per sequence, and compares the logits at every computed position with HF's fp32 forward.
Tensors HF initialises to constants (biases to 0, norm weights to 1) are randomised first, so
the comparison would catch a bias or norm weight that is loaded into the wrong place.

The sharding tests fake a multi-rank world (torch.distributed patched with monkeypatch) to check
which slice of each HF tensor every rank holds; one test then runs a real 2-rank gloo prefill
(this process plus one spawned peer) and compares it with the single-rank model.
"""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from checkpoints import make_checkpoint

from nanovllm.attention.backend import bind_kv_cache
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.loaders.safetensors import iter_safetensors
from nanovllm.models.registry import get_model_class

BLOCK_SIZE = 4
NUM_BLOCKS = 16
# Two sequences' block tables: scattered, non-contiguous blocks; 4 blocks of 4 hold 16 tokens.
BLOCK_TABLES = torch.tensor([[5, 2, 9, 0], [1, 14, 3, 7]], dtype=torch.int32)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Qwen3's long-context recipe, scaled down: an original context of 16 positions, so that the
# test's 10-16-token sequences sit where YaRN interpolates some frequencies and not others.
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# Also the tensor-parallel case: one KV head (replicated over 2 ranks), a vocabulary that does not
# split evenly, tied embeddings, and a bias on every projection.
LLAMA_TP_SHAPE = dict(num_heads=4, num_kv_heads=1, head_dim=64, vocab_size=383, attention_bias=True, mlp_bias=True)

CASES = [
    pytest.param("qwen3", {}, id="qwen3-gqa2-hd32-tied"),
    pytest.param("qwen3", dict(num_kv_heads=4, head_dim=64, tie_word_embeddings=False), id="qwen3-mha-hd64-untied"),
    pytest.param("qwen2", dict(num_heads=2, num_kv_heads=1, head_dim=32), id="qwen2-qkv-bias-gqa2-tied"),
    pytest.param("llama", LLAMA_TP_SHAPE, id="llama-gqa4-hd64-biases-odd-vocab"),
    pytest.param(
        "llama", dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING), id="llama3-rope-scaling"
    ),
    pytest.param("qwen3", dict(rope_scaling=YARN_SCALING), id="qwen3-yarn-rope-scaling"),
    pytest.param("llama", dict(rope_scaling={"rope_type": "linear", "factor": 3.0}), id="llama-linear-rope-scaling"),
    # Mixture of experts: odd expert counts, top-k 1 and 8, renormalised or not, dense layers
    # between sparse ones (decoder_sparse_step, mlp_only_layers), intermediate sizes off the blocks.
    pytest.param("qwen3_moe", dict(num_layers=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48,
                                   norm_topk_prob=False, decoder_sparse_step=2), id="qwen3-moe-e5-k2-sparse-step2"),
    pytest.param("qwen3_moe", dict(num_experts=7, num_experts_per_tok=1, moe_intermediate_size=40, norm_topk_prob=True,
                                   mlp_only_layers=[0], tie_word_embeddings=False), id="qwen3-moe-e7-k1-mlp-only-layer0"),
    pytest.param("qwen3_moe", dict(num_experts=8, num_experts_per_tok=8, moe_intermediate_size=24, norm_topk_prob=True),
                 id="qwen3-moe-e8-k8-renorm"),
    pytest.param("qwen2_moe", dict(num_layers=3, num_heads=2, num_kv_heads=1, num_experts=5, num_experts_per_tok=2,
                                   moe_intermediate_size=48, shared_expert_intermediate_size=40, norm_topk_prob=False,
                                   mlp_only_layers=[1]), id="qwen2-moe-e5-k2-shared-expert-mlp-only-layer1"),
    pytest.param("qwen2_moe", dict(num_heads=2, num_kv_heads=1, num_experts=9, num_experts_per_tok=8,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True,
                                   decoder_sparse_step=2), id="qwen2-moe-e9-k8-renorm-sparse-step2"),
    pytest.param("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=48,
                                 tie_word_embeddings=False), id="mixtral-e5-k2"),
    pytest.param("mixtral", dict(num_local_experts=7, num_experts_per_tok=1, intermediate_size=24), id="mixtral-e7-k1"),
]


@pytest.fixture(scope="session")
def build_checkpoint(checkpoint_factory, tmp_path_factory, tokenizer_dir):
    """checkpoint_factory, except for dict-valued kwargs (rope_scaling), which its cache key
    cannot hash; those are built directly."""

    def build(arch: str, **kwargs) -> str:
        if any(isinstance(v, dict) for v in kwargs.values()):
            return make_checkpoint(tmp_path_factory.mktemp(arch), tokenizer_dir, arch, **kwargs)
        return checkpoint_factory(arch, **kwargs)

    return build


def make_metadata(
    block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int], num_decodes: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata for one step in which sequence i computes the last
    `query_lens[i]` of its `context_lens[i]` tokens (decodes first, query length 1)."""
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(context_lens, query_lens)])
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    blocks = block_tables[seq_of_token, positions // BLOCK_SIZE].long()
    meta = AttentionMetadata(
        slot_mapping=blocks * BLOCK_SIZE + positions % BLOCK_SIZE,
        query_start_loc=torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(context_lens),
    )
    return positions, meta


def randomize_constant_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy with the biases and norm weights (HF inits them to 0 and 1) made random."""
    gen = torch.Generator().manual_seed(1)
    out = dict(weights)
    for name, t in weights.items():
        if name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("norm.weight"):
            out[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
    return out


def bind_torch_caches(model, num_layers: int) -> None:
    """Zeroed paged K/V caches for every layer, served by the torch reference backend."""
    attn = model.model.layers[0].self_attn
    shape = (NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    caches = [torch.zeros(shape) for _ in range(2 * num_layers)]
    bind_kv_cache(model, caches[:num_layers], caches[num_layers:], TorchAttentionBackend())


def load_both(path):
    """(our model with torch-backend caches bound, HF model), holding identical weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = randomize_constant_tensors(dict(iter_safetensors(path)))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # HF loaded the checkpoint; the randomised tensors go over it (by name: transformers packs
    # MoE experts under other names, which only its from_pretrained converts).
    randomized = {name: t for name, t in weights.items() if name.endswith((".bias", "norm.weight"))}
    result = hf.load_state_dict(randomized, strict=False)
    assert not result.unexpected_keys

    config = AutoConfig.from_pretrained(path)
    ours = get_model_class(config)(config)
    ours.load_weights(weights.items())
    bind_torch_caches(ours, config.num_hidden_layers)
    return ours, hf


@pytest.mark.parametrize("arch, shape", CASES)
@torch.inference_mode()
def test_prefill_then_decode_matches_hf(build_checkpoint, arch, shape):
    path = build_checkpoint(arch, **shape)
    ours, hf = load_both(path)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (11,), generator=gen), torch.randint(vocab, (6,), generator=gen)]

    # Prefill both prompts in one batch.
    lens = [len(p) for p in prompts]
    positions, meta = make_metadata(BLOCK_TABLES, lens, lens, num_decodes=0)
    logits = ours.compute_logits(ours(torch.cat(prompts), positions, meta))
    expected = torch.cat([hf(p[None]).logits[0] for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    # One decode step each, reading the prompts back from the paged cache.
    new_tokens = torch.randint(vocab, (2,), generator=gen)
    positions, meta = make_metadata(BLOCK_TABLES, [n + 1 for n in lens], [1, 1], num_decodes=2)
    logits = ours.compute_logits(ours(new_tokens, positions, meta))
    expected = torch.stack([hf(torch.cat([p, t[None]])[None]).logits[0, -1] for p, t in zip(prompts, new_tokens)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_cpu_step_derives_attention_plan_and_rotary_once(checkpoint_factory, monkeypatch):
    """On the CPU a decode step's attention plan (slot check, block ids, mask) is built by the
    first layer and kept in the metadata, and the rotary cos/sin are gathered once, where every
    layer used to build its own; the HF comparison above runs this path."""
    import nanovllm.attention.torch_backend as torch_backend
    from nanovllm.layers.rotary import RotaryEmbedding

    path = checkpoint_factory("qwen3", num_layers=3)
    ours, _ = load_both(path)
    plans, gathers = [], []
    real_plan, real_cos_sin = torch_backend._StepPlan.__init__, RotaryEmbedding.cos_sin

    def counting_plan(self, *args):
        plans.append(1)
        real_plan(self, *args)

    def counting_cos_sin(self, positions, dtype):
        before = self._last
        result = real_cos_sin(self, positions, dtype)
        gathers.append(self._last is not before)
        return result

    monkeypatch.setattr(torch_backend._StepPlan, "__init__", counting_plan)
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", counting_cos_sin)
    for step in range(2):  # a second step: new metadata and positions, so a new plan and gather
        positions, meta = make_metadata(BLOCK_TABLES, [5 + step, 3 + step], [1, 1], num_decodes=2)
        ours(torch.tensor([7, 9]), positions, meta)
        assert len(plans) == step + 1 and list(meta.derived) == [f"torch_step_plan:{BLOCK_SIZE}"]
        assert gathers[3 * step:] == [True, False, False]


def test_rotary_reuses_cos_sin_only_for_equal_positions():
    """The CPU cos/sin reuse compares the positions' values and the dtype, so positions changed
    in place or another dtype get their own; results equal a fresh embedding's each time."""
    from nanovllm.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 16, generator=gen), torch.randn(3, 8, generator=gen)
    rotary = RotaryEmbedding(8, 64)
    positions = torch.tensor([1, 2, 3])

    def fresh(pos, x, y):
        return RotaryEmbedding(8, 64).rotate(pos, x, y)

    first = rotary.rotate(positions, q, k)
    cached = rotary._last
    again = rotary.rotate(torch.tensor([1, 2, 3]), q, k)  # equal values, another tensor: reused
    assert rotary._last is cached
    for got, want in zip(again, first):
        assert torch.equal(got, want)
    positions.add_(5)  # changed in place: gathered again
    moved = rotary.rotate(positions, q, k)
    assert rotary._last is not cached
    for got, want, old in zip(moved, fresh(positions, q, k), first):
        assert torch.equal(got, want) and not torch.equal(got, old)
    half = rotary.rotate(positions, q.bfloat16(), k.bfloat16())  # another dtype: gathered again
    for got, want in zip(half, fresh(positions, q.bfloat16(), k.bfloat16())):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="q is"):
        rotary.rotate(positions, q, k.bfloat16())


def _fresh_model(path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return get_model_class(config)(config)


def test_load_weights_accepts_ignored_and_tied_tensors(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    weights = dict(iter_safetensors(path))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # tied: skipped
    model = _fresh_model(path)
    model.load_weights(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_weights_reports_missing_unexpected_and_misshaped(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    weights = dict(iter_safetensors(path))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    del weights["model.norm.weight"]
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    weights["model.layers.0.self_attn.q_proj.weight"] = weights["model.layers.0.self_attn.q_proj.weight"][:-1]
    with pytest.raises(ValueError) as info:
        _fresh_model(path).load_weights(weights.items())
    message = str(info.value)
    assert "missing tensors" in message
    assert "model.layers.1.self_attn.k_proj.weight" in message and "model.norm.weight" in message
    assert "unexpected tensors" in message and "model.layers.0.mlp.extra_proj.weight" in message
    assert "shape mismatches" in message and "model.layers.0.self_attn.q_proj.weight" in message
    assert "[127, 64]" in message  # the shape found, next to the one expected


def test_iter_safetensors_without_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        iter_safetensors(tmp_path)


def test_registry():
    from nanovllm.models.qwen2 import Qwen2ForCausalLM

    assert get_model_class(SimpleNamespace(architectures=["Qwen2ForCausalLM"])) is Qwen2ForCausalLM
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="no architecture"):
        get_model_class(SimpleNamespace())


# ---- rotary config -----------------------------------------------------------------------


def test_rope_config_v4_and_v5_styles_agree():
    from nanovllm.layers.rotary import build_rotary

    v5 = SimpleNamespace(rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0}, max_position_embeddings=32)
    v4 = SimpleNamespace(
        rope_theta=500000.0, rope_scaling={**LLAMA3_SCALING, "type": "llama3"}, max_position_embeddings=32
    )
    plain = SimpleNamespace(rope_theta=500000.0, rope_scaling=None, max_position_embeddings=32)
    a, b, c = (build_rotary(cfg, 32).cos_sin_cache for cfg in (v5, v4, plain))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_rope_unsupported_scaling_raises():
    from nanovllm.layers.rotary import build_rotary

    config = SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        build_rotary(config, 32)
    config = SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "linear"}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="linear rope scaling is missing 'factor'"):
        build_rotary(config, 32)


def test_context_length_follows_rope_scaling():
    """YaRN extends the original context by `factor` (Qwen3: 32,768 x 4, while its config keeps
    max_position_embeddings at 40,960), linear extends max_position_embeddings by `factor`, and
    the cos/sin table covers that many positions."""
    from nanovllm.layers.rotary import build_rotary, context_length

    def config(scaling):
        return SimpleNamespace(rope_theta=1e6, rope_scaling=scaling, max_position_embeddings=40960)

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(config(yarn)) == 131072
    assert context_length(config({"rope_type": "linear", "factor": 2.0})) == 81920
    assert context_length(config(LLAMA3_SCALING)) == 40960
    assert context_length(config(None)) == 40960
    small = SimpleNamespace(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=64)
    assert build_rotary(small, 32).cos_sin_cache.shape == (256, 32)  # original context: the config's 64


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.5},
        LLAMA3_SCALING,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.707},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "attention_factor": 1.3,
         "truncate": False},
    ],
    ids=["default", "linear", "llama3", "yarn-qwen3", "yarn-betas", "yarn-mscale", "yarn-attention-factor-untruncated"],
)
def test_rope_frequencies_equal_transformers(scaling):
    """Inverse frequencies and the cos/sin factor of each supported rope type, against
    transformers' own functions on the same config (exactly: the same fp32 operations)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary import rope_frequencies, rope_parameters

    config = Qwen3Config(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
                         rope_theta=1000000.0, rope_scaling=dict(scaling))
    theta, ours_scaling = rope_parameters(config)
    inv_freq, factor = rope_frequencies(128, theta, ours_scaling, config.max_position_embeddings)
    rope_type = ours_scaling["rope_type"]
    if rope_type == "default":
        expected, expected_factor = 1.0 / theta ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128), 1.0
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    assert torch.equal(inv_freq, expected.float())
    assert factor == pytest.approx(expected_factor, rel=1e-12)


# ---- tensor-parallel sharding (a faked 2- or 4-rank world, no processes) -----------------


@pytest.fixture
def fake_world(monkeypatch):
    """fake_world(rank, size): make nanovllm.distributed report that rank and world size."""
    import torch.distributed as dist

    def set_world(rank: int, size: int) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: size)

    return set_world


def test_qkv_shards_replicate_kv_heads(fake_world):
    from nanovllm.layers.linear import QKVParallelLinear

    hidden, hd = 8, 2
    full = {"q": torch.randn(4 * hd, hidden), "k": torch.randn(2 * hd, hidden), "v": torch.randn(2 * hd, hidden)}
    for rank in range(4):  # 4 query heads, 2 KV heads, 4 ranks: each KV head on two ranks
        fake_world(rank, 4)
        layer = QKVParallelLinear(hidden, hd, 4, 2)
        for shard_id, w in full.items():
            layer.weight.weight_loader(layer.weight, w, shard_id)
        q, k, v = layer.weight.split([hd, hd, hd])
        torch.testing.assert_close(q, full["q"][rank * hd : (rank + 1) * hd])
        torch.testing.assert_close(k, full["k"][(rank // 2) * hd : (rank // 2 + 1) * hd])
        torch.testing.assert_close(v, full["v"][(rank // 2) * hd : (rank // 2 + 1) * hd])


def test_sharding_shape_errors(fake_world):
    from nanovllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    fake_world(0, 2)
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        QKVParallelLinear(8, 2, 3, 1)
    fake_world(0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        QKVParallelLinear(8, 2, 12, 3)
    fake_world(1, 2)
    with pytest.raises(ValueError, match="input_size=7"):
        RowParallelLinear(7, 4)
    layer = ColumnParallelLinear(4, 6)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear weight.*\[6, 5\]"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 5))


def test_row_merged_and_vocab_shards(fake_world):
    from nanovllm.layers.embedding import VocabParallelEmbedding
    from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    fake_world(1, 2)
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    merged = MergedColumnParallelLinear(4, [6, 6])
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged.weight, torch.cat([gate[3:], up[3:]]))
    row = RowParallelLinear(6, 4, bias=True)
    row.weight.weight_loader(row.weight, down)
    row.bias.weight_loader(row.bias, torch.arange(4.0))
    torch.testing.assert_close(row.weight, down[:, 3:])
    torch.testing.assert_close(row.bias, torch.arange(4.0))  # whole on every rank, added once

    table = torch.randn(5, 3)  # 5 rows over 2 ranks: 3 + 2, the last rank padded with zeros
    emb = VocabParallelEmbedding(5, 3)
    emb.weight.weight_loader(emb.weight, table)
    torch.testing.assert_close(emb.weight, torch.cat([table[3:], torch.zeros(1, 3)]))


# ---- tensor parallelism for real: 2 gloo ranks against the single-rank model --------------


def _plain_config(path) -> SimpleNamespace:
    """The HF config as plain attributes, so the worker process need not import transformers."""
    from transformers import AutoConfig

    return SimpleNamespace(**AutoConfig.from_pretrained(path).to_dict())


def _prefill_logits(config, path) -> torch.Tensor:
    """Build our model on this rank, load it, and return the logits of a 2-sequence prefill."""
    ours = get_model_class(config)(config)
    ours.load_weights(randomize_constant_tensors(dict(iter_safetensors(path))).items())
    bind_torch_caches(ours, config.num_hidden_layers)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(config.vocab_size, (9,), generator=gen), torch.randint(config.vocab_size, (5,), generator=gen)]
    lens = [len(p) for p in prompts]
    positions, meta = make_metadata(BLOCK_TABLES, lens, lens, num_decodes=0)
    with torch.inference_mode():
        return ours.compute_logits(ours(torch.cat(prompts), positions, meta))


def _tp_rank_main(rank: int, world: int, init_file: str, config, path: str) -> torch.Tensor:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        return _prefill_logits(config, path)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tensor_parallel_matches_single_rank(checkpoint_factory, tmp_path):
    """Rank 1 runs in a spawned process, rank 0 in this one (one interpreter start, not two)."""
    import multiprocessing

    path = checkpoint_factory("llama", **LLAMA_TP_SHAPE)
    config = _plain_config(path)
    expected = _prefill_logits(config, path)

    init_file = str(tmp_path / "init")
    peer = multiprocessing.get_context("spawn").Process(target=_tp_rank_main, args=(1, 2, init_file, config, str(path)))
    peer.start()
    try:
        logits = _tp_rank_main(0, 2, init_file, config, str(path))
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
