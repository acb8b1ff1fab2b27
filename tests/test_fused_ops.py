"""Fused Triton ops (layers/fused.py) against the torch reference paths they replace.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by conftest.py) at tiny shapes; with
CUDA the same tests run compiled on the GPU, and the `gpu` tests add the real Qwen3-0.6B shapes
in bf16. Each case compares the kernel with the reference module (norm.py, rotary.py,
activation.py) on identical inputs; the last group checks that a whole model with fused ops forced
on gives the torch path's logits.

Expected agreement: every rounding the reference does is reproduced, so the residual sum and
rotary without a norm are bit-exact; a norm may differ by a unit or two in the last place, because
its fp32 variance is summed in another order (and SiLU's exp is another approximation). Units in
the last place are measured at max(|a|, |b|) or, for q/k (where rotary's differences can cancel),
at each head's largest value. The Triton 3.9 interpreter rounds fp32 -> bf16 casts toward zero
where the GPU rounds to nearest even, so bf16 on CPU is only checked to a few units; bf16 exactness
is checked on CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the fused kernels cannot run")

from nanovllm.attention.backend import bind_kv_cache  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from nanovllm.layers import fused  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.norm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding, apply_qk_norm_rope  # noqa: E402
from nanovllm.models.registry import get_model_class  # noqa: E402
from checkpoints import load_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
INTERPRETED = not HAS_CUDA
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device (real shapes are too slow for the interpreter)"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# Most units in the last place a norm (or SiLU) may be off by; see the module docstring.
MAX_ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 8 if INTERPRETED else 2}


def exact_here(dtype: torch.dtype) -> bool:
    """Whether the ops the reference rounds identically should be bit-exact on this device."""
    return dtype != torch.bfloat16 or not INTERPRETED


def ulps(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Largest |actual - expected| in units in the last place of actual's dtype, at magnitude
    max(|actual|, |expected|, scale)."""
    a, e = actual.double(), expected.double()
    mag = torch.maximum(a.abs(), e.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.double())
    _, exponent = torch.frexp(mag.clamp_min(torch.finfo(actual.dtype).tiny))  # mag = m * 2**exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(mag), exponent - 1 - MANTISSA_BITS[actual.dtype])
    return float(((a - e).abs() / ulp).max()) if a.numel() else 0.0


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def make_norm(size: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(size, EPS).to(DEVICE, dtype)  # fused=False: the torch reference
    norm.weight.copy_(1.0 + rand(size, dtype=torch.float32, seed=seed, scale=0.2))
    return norm


# ---- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@torch.inference_mode()
def test_rms_norm(dtype, num_tokens):
    hidden = 96  # not a power of two: the kernel masks its tile
    norm = make_norm(hidden, dtype, seed=1)
    wide = rand(num_tokens, hidden + 32, dtype=dtype, seed=2, scale=3.0)
    x = wide[:, 16 : 16 + hidden]  # a row-strided view
    out = fused.rms_norm(x, norm.weight, EPS)
    expected = norm(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert ulps(out, expected) <= MAX_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@torch.inference_mode()
def test_fused_add_rms_norm(dtype, num_tokens):
    hidden = 96
    norm = make_norm(hidden, dtype, seed=3)
    x = rand(num_tokens, 2, hidden, dtype=dtype, seed=4)[:, 1]  # strided
    residual = rand(num_tokens, hidden, dtype=dtype, seed=5)
    expected, expected_residual = norm(x, residual.clone())
    out, new_residual = fused.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert new_residual.data_ptr() == residual.data_ptr() or num_tokens == 0  # updated in place
    if exact_here(dtype):
        assert torch.equal(new_residual, expected_residual)
    else:
        assert ulps(new_residual, expected_residual) <= 1
    assert ulps(out, expected) <= MAX_ULPS[dtype]


@torch.inference_mode()
def test_fused_add_rms_norm_strided_residual_and_3d():
    """A residual that cannot be updated in place is copied; the returned one is always right."""
    hidden = 48
    norm = make_norm(hidden, torch.float32, seed=6)
    x = rand(3, 2, hidden, dtype=torch.float32, seed=7)
    residual = rand(6, hidden * 2, dtype=torch.float32, seed=8)[:, ::2].view(3, 2, hidden)  # stride(-1) == 2
    expected, expected_residual = norm(x, residual)
    out, new_residual = fused.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert out.shape == (3, 2, hidden) and new_residual.shape == (3, 2, hidden)
    assert torch.equal(new_residual, expected_residual)
    assert ulps(out, expected) <= MAX_ULPS[torch.float32]


# ---- SiLU and mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@torch.inference_mode()
def test_silu_and_mul(dtype, num_tokens):
    inter = 40
    x = rand(num_tokens, 2 * inter + 8, dtype=dtype, seed=9, scale=4.0)[:, 8:]  # strided, large |gate| too
    out = fused.silu_and_mul(x)
    expected = SiluAndMul()(x)
    assert out.shape == (num_tokens, inter)
    assert ulps(out, expected) <= MAX_ULPS[dtype]


@torch.inference_mode()
def test_silu_and_mul_3d():
    x = rand(2, 3, 2 * 24, dtype=torch.float32, seed=10)
    assert ulps(fused.silu_and_mul(x), SiluAndMul()(x)) <= MAX_ULPS[torch.float32]


# ---- q/k norm + rotary -----------------------------------------------------------------------


def run_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, qk_norm, layout, pos_dtype=torch.int64, seed=0):
    """(fused q, k, untouched v, reference q, k, v) for q/k sliced out of a packed qkv tensor."""
    max_pos = 64
    rotary = RotaryEmbedding(head_dim, max_pos, theta=10000.0).to(DEVICE)
    q_norm = make_norm(head_dim, dtype, seed=seed + 1) if qk_norm else None
    k_norm = make_norm(head_dim, dtype, seed=seed + 2) if qk_norm else None
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = rand(num_tokens, sum(sizes), dtype=dtype, seed=seed + 3, scale=2.0)
    gen = torch.Generator().manual_seed(seed + 4)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE, pos_dtype)

    ref_q, ref_k, ref_v = qkv.clone().split(sizes, dim=-1)
    ref_q, ref_k = apply_qk_norm_rope(rotary, positions, ref_q, ref_k, q_norm, k_norm)

    q, k, v = qkv.split(sizes, dim=-1)
    if layout == "3d":
        q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    out_q, out_k = fused.qk_norm_rope(
        q, k, positions, rotary.cos_sin_cache,
        q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None, EPS,
    )
    assert out_q is q and out_k is k  # in place, same views back
    q_shape, k_shape = (num_tokens, num_heads, head_dim), (num_tokens, num_kv_heads, head_dim)
    return out_q.reshape(q_shape), out_k.reshape(k_shape), v, ref_q.reshape(q_shape), ref_k.reshape(k_shape), ref_v


