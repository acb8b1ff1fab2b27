"""W1 (offline throughput), W5 (single-stream latency) and start-up, from docs/benchmarks.md.

W1 is nano-vllm's bench.py workload exactly: random.seed(0); 256 prompts of randint(100, 1024)
token ids drawn from randint(0, 10000); max_tokens = randint(100, 1024) each; temperature 0.6,
ignore_eos; one short warm-up generate; one timed generate over all 256.

    python benchmarks/bench.py --model /tmp/qwen3-0.6b --make-model --workload all --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# W5-chat's sampling settings: Qwen3's generation_config.json.
W5_CHAT = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
# W5's stream under other sampling settings (--w5-modes): each runs as W5 does, one after another.
W5_MODES = {
    "greedy": {"temperature": 0.0},
    "chat": dict(W5_CHAT),
    "chat-seed": dict(W5_CHAT, seed=1234),
    "top-p": {"temperature": 0.6, "top_p": 0.9},
    "min-p": {"temperature": 1.0, "min_p": 0.1},
    "chat-presence": dict(W5_CHAT, presence_penalty=0.5),
}


def w1_requests():
    from nanovllm import SamplingParams

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)) for _ in range(256)]
    return prompts, params


class CompileLog:
    """Names of the Triton kernels compiled while it is installed (Triton's jit_cache_hook runs
    before each compile). A kernel compiled inside a timed run is start-up work the run paid for."""

    def __init__(self) -> None:
        self.names: list[str] = []
        try:
            import triton

            triton.knobs.runtime.jit_cache_hook = self._hook
        except (ImportError, AttributeError):
            pass  # no Triton, or one without knobs: nothing is recorded

    def _hook(self, *, fn, **_) -> bool:
        self.names.append(fn.name)
        return False  # compile as usual

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def timed_generate(llm, prompts, params):
    """Run generate, splitting wall time into steps with prefill tokens and decode-only steps."""
    engine = llm.engine
    split = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
    original = engine.step

    def step():
        outs = original()
        st = engine.last_step
        key = "prefill" if st.num_prefill_tokens else "decode"
        split[f"{key}_s"] += st.seconds
        split["prefill_tokens"] += st.num_prefill_tokens
        split["decode_tokens"] += st.num_decode_tokens
        split["steps"] += 1
        return outs

    engine.step = step
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
    finally:
        engine.step = original
    return outs, seconds, split


def run_w1(llm, runs: int, compiles: CompileLog) -> dict:
    from nanovllm import SamplingParams

    prompts, params = w1_requests()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    results = []
    for i in range(runs):
        llm.reset_prefix_cache()  # every run starts cold, as a fresh engine would
        compiles.take()
        mem_before = _allocator_counts()
        outs, seconds, split = timed_generate(llm, prompts, params)
        mem = {k: v - mem_before[k] for k, v in _allocator_counts().items()}
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        r = dict(run=i, output_tokens=out_tokens, prompt_tokens=sum(map(len, prompts)), seconds=seconds,
                 tok_per_s=out_tokens / seconds, preemptions=llm.engine.scheduler.num_preemptions, **split,
                 kernels_compiled=compiles.take(), **mem)
        print(json.dumps(r), flush=True)
        results.append(r)
    med = statistics.median(r["tok_per_s"] for r in results)
    return {"runs": results, "median_tok_per_s": med, "floor_fraction": med / 33000}


def _allocator_counts() -> dict[str, int]:
    """cudaMalloc calls and allocations retried after freeing the cache, so far (0 on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda_mallocs": 0, "alloc_retries": 0}
    stats = torch.cuda.memory_stats()
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}


