"""Where a W1 decode step spends its time: torch profiler over steady-state decode steps.

Admits all 256 W1 requests, steps until every prompt is prefilled, then profiles N decode-only
steps and prints the GPU kernels by total time, plus GPU-busy time vs wall time (the
difference is host overhead the GPU waits on).

    python benchmarks/profile_step.py --model /tmp/qwen3-0.6b
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--trace", default=None, help="write a chrome trace here")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import w1_requests
    from nanovllm import LLM

    llm = LLM(args.model, max_model_len=4096, enforce_eager=args.enforce_eager)
    engine = llm.engine
    prompts, params = w1_requests()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / args.steps / 1e3
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    print(f"\nbatch {len(engine.scheduler.running)}: wall {wall * 1e3:.2f} ms/step, GPU busy {gpu:.2f} ms/step, "
          f"host gap {wall * 1e3 - gpu:.2f} ms/step")
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