def head_scale(t: torch.Tensor) -> torch.Tensor:
    return t.float().abs().amax(dim=-1, keepdim=True) if t.numel() else t.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@torch.inference_mode()
def test_qk_norm_rope(dtype, qk_norm, num_tokens):
    q, k, v, ref_q, ref_k, ref_v = run_qk(num_tokens, 4, 2, 32, dtype, qk_norm, layout="2d")
    assert torch.equal(v, ref_v)  # v, between and beside q and k, is untouched
    if not qk_norm and exact_here(dtype):
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    else:
        assert ulps(q, ref_q, head_scale(ref_q)) <= MAX_ULPS[dtype]
        assert ulps(k, ref_k, head_scale(ref_k)) <= MAX_ULPS[dtype]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, layout, pos_dtype",
    [(3, 1, 64, "3d", torch.int32), (6, 6, 16, "2d", torch.int64), (2, 1, 24, "3d", torch.int64)],
    ids=["gqa3-hd64-3d-int32", "mha6-hd16", "hd24-not-pow2"],
)
@torch.inference_mode()
def test_qk_norm_rope_shapes(num_heads, num_kv_heads, head_dim, layout, pos_dtype):
    q, k, v, ref_q, ref_k, ref_v = run_qk(3, num_heads, num_kv_heads, head_dim, torch.float32, True, layout, pos_dtype)
    assert torch.equal(v, ref_v)
    assert ulps(q, ref_q, head_scale(ref_q)) <= MAX_ULPS[torch.float32]
    assert ulps(k, ref_k, head_scale(ref_k)) <= MAX_ULPS[torch.float32]


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                (torch.bfloat16, torch.bfloat16)], ids=["fp32", "fp32-to-fp16", "bf16"])
@torch.inference_mode()
def test_qk_norm_rope_stores_kv_like_store_kv(dtype, cache_dtype):
    """With kv_write the same launch leaves q/k as without it and writes the caches exactly as
    rotary followed by the reference store would; slot -1 (padding) writes nothing."""
    from nanovllm.attention.metadata import KVCacheWrite
    from nanovllm.attention.torch_backend import store_kv as reference_store

    num_tokens, num_heads, num_kv_heads, head_dim, max_pos, block_size = 6, 4, 2, 32, 64, 4
    rotary = RotaryEmbedding(head_dim, max_pos, theta=10000.0).to(DEVICE)
    q_norm, k_norm = make_norm(head_dim, dtype, seed=31), make_norm(head_dim, dtype, seed=32)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = rand(num_tokens, sum(sizes), dtype=dtype, seed=33, scale=2.0)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=torch.Generator().manual_seed(34)).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 13, 7, -1], device=DEVICE)
    shape = (5, block_size, num_kv_heads, head_dim)
    k_cache = rand(*shape, dtype=cache_dtype, seed=35)
    v_cache = rand(*shape, dtype=cache_dtype, seed=36)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()

    ref_q, ref_k, ref_v = qkv.clone().split(sizes, dim=-1)
    fused.qk_norm_rope(ref_q, ref_k, positions, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, EPS)
    real = slots >= 0
    as_heads = (-1, num_kv_heads, head_dim)
    reference_store(ref_k.reshape(as_heads)[real], ref_v.reshape(as_heads)[real], ref_k_cache, ref_v_cache, slots[real])

    q, k, v = qkv.split(sizes, dim=-1)
    fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, EPS,
                       KVCacheWrite(v, k_cache, v_cache, slots))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert torch.equal(k_cache, ref_k_cache)
    assert torch.equal(v_cache, ref_v_cache)

    with pytest.raises(ValueError, match="caches"):
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, None, None, EPS,
                           KVCacheWrite(v, k_cache[:, :, :1], v_cache[:, :, :1], slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, None, None, EPS,
                           KVCacheWrite(v, k_cache, v_cache, slots[:2]))
    with pytest.raises(ValueError, match="v "):
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, None, None, EPS,
                           KVCacheWrite(v[:3], k_cache, v_cache, slots))
    with pytest.raises(ValueError, match="fused kernel"):  # the torch path never stores
        apply_qk_norm_rope(rotary, positions, q, k, None, None, KVCacheWrite(v, k_cache, v_cache, slots))