def run_w5(llm, runs: int, sampling: dict | None = None) -> dict:
    from nanovllm import SamplingParams

    engine = llm.engine
    prompt = [randint(0, 10000) for _ in range(128)]
    # W5 is greedy; other sampling settings (W5-chat: W5_CHAT) measure a sampling stream the same way.
    sp = SamplingParams(**(sampling or {}), max_tokens=512, ignore_eos=True)
    # The persistent decode kernel compiles in the background after start-up; W5 measures the
    # steady state, so it waits for it (and says whether it was used).
    runner = engine.executor.runner
    runner.finish_background_compile()
    persistent = runner.fastpath is not None and runner.fastpath.graphs.has_single
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up
    results = []
    for i in range(runs):
        llm.reset_prefix_cache()
        engine.add_request(f"w5-{i}", prompt, sp)
        t0 = time.perf_counter()
        t_first = None
        steps = 0
        tokens = 0
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = len(out.outputs[0].token_ids)
                final = out
            steps += 1
            if t_first is None:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        # W5 (docs/benchmarks.md): decode tok/s after the first token, and the time to the
        # first token. Both from the request's own times (monotonic, host side): it arrived, its
        # first token reached the host (the prefill's result processed), its last did. (Timed
        # from the first engine step's return instead, the window would hold the rest of the
        # prefill, which async scheduling only launches there: *_first_step reports that too.)
        m = final.metrics
        decode_s = m["finished_time"] - m["first_token_time"]
        r = dict(run=i, ttft_ms=(m["first_token_time"] - m["arrival_time"]) * 1e3,
                 decode_tok_per_s=(tokens - 1) / decode_s, ms_per_token=decode_s / (tokens - 1) * 1e3,
                 ttft_ms_first_step=(t_first - t0) * 1e3, decode_tok_per_s_first_step=(tokens - 1) / (t_end - t_first),
                 steps=steps, tokens=tokens)
        print(json.dumps(r), flush=True)
        results.append(r)
    return {"runs": results, "persistent_kernel": persistent, "median_decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in results),
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in results),
            "median_decode_tok_per_s_first_step": statistics.median(r["decode_tok_per_s_first_step"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--make-model", action="store_true", help="create the random Qwen3-0.6B checkpoint at --model first")
    ap.add_argument("--workload", choices=["w1", "w5", "all"], default="all")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--no-persistent-decode", dest="persistent_decode", action="store_false",
                    help="lone decodes take the per-op graph, not the persistent kernel")
    ap.add_argument("--decode-burst", type=int, default=None,
                    help="decode steps of a lone greedy or plain-temperature sequence per engine step "
                         "(default: the engine's)")
    ap.add_argument("--w5-temperature", type=float, default=0.0,
                    help="W5's stream samples at this temperature instead of greedily (not the W5 workload)")
    ap.add_argument("--w5-chat", action="store_true",
                    help="W5-chat: W5 sampling with Qwen3's defaults (temperature 0.6, top_p 0.95, top_k 20)")
    ap.add_argument("--w5-presence-penalty", type=float, default=0.0, help="added to W5's sampling settings")
    ap.add_argument("--w5-seed", type=int, default=None, help="W5's request seed")
    ap.add_argument("--w5-modes", default=None,
                    help=f"comma-separated sampling modes, each measured as W5 is, in one engine: {', '.join(W5_MODES)}")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    t_start = time.perf_counter()
    if args.make_model:
        from common import make_qwen3_06b

        make_qwen3_06b(args.model)
    t_import = time.perf_counter()
    from nanovllm import LLM

    import_s = time.perf_counter() - t_import
    t0 = time.perf_counter()
    compiles = CompileLog()
    llm = LLM(args.model, enforce_eager=args.enforce_eager, max_model_len=4096, attention_backend=args.attention_backend,
              tensor_parallel_size=args.tensor_parallel_size, persistent_decode=args.persistent_decode,
              decode_burst=args.decode_burst)
    init_s = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    startup = dict(import_s=import_s, llm_init_s=init_s, kernels_compiled=sorted(set(compiles.take())),
                   kv_blocks=runner.num_kvcache_blocks,
                   kv_gib=runner.num_kvcache_blocks * runner.bytes_per_block() / 2**30, **runner.startup_seconds)
    print("startup", json.dumps(startup), flush=True)
    report = {"startup": startup, "device": _device_name(), "make_model_s": t_import - t_start}
    if args.workload in ("w1", "all"):
        report["w1"] = run_w1(llm, args.runs, compiles)
    if args.w5_modes:
        report["w5_modes"] = {}
        for mode in args.w5_modes.split(","):
            r = run_w5(llm, args.runs, W5_MODES[mode])
            report["w5_modes"][mode] = r
            print(f"W5 mode {mode} {W5_MODES[mode]}: decode {r['median_decode_tok_per_s']:.0f} tok/s, "
                  f"TTFT {r['median_ttft_ms']:.1f} ms", flush=True)
    if args.workload in ("w5", "all"):
        sampling = dict(W5_CHAT) if args.w5_chat else {"temperature": args.w5_temperature}
        if args.w5_presence_penalty:
            sampling["presence_penalty"] = args.w5_presence_penalty
        if args.w5_seed is not None:
            sampling["seed"] = args.w5_seed
        report["w5"] = run_w5(llm, args.runs, sampling)
        report["w5"]["sampling"] = sampling
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("\n== summary ==")
    print(f"device {report['device']}  startup: LLM() {init_s:.1f}s {json.dumps({k: round(v, 2) for k, v in runner.startup_seconds.items()})}  KV {startup['kv_gib']:.1f} GiB")
    if "w1" in report:
        w1 = report["w1"]
        print(f"W1 median {w1['median_tok_per_s']:.0f} tok/s ({w1['floor_fraction']:.0%} of the 33k floor) runs: "
              + ", ".join(f"{r['tok_per_s']:.0f} ({r['seconds']:.2f}s, prefill {r['prefill_s']:.2f}s, decode {r['decode_s']:.2f}s)" for r in w1["runs"]))
    if "w5" in report:
        w5 = report["w5"]
        print(f"W5 {w5['sampling']} decode {w5['median_decode_tok_per_s']:.0f} tok/s, TTFT {w5['median_ttft_ms']:.1f} ms"
              f" (persistent kernel {'on' if w5['persistent_kernel'] else 'off'}, decode burst {runner.decode_burst}); "
              f"timed from the first engine step's return: "
              f"{w5['median_decode_tok_per_s_first_step']:.0f} tok/s")


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
