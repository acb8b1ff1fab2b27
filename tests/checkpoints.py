"""Tiny random Hugging Face checkpoints for tests (no hub access needed).

`make_tokenizer_dir` trains a small byte-level BPE tokenizer on a fixed corpus with the
`tokenizers` library and saves it with a ChatML chat template; `make_checkpoint` builds a random
Qwen3 / Qwen2 / Llama / Qwen3-MoE / Qwen2-MoE / Mixtral model with transformers, saves it as safetensors next to the tokenizer,
and returns the directory. The model's vocabulary equals the tokenizer's, so every generated id
decodes.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Large language models generate text one token at a time.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others are decoding.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂 and more symbols: {}[]()<>!?",
    "def main():\n    print('hello world')\n    return 0\n",
] * 4

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def make_checkpoint(
    path: Path,
    tokenizer_dir: Path,
    arch: str = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    **extra,
) -> Path:
    """Build, save and return a tiny random checkpoint directory (fp32 safetensors)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    common.update(extra)
    if arch == "qwen3":
        config = Qwen3Config(head_dim=head_dim, **common)
    elif arch == "qwen2":
        if head_dim != hidden_size // num_heads:
            raise ValueError("Qwen2 derives head_dim from hidden_size / num_heads")
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(head_dim=head_dim, **common)
    elif arch == "qwen3_moe":  # extra: num_experts, num_experts_per_tok, moe_intermediate_size, ...
        config = Qwen3MoeConfig(head_dim=head_dim, **common)
    elif arch == "qwen2_moe":  # extra as qwen3_moe, plus shared_expert_intermediate_size
        if head_dim != hidden_size // num_heads:
            raise ValueError("Qwen2-MoE derives head_dim from hidden_size / num_heads")
        config = Qwen2MoeConfig(**common)
    elif arch == "mixtral":  # extra: num_local_experts, num_experts_per_tok (intermediate_size per expert)
        config = MixtralConfig(head_dim=head_dim, **common)
    else:
        raise ValueError(f"unknown arch {arch}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id).save_pretrained(path)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path


def load_model(path, dtype: torch.dtype, device: torch.device):
    """The model of a checkpoint as the runner builds it (parameters in `dtype`, rotary table
    fp32), with random norm weights (1 in the checkpoint, which would hide a misplaced weight).
    Returns (model, hf_config); KV caches are the caller's to bind."""
    from transformers import AutoConfig

    from nanovllm.loaders.safetensors import iter_safetensors
    from nanovllm.models.registry import get_model_class

    config = AutoConfig.from_pretrained(path)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = get_model_class(config)(config)
    finally:
        torch.set_default_dtype(default_dtype)
    gen = torch.Generator().manual_seed(1)
    weights = {
        name: (1.0 + 0.2 * torch.randn(t.shape, generator=gen)) if name.endswith("norm.weight") else t
        for name, t in iter_safetensors(path)
    }
    model.load_weights(weights.items())
    return model, config