def test_bad_inputs_raise():
    x, w = torch.zeros(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        fused.rms_norm(x.int(), w, EPS)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, w[:7], EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.fused_add_rms_norm(x, x.half(), w, EPS)
    with pytest.raises(ValueError, match="odd"):
        fused.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    cache = RotaryEmbedding(8, 16).to(DEVICE).cos_sin_cache
    q, k = torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 8, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="both"):
        fused.qk_norm_rope(q, k, pos, cache, torch.ones(8, device=DEVICE), None, EPS)
    with pytest.raises(ValueError, match="number of tokens"):
        fused.qk_norm_rope(q, k, pos[:1], cache, None, None, EPS)
    with pytest.raises(ValueError, match="q_weight"):
        fused.qk_norm_rope(q, k, pos, cache, torch.ones(8, device=DEVICE).half(), torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="contiguous last axis"):
        fused.qk_norm_rope(torch.zeros(16, 2, device=DEVICE).t(), k, pos, cache, None, None, EPS)


# ---- the whole model -------------------------------------------------------------------------

BLOCK_SIZE = 4


def set_fused_devices(model: torch.nn.Module, devices: tuple[str, ...]) -> int:
    """The test-only switch: make every fused-capable module run its kernel on `devices`."""
    modules = [m for m in model.modules() if hasattr(m, "fused_devices")]
    for m in modules:
        m.fused_devices = devices
    return len(modules)


