"""W5 on the GPU's timeline: how much of a lone stream's decode is the persistent kernel and how
much lies between its launches (docs/benchmarks.md, W5 session 21).

    python benchmarks/w5_gaps.py --model /tmp/q06

Runs W5's request (128-token prompt, 512 greedy tokens) three times for its host-side figure,
then once under the torch profiler, and prints: the kernel launches (one per decode burst) and
their durations, per token; the GPU's busy time and idle time between the first and the last
launch; and the other operations in that window (input copies, token copies).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from random import Random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--decode-burst", type=int, default=None)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=4096, decode_burst=args.decode_burst)
    engine = llm.engine
    engine.executor.runner.finish_background_compile()
    rng = Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up

    def run(request_id: str) -> float:
        """us per token after the first, from the request's own times (as bench.py's W5)."""
        llm.reset_prefix_cache()
        engine.add_request(request_id, prompt, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        m = final.metrics
        return (m["finished_time"] - m["first_token_time"]) / (len(final.outputs[0].token_ids) - 1) * 1e6

    print("W5 us per token:", " ".join(f"{run(f'plain-{i}'):.1f}" for i in range(3)))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        us = run("profiled")
    print(f"under the profiler: {us:.1f} us per token")
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = sorted((e for e in json.load(open(path))["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = [i for i, e in enumerate(events) if "_decode_kernel" in e["name"]]
    window = events[launches[0]: launches[-1] + 1]
    kernels = [events[i]["dur"] for i in launches]
    print(f"{len(kernels)} kernel launches, us: first {' '.join(f'{d:.0f}' for d in kernels[:6])}, "
          f"last {' '.join(f'{d:.0f}' for d in kernels[-6:])}")
    span = window[-1]["ts"] + window[-1]["dur"] - window[0]["ts"]
    # The busy time is the union of the operations' intervals (copies on a second stream overlap kernels).
    busy, end = 0.0, window[0]["ts"]
    for e in window:
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            busy += stop - start
            end = stop
    print(f"window {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms, idle {(span - busy):.0f} us "
          f"({(span - busy) / len(kernels):.1f} us per launch); the kernel {sum(kernels) / 1e3:.2f} ms "
          f"({sum(kernels) / (params.max_tokens - 1):.1f} us per token)")
    others: dict[str, list[float]] = {}
    for e in window:
        if "_decode_kernel" not in e["name"]:
            others.setdefault(e["name"][:50], []).append(e["dur"])
    for name, durs in sorted(others.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(durs):4d} x {name} (median {statistics.median(durs):.1f} us)")


if __name__ == "__main__":
    main()
