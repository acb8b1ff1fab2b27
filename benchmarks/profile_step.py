"""Where a decode step spends its time (GPU kernels, host functions, fixed cost per step).

    python benchmarks/profile_step.py --model /tmp/q06 --workload w1   # steady decode at batch 256
    python benchmarks/profile_step.py --model /tmp/q06 --workload w5   # one stream (W5)
    python benchmarks/profile_step.py --model /tmp/q06 --graphs        # replay cost per batch size
    python benchmarks/profile_step.py --model /tmp/q06 --timeline      # W1 wall time by batch size
    python benchmarks/profile_step.py --model /tmp/q06 --first-prefill # a fresh engine's first W1 step
    python benchmarks/profile_step.py --model /tmp/q06 --first-run     # first vs second W1 run, per step

w1 / w5: brings the requests to steady decode, times N steps without a profiler (wall per
step), then prints the torch profiler's kernel table (GPU busy per step; the difference to the
wall is time the GPU waits on the host) and cProfile's top host functions.
--graphs: replays each captured decode graph with every row at a context of --context tokens,
timed with CUDA events: the GPU cost of a step outside the host's reach.
--timeline: one W1 run, every step's wall time binned by how many sequences it ran.
--first-run: three W1 runs in a fresh engine, every step's host wall time and GPU time (CUDA
events around its launch) and the garbage collector's time per run.
--first-prefill: the first W1 step of a fresh engine (after bench.py's short warm-up) under the
profiler, sorted by host time: a new process's first W1 run is ~0.3 s slower there than later
runs with no Triton compile involved (docs/benchmarks.md); this shows where that time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from random import randint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def add_requests(engine, prompts, params, prefix: str = "") -> None:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}{i}", p, sp)


def steady_decode(engine, workload: str) -> None:
    from nanovllm import SamplingParams

    from bench import w1_requests

    if workload == "w1":
        prompts, params = w1_requests()
    else:
        prompts = [[randint(0, 10000) for _ in range(128)]]
        params = [SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)]
    add_requests(engine, prompts, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()


def profile_steps(engine, steps: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm.runner.model_runner import BurstOutput, PendingOutput

    # Time the host spends waiting for the GPU (the step's sampled ids): the rest of the wall
    # time is host work. Host work per step above the GPU's time means the host is the limit.
    waited = [0.0]
    results = {cls: cls.result for cls in (PendingOutput, BurstOutput)}

    def timed(result):
        def timed_result(self):
            t0 = time.perf_counter()
            event = self.tokens.event if isinstance(self, BurstOutput) else self.event
            if event is not None:
                event.synchronize()
            waited[0] += time.perf_counter() - t0
            return result(self)
        return timed_result

    for cls, result in results.items():
        cls.result = timed(result)
    torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        engine.step()
        tokens += engine.last_step.num_decode_tokens
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    for cls, result in results.items():
        cls.result = result
    host = wall - waited[0] / steps

    prof_steps = min(steps, 20)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / prof_steps / 1e3
    print(events.table(sort_by="self_cuda_time_total", row_limit=30))

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    print(f"\nbatch {len(engine.scheduler.running)}: wall {wall * 1e3:.3f} ms/step (no profiler), "
          f"GPU busy {gpu:.3f} ms/step (profiler), difference {wall * 1e3 - gpu:.3f} ms/step; "
          f"host work {host * 1e3:.3f} ms/step (wall minus waiting for the sampled ids); "
          f"{tokens / steps:.2f} decode tokens per step (decode bursts: several), wall {wall * steps / max(tokens, 1) * 1e3:.4f} ms/token")


def graph_replay(runner, context: int) -> None:
    import torch

    from common import replay_us

    g = runner.graph_runner
    if g is None:
        print("no CUDA graphs (eager)")
        return
    blocks = -(-context // runner.block_size)
    if g.has_single:  # the persistent kernel's graph (with the LM head and the argmax)
        s = g.single
        s.seq_len.fill_(context)
        s.position.fill_(context - 1)
        s.slot.fill_(-1)
        s.block_table[0, :blocks] = torch.arange(blocks, dtype=torch.int32, device=s.buffer.device) % runner.num_kvcache_blocks
    for bs in [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s in g.graphs]:
        g.seq_lens[:bs] = context
        g.positions[:bs] = context - 1
        g.slot_mapping[:bs] = -1  # write nothing
        g.block_tables[:bs, :blocks] = torch.arange(blocks, dtype=torch.int32, device=g.block_tables.device) % runner.num_kvcache_blocks
        us = replay_us(g.graphs[bs], 50, warmup=3)
        print(f"graph batch {bs:4d} context {context}: {us:8.1f} us/replay")
    g.seq_lens.zero_()


def timeline(llm) -> None:
    from nanovllm import SamplingParams

    from bench import w1_requests

    engine = llm.engine
    prompts, params = w1_requests()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)
    bins = [(1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256)]
    stats = {b: [0, 0.0] for b in bins}
    prefill = [0, 0.0]
    original = engine.step

    def step():
        n = len(engine.scheduler.running)  # before this step's schedule; close enough for binning
        outs = original()
        st = engine.last_step
        if st.num_prefill_tokens:
            prefill[0] += 1
            prefill[1] += st.seconds
        else:
            for lo, hi in bins:
                if lo <= n <= hi:
                    stats[(lo, hi)][0] += 1
                    stats[(lo, hi)][1] += st.seconds
        return outs

    engine.step = step
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t
    engine.step = original
    print(f"W1 timeline: total {total:.2f} s; steps with prefill: {prefill[0]} steps, {prefill[1]:.2f} s")
    for (lo, hi), (count, secs) in stats.items():
        if count:
            print(f"  decode batch {lo:3d}-{hi:3d}: {count:4d} steps, {secs:.2f} s, {secs / count * 1e3:.2f} ms/step")


def first_run(llm, runs: int = 3) -> None:
    """W1 runs in a fresh engine, stepped as bench.py steps them (async, unsynchronised): per
    step the host's wall time and the GPU time between two CUDA events around its launch (GPU
    work, plus any wait for the host's launches), and the garbage collector's time per run: is
    a slow prefill phase (0.3-0.7 s, varying from run to run) the host's or the GPU's?"""
    import gc

    import torch

    from nanovllm import SamplingParams

    from bench import w1_requests

    engine = llm.engine
    executor = engine.executor
    gc_time: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            entry = gc_time[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - started.pop()

    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # bench.py's warm-up
    original_step, original_launch = engine.step, executor.execute_async
    tables: list[list[tuple[int, int, float, torch.cuda.Event, torch.cuda.Event]]] = []
    gc.callbacks.append(on_gc)
    for run in range(runs):
        steps: list = []
        events: list = []
        for entry in gc_time.values():
            entry[:] = [0, 0.0]

        def launch(sched):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original_launch(sched)
            end.record()
            events.append((start, end))
            return out

        def step():
            n = len(events)
            outs = original_step()
            st = engine.last_step
            ev = events[n] if len(events) > n else (None, None)
            steps.append((st.num_prefill_tokens, st.num_decode_tokens, st.seconds, *ev))
            return outs

        engine.step, executor.execute_async = step, launch
        prompts, params = w1_requests()
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t
        engine.step, executor.execute_async = original_step, original_launch
        torch.cuda.synchronize()
        tables.append(steps)
        gpu = lambda x: x[3].elapsed_time(x[4]) / 1e3 if x[3] is not None else 0.0  # noqa: E731
        pre = [x for x in steps if x[0]]
        gcs = ", ".join(f"gen{g} {n} x, {secs * 1e3:.1f} ms" for g, (n, secs) in gc_time.items())
        print(f"run {run}: {total:.3f} s, {len(steps)} steps; prefill steps: wall {sum(x[2] for x in pre):.3f} s, "
              f"GPU {sum(gpu(x) for x in pre):.3f} s; decode GPU {sum(gpu(x) for x in steps if not x[0]):.3f} s; gc: {gcs}")
    gc.callbacks.remove(on_gc)
    print("first 12 steps: prefill tokens, decodes, then wall / GPU ms of each run")
    for i in range(12):
        cells = "  ".join(f"{t[i][2] * 1e3:6.1f} /{t[i][3].elapsed_time(t[i][4]) if t[i][3] else 0:6.1f}" for t in tables)
        print(f"  step {i:3d}: {tables[0][i][0]:6d} {tables[0][i][1]:4d}   {cells}")


def first_prefill(llm) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import SamplingParams

    from bench import w1_requests

    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # bench.py's warm-up
    engine = llm.engine
    add_requests(engine, *w1_requests(), prefix="first-")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(2):  # with async scheduling the first step's work finishes in the second
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print(f"first two W1 steps: {wall * 1e3:.1f} ms wall")
    for rid in list(engine.requests):
        engine.abort_request(rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=["w1", "w5"], default=None)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--first-prefill", action="store_true")
    ap.add_argument("--first-run", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-persistent-decode", dest="persistent_decode", action="store_false")
    args = ap.parse_args()
    from nanovllm import LLM

    llm = LLM(args.model, max_model_len=4096, enforce_eager=args.enforce_eager, persistent_decode=args.persistent_decode)
    llm.engine.executor.runner.finish_background_compile()
    if args.first_run:  # first, while the engine is fresh
        first_run(llm)
    elif args.first_prefill:
        first_prefill(llm)
    if args.graphs:
        graph_replay(llm.engine.executor.runner, args.context)
    if args.timeline:
        timeline(llm)
    if args.workload:
        steady_decode(llm.engine, args.workload)
        profile_steps(llm.engine, args.steps)


if __name__ == "__main__":
    main()