def build_model(path, dtype: torch.dtype):
    """The model as the runner builds it (checkpoints.load_model: random norm weights), with
    the torch attention backend."""
    model, config = load_model(path, dtype, DEVICE)
    attn = model.model.layers[0].self_attn
    shape = (16, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    n = config.num_hidden_layers
    caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2 * n)]
    bind_kv_cache(model, caches[:n], caches[n:], TorchAttentionBackend())
    return model, config


def step(model, tokens: list[torch.Tensor], context_lens: list[int], num_decodes: int) -> torch.Tensor:
    """One forward in which sequence i (blocks 4i..4i+3) computes its last len(tokens[i]) tokens."""
    query_lens = [len(t) for t in tokens]
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(context_lens, query_lens)])
    seq = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(query_lens))
    tables = torch.arange(4 * len(tokens), dtype=torch.int32).view(len(tokens), 4)
    meta = AttentionMetadata(
        slot_mapping=(tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).to(DEVICE),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(DEVICE, torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=context_lens,
    )
    return model.compute_logits(model(torch.cat(tokens).to(DEVICE), positions.to(DEVICE), meta))


def prefill_then_decode(model, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (7,), generator=gen), torch.randint(vocab, (4,), generator=gen)]
    lens = [len(p) for p in prompts]
    prefill = step(model, prompts, lens, num_decodes=0)
    decode = step(model, [torch.randint(vocab, (1,), generator=gen) for _ in prompts], [n + 1 for n in lens], 2)
    return torch.cat([prefill, decode]).float()


@pytest.mark.parametrize(
    "arch, shape",
    [("qwen3", {}), ("llama", dict(num_heads=4, num_kv_heads=1, head_dim=16, attention_bias=True))],
    ids=["qwen3-qk-norm", "llama-no-qk-norm"],
)
@torch.inference_mode()
def test_model_fused_matches_torch(checkpoint_factory, monkeypatch, arch, shape):
    path = checkpoint_factory(arch, **shape)
    reference, config = build_model(path, torch.float32)
    model, _ = build_model(path, torch.float32)
    assert set_fused_devices(reference, ()) == set_fused_devices(model, (DEVICE.type,)) > 0

    calls: dict[str, int] = {}

    def counted(name: str):
        original = getattr(fused, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    for name in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul"):
        monkeypatch.setattr(fused, name, counted(name))
    logits = prefill_then_decode(model, config.vocab_size)
    layers = config.num_hidden_layers
    # Per forward: the first input norm has no residual; every other norm (and the final one) adds it.
    assert calls == {
        "rms_norm": 2, "fused_add_rms_norm": 2 * 2 * layers, "qk_norm_rope": 2 * layers, "silu_and_mul": 2 * layers
    }
    expected = prefill_then_decode(reference, config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)


def test_env_switch(checkpoint_factory, monkeypatch):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint_factory("qwen3"))
    monkeypatch.delenv("NANOVLLM_FUSED_OPS", raising=False)
    model = get_model_class(config)(config)
    assert model.model.fused_ops
    assert {m.fused_devices for m in model.modules() if hasattr(m, "fused_devices")} == {("cuda",)}
    monkeypatch.setenv("NANOVLLM_FUSED_OPS", "0")
    model = get_model_class(config)(config)
    assert not model.model.fused_ops
    assert {m.fused_devices for m in model.modules() if hasattr(m, "fused_devices")} == {()}


# ---- CUDA: real shapes, bf16, graph capture --------------------------------------------------

