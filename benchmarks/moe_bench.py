"""W6 (W1's workload on a mixture-of-experts model), single stream and start-up, on the
Qwen3-30B-A3B shape with random weights (`load_format="dummy"`: no checkpoint is read).

The script writes the model's config.json (48 layers, 128 experts, top-8, hidden 2048, expert
intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151936, untied, bf16,
norm_topk_prob true) into --model-dir, then:

- start-up: seconds from the process's start, and inside LLM(), until the engine is ready;
- W6: W1's 256 requests (benchmarks/bench.py w1_requests: 100-1024 tokens in and out,
  temperature 0.6, ignore_eos, seed 0), once after a short warm-up: output tok/s;
- single stream: W5's shape (a 128-token prompt, 512 tokens, greedy): decode tok/s and TTFT.

    python benchmarks/moe_bench.py                     # ~4 minutes on an H200
    python benchmarks/moe_bench.py --sweep-only        # the fused kernel's block sizes, by token count
    NANOVLLM_MOE_CONFIG=/tmp/moe_best.json python benchmarks/moe_bench.py   # run with the sweep's best

--sweep times the fused expert GEMMs (layers/fused_moe.py, one layer's shape, bf16, in CUDA
graphs) for each candidate block configuration at decode and prefill token counts, prints the
best per count and writes them as JSON (--sweep-out) in the form NANOVLLM_MOE_CONFIG reads.
"""
from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
DECODE_TOKENS = [1, 8, 32, 64, 128, 256, 512]
PREFILL_TOKENS = [1024, 4096, 16384]


def write_config(model_dir: Path) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_30B_A3B, indent=1))
    return model_dir


def candidates(num_tokens: int, weight_reads: tuple[bool, ...]):
    """Block configurations to time at `num_tokens`, each with the weights read through pointers
    (tma False) and through tensor descriptors (tma True), as `weight_reads` lists."""
    from nanovllm.layers.fused_moe import MoEKernelConfig

    if num_tokens <= 8:  # decode of a few rows: one row per block, the weights' bytes are everything
        grid = itertools.product((16,), (16, 32, 64), (128, 256), (2, 4), (3, 4, 5), weight_reads)
    else:
        block_ms = (16, 32) if num_tokens <= 512 else (32, 64, 128)
        grid = itertools.product(block_ms, (32, 64, 128), (64, 128), (4, 8), (3, 4, 5), weight_reads)
    for bm, bn, bk, warps, stages, tma in grid:
        if bm * bn >= 128 * 128 and warps == 4:
            continue
        yield MoEKernelConfig(bm, bn, bk, warps, stages, tma)


