"""W3's peer on the same machine: transformers on the embedded GGUF (dequantized to fp32).

The same 16 chat prompts as cpu_bench.py, 64 greedy tokens each, in one left-padded batched
`generate` (median of 3 after a warm-up), and one prompt alone: single-stream decode per token
after the first (64-token minus 1-token generate, over 63). Run it next to cpu_bench.py on an
idle machine: the two are compared side by side in docs/benchmarks.md (W3).

    python benchmarks/cpu_peer_transformers.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cpu_bench import QUESTIONS
    from nanovllm.loaders.default_model import default_model_path

    folder, gguf = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    greedy = dict(do_sample=False, pad_token_id=tok.pad_token_id)
    batch, single = [], []
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in enc.items()}, max_new_tokens=8, **greedy)
        for _ in range(3):
            t = time.perf_counter()
            model.generate(**enc, max_new_tokens=64, min_new_tokens=64, **greedy)
            batch.append(len(texts) * 64 / (time.perf_counter() - t))
        one = tok(texts[:1], return_tensors="pt", add_special_tokens=False)
        for _ in range(3):
            t = time.perf_counter()
            model.generate(**one, max_new_tokens=1, **greedy)
            first = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(**one, max_new_tokens=64, min_new_tokens=64, **greedy)
            single.append(63 / (time.perf_counter() - t - first))
    print(f"transformers W3 batch of 16: median {statistics.median(batch):.1f} tok/s (runs "
          f"{', '.join(f'{x:.1f}' for x in batch)}); single-stream decode median {statistics.median(single):.1f} "
          f"tok/s; threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