QWEN3_06B = dict(hidden=1024, inter=3072, num_heads=16, num_kv_heads=8, head_dim=128, max_pos=40960, theta=1e6)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
@torch.inference_mode()
def test_cuda_real_shapes_bf16(num_tokens):
    dtype, s = torch.bfloat16, QWEN3_06B
    norm = make_norm(s["hidden"], dtype, seed=11)
    x = rand(num_tokens, s["hidden"], dtype=dtype, seed=12, scale=4.0)
    residual = rand(num_tokens, s["hidden"], dtype=dtype, seed=13, scale=4.0)
    assert ulps(fused.rms_norm(x, norm.weight, EPS), norm(x)) <= 2
    expected, expected_residual = norm(x, residual.clone())
    out, new_residual = fused.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(new_residual, expected_residual)
    assert ulps(out, expected) <= 2
    assert (out != expected).float().mean() < 1e-3  # almost all bit-identical

    gate_up = rand(num_tokens, 2 * s["inter"], dtype=dtype, seed=14, scale=3.0)
    out, expected = fused.silu_and_mul(gate_up), SiluAndMul()(gate_up)
    assert ulps(out, expected) <= 2 and (out != expected).float().mean() < 1e-3

    rotary = RotaryEmbedding(s["head_dim"], s["max_pos"], s["theta"]).to(DEVICE)
    q_norm, k_norm = make_norm(s["head_dim"], dtype, seed=15), make_norm(s["head_dim"], dtype, seed=16)
    sizes = [s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]]
    positions = torch.randint(0, s["max_pos"], (num_tokens,), device=DEVICE)
    for norms in ((q_norm, k_norm), (None, None)):
        qkv = rand(num_tokens, sum(sizes), dtype=dtype, seed=17, scale=2.0)
        ref_q, ref_k, _ = qkv.clone().split(sizes, dim=-1)
        ref_q, ref_k = apply_qk_norm_rope(rotary, positions, ref_q, ref_k, *norms)
        q, k, _ = qkv.split(sizes, dim=-1)
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, *(n.weight if n else None for n in norms), EPS)
        q, k = q.reshape(ref_q.shape), k.reshape(ref_k.shape)
        if norms[0] is None:
            assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
        else:
            q3, k3 = q.view(num_tokens, -1, s["head_dim"]), k.view(num_tokens, -1, s["head_dim"])
            assert ulps(q3, ref_q, head_scale(ref_q)) <= 2 and ulps(k3, ref_k, head_scale(ref_k)) <= 2
            assert (q3 != ref_q).float().mean() < 1e-3


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graph_capture_and_replay():
    """All four ops captured in one CUDA graph, replayed on new inputs, match eager calls."""
    dtype, s, n = torch.bfloat16, QWEN3_06B, 8
    norm = make_norm(s["hidden"], dtype, seed=21)
    rotary = RotaryEmbedding(s["head_dim"], s["max_pos"], s["theta"]).to(DEVICE)
    q_norm, k_norm = make_norm(s["head_dim"], dtype, seed=22), make_norm(s["head_dim"], dtype, seed=23)
    sizes = [s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]]
    x = torch.zeros(n, s["hidden"], dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(x)
    qkv = torch.zeros(n, sum(sizes), dtype=dtype, device=DEVICE)
    gate_up = torch.zeros(n, 2 * s["inter"], dtype=dtype, device=DEVICE)
    positions = torch.zeros(n, dtype=torch.long, device=DEVICE)

    def ops():
        out, res = fused.fused_add_rms_norm(x, residual, norm.weight, EPS)
        q, k, _ = qkv.split(sizes, dim=-1)
        fused.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, EPS)
        return fused.rms_norm(out, norm.weight, EPS), res, fused.silu_and_mul(gate_up)

    def fill(seed: int) -> list[torch.Tensor]:
        for i, t in enumerate((x, residual, qkv, gate_up)):
            t.copy_(rand(*t.shape, dtype=dtype, seed=seed + i))
        positions.copy_(torch.randint(0, s["max_pos"], (n,), device=DEVICE))
        return [t.clone() for t in (x, residual, qkv, gate_up, positions)]

    fill(0)
    ops()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = ops()
    inputs = fill(100)
    graph.replay()
    replayed = [t.clone() for t in (*graph_out, qkv)]
    for t, v in zip((x, residual, qkv, gate_up, positions), inputs):
        t.copy_(v)
    eager = [t.clone() for t in (*ops(), qkv)]
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_model_fused_matches_torch(checkpoint_factory, dtype):
    path = checkpoint_factory("qwen3")
    reference, config = build_model(path, dtype)
    model, _ = build_model(path, dtype)
    set_fused_devices(reference, ())
    set_fused_devices(model, ("cuda",))
    logits = prefill_then_decode(model, config.vocab_size)
    expected = prefill_then_decode(reference, config.vocab_size)
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits, expected, atol=tol, rtol=tol)