def sweep(out_path: str, token_counts: list[int]) -> dict:
    """Best block configuration of the fused expert GEMMs per token count, by CUDA-graph time."""
    import torch

    from common import graph_time_us
    from nanovllm.layers.fused_moe import default_config, fused_experts, route, tma_supported

    cfg = QWEN3_30B_A3B
    experts, top_k, hidden, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=dev) * 0.02).to(dtype)
    weight_bytes = (w13.numel() + w2.numel()) * 2
    weight_reads = (False, True) if tma_supported(w13[0], w13, w2) else (False,)
    best: dict[str, dict] = {}
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        weights, ids = route(torch.randn(tokens, experts, device=dev), top_k, True)
        touched = min(experts, len(torch.unique(ids))) / experts
        results = []
        for config in [default_config(tokens, experts, top_k), *candidates(tokens, weight_reads)]:
            try:
                us = graph_time_us(lambda i, c=config: fused_experts(x, w13, w2, weights, ids, c), replays=10)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                print(f"  skip {config}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            results.append((us, config))
        default_us = results[0][0]
        us, config = min(results, key=lambda r: r[0])
        gbps = weight_bytes * touched / (us * 1e-6) / 1e9
        by_reads = "; ".join(f"best with tma={tma} {min(r[0] for r in results if r[1].tma is tma):.1f} us"
                             for tma in weight_reads)
        print(f"tokens {tokens:6d}: best {us:9.1f} us ({gbps:6.0f} GB/s of expert weights touched) {config}; "
              f"default {default_us:9.1f} us; {by_reads}", flush=True)
        best[str(tokens)] = {k: getattr(config, k)
                             for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma")}
    with open(out_path, "w") as f:
        json.dump(best, f, indent=1)
    print(f"wrote {out_path} (use: NANOVLLM_MOE_CONFIG={out_path})")
    return best


def profile_decode(llm, batch: int, replays: int = 20) -> None:
    """GPU time per kernel of the per-op decode graph of `batch` rows (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graphs = llm.engine.executor.runner.graph_runner
    size = graphs.graph_size(batch)
    graphs.slot_mapping[:size] = -1
    graphs.slot_mapping[:batch] = torch.arange(batch, device=graphs.slot_mapping.device)
    graphs.seq_lens[:batch] = 128
    graphs.positions[:batch] = 127
    # Distinct random tokens, so that the rows route to different experts as a real batch's do
    # (rows of one token would all read the same eight).
    graphs.input_ids[:batch] = torch.randint(0, llm.engine.executor.runner.hf_config.vocab_size, (batch,),
                                             generator=torch.Generator().manual_seed(0)).to(graphs.input_ids.device)
    graphs.graphs[size].replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.graphs[size].replay()
        torch.cuda.synchronize()
    print(f"decode graph of {size} rows ({batch} real), per replay:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/qwen3-30b-a3b-shape", help="where config.json is written")
    ap.add_argument("--sweep", action="store_true", help="sweep the fused kernel's block sizes first")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument("--sweep-out", default="/tmp/moe_best.json")
    ap.add_argument("--w5-runs", type=int, default=2)
    ap.add_argument("--skip-w6", action="store_true")
    ap.add_argument("--decode-burst", type=int, default=None,
                    help="decode steps per engine step for the single stream (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--profile-decode", type=int, default=0, metavar="ROWS",
                    help="print the decode graph's GPU time per kernel for ROWS real rows, then stop")
    ap.add_argument("--sweep-tokens", default=None, help="comma-separated token counts for --sweep (default: all)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    if args.sweep or args.sweep_only:
        tokens = [int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else DECODE_TOKENS + PREFILL_TOKENS
        sweep(args.sweep_out, tokens)
        if args.sweep_only:
            return
    from bench import CompileLog, run_w1, run_w5

    from nanovllm import LLM

    model_dir = write_config(Path(args.model_dir))
    compiles = CompileLog()
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=args.max_model_len, decode_burst=args.decode_burst)
    ready = time.perf_counter()
    runner = llm.engine.executor.runner
    startup = {"since_process_start_s": ready - PROCESS_START, "llm_init_s": ready - t0,
               **{k: round(v, 2) for k, v in runner.startup_seconds.items()}}
    print("startup", json.dumps(startup), flush=True)
    if args.profile_decode:
        profile_decode(llm, args.profile_decode)
        return
    report = {"startup": startup, "moe_config": os.environ.get("NANOVLLM_MOE_CONFIG")}
    if not args.skip_w6:
        report["w6"] = run_w1(llm, 1, compiles)
    report["single_stream"] = run_w5(llm, args.w5_runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    w6 = f"W6 {report['w6']['median_tok_per_s']:.0f} tok/s (target 6400)" if "w6" in report else "W6 skipped"
    ss = report["single_stream"]
    print(f"\n== summary == Qwen3-30B-A3B shape, dummy bf16 weights: start-up {startup['since_process_start_s']:.1f} s "
          f"(LLM() {startup['llm_init_s']:.1f} s; target 60); {w6}; single stream "
          f"{ss['median_decode_tok_per_s']:.0f} tok/s decode (target 450), TTFT {ss['median_ttft_ms']:.1f} ms, "
          f"decode burst {runner.decode_burst}")


if __name__ == "__main__":
    main()
