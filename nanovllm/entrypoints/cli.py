"""Command line: `nanovllm generate "PROMPT"` (and `python -m nanovllm ...`).

With no --model the embedded default model (SmolLM2-135M-Instruct, GGUF) is used. Generated
text goes to stdout; progress and logs go to stderr, so the output can be piped.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options mirroring LLM(...)'s keyword arguments."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--max-num-seqs", type=int, default=512)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--kvcache-block-size", type=int, default=16)
    g.add_argument("--num-kvcache-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = (
        "device", "attention_backend", "tensor_parallel_size", "dtype", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "kvcache_block_size", "num_kvcache_blocks", "gpu_memory_utilization",
        "enable_prefix_caching", "enforce_eager", "seed",
    )
    return {n: getattr(args, n) for n in names}


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sample_seed, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.quiet)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for out in outputs:
        sys.stdout.write(out.outputs[0].text + "\n")
    sys.stdout.flush()
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nano-vllm: a small, fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text (read from stdin when none is given)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"nanovllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
