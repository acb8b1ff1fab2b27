"""W3: the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) on the CPU.

16 short chat prompts (one user message each), greedy, exactly 64 new tokens each (EOS
ignored): 1,024 output tokens; tok/s over the whole set, model load excluded, median of 3 after
a warm-up. Also single-stream decode (one prompt, per token after the first).
`--temperature T [--top-p P]` samples instead (what chat clients ask for), everything else the same.
Run it on an idle machine: CPU timings are easily skewed by other work.

    python benchmarks/cpu_bench.py [--dtype float32 | --dtype bfloat16 | --quantization int4] [--no-cpu-compile]

The default runs the file's quantized weights as int4 (the CPU default for a quantized GGUF);
--dtype float32 runs the dequantized fp32 model (transformers' tokens exactly); --dtype bfloat16 runs the model in bf16 (its output then differs from the fp32 reference's; worth
it on CPUs with AVX512-BF16 or AMX, see docs/benchmarks.md, W3). --quantization int4 keeps the
projections' weights as int4 codes (layers/int4_linear.py; the LM head stays dense), also in bf16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "What is the boiling point of water?", "Who wrote Romeo and Juliet?", "What is photosynthesis?",
    "Give me a synonym for happy.", "What is 12 times 12?", "Why is the sky blue?",
    "What language is spoken in Brazil?", "What is the largest planet?", "Define gravity in one sentence.",
    "What do bees make?", "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "Suggest a name for a pet cat.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--async-scheduling", action="store_true", help="force async scheduling on (default: off on CPU)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: int4 weights for a quantized GGUF, else float32")
    ap.add_argument("--quantization", default=None, choices=["int4"], help="int4 weights, bf16 activations")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature instead of greedy decoding (W3)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    ap.add_argument("--cpu-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="decode steps through the compiled layer, or (--no-cpu-compile) the eager model "
                         "(default: the engine's choice, compiled where a C++ compiler is found)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from nanovllm import LLM, SamplingParams

    llm = LLM(device="cpu", dtype=args.dtype, quantization=args.quantization,
              async_scheduling=True if args.async_scheduling else None, cpu_compile=args.cpu_compile)
    tok = llm.tokenizer
    prompts = [tok.encode(llm.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False) for q in QUESTIONS]
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    batch = []
    for _ in range(args.runs):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        batch.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    single = []
    engine = llm.engine
    for i in range(args.runs):
        llm.reset_prefix_cache()
        engine.add_request(f"s{i}", prompts[0], sp)
        engine.step()  # the prompt, and the first token
        t = time.perf_counter()
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        # Tokens after the first over their time (a decode burst yields several per step).
        single.append((len(final.outputs[0].token_ids) - 1) / (time.perf_counter() - t))
    print(json.dumps({"batch_tok_per_s": batch, "single_decode_tok_per_s": single,
                      "prompt_tokens": [len(p) for p in prompts], "threads": torch.get_num_threads(),
                      "dtype": str(llm.engine.executor.runner.dtype),
                      "quantization": llm.engine.executor.runner.quantization}))
    print(f"W3 batch of 16: median {statistics.median(batch):.1f} tok/s; single-stream decode median "
          f"{statistics.median(single):.1f} tok/s ({1000 / statistics.median(single):.1f} ms/token)")


if __name__ == "__main__":
    main()
