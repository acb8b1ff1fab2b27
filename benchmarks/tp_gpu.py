"""Tensor parallelism on two GPUs over NCCL: parity, W1 scaling, all-reduce cost, a killed rank.

Run on a machine with two GPUs (the device kind nvidia-h200-x2), from the repository root:

    python benchmarks/tp_gpu.py --model /tmp/q06 [--out results.json]

1. Parity: greedy tokens of 16 prompts (10-300 tokens, 32 generated) at TP=2 against TP=1, in
   fp32 (CUDA graphs on and off) and bf16 (graphs on). fp32 should agree token for token; bf16
   is reported as it comes (TP sums the row-parallel projections in another order).
2. W1 (docs/benchmarks.md) at TP=1 and TP=2, with each engine's start-up time (`bench.py`).
3. NCCL all-reduce of one decode step's activations (batch x hidden, bf16), twice per layer.
4. A rank killed mid-generate: how long until `generate` raises, and whether any process is left.

Each engine runs in its own child process, so every configuration starts from a fresh CUDA
context and process group.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(argv: list[str], timeout: float = 240) -> dict:
    """Run this script as `--child ...` and return the JSON it prints last. A child that hangs
    dumps every thread's Python stack to stderr (faulthandler) before the timeout and exits,
    and the tail of that comes back as the error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NANOVLLM_TP_TIMEOUT_S="120", HANG_DUMP_S=str(timeout - 30))
    proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": "timed out: " + err[-3000:]}
    if proc.returncode != 0:
        return {"error": err[-3000:]}
    return json.loads(out.strip().splitlines()[-1])


def compare(ref: list[list[int]], other: list[list[int]]) -> dict:
    """How far two runs' greedy tokens agree, prompt by prompt."""
    pairs = list(zip(ref, other))
    agreeing = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    return dict(identical_prompts=f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
                first_token_equal=f"{sum(a[0] == b[0] for a, b in pairs)}/{len(pairs)}",
                mean_agreeing_prefix=sum(agreeing) / len(pairs))


def parity_child(model: str, tp: int, dtype: str, eager: bool) -> dict:
    from nanovllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, enforce_eager=eager, max_model_len=1024,
              max_num_seqs=64, gpu_memory_utilization=0.5)
    start_s = time.perf_counter() - t
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 10000) for _ in range(rng.randrange(10, 300))] for _ in range(16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return {"start_s": start_s, "tokens": [o.outputs[0].token_ids for o in outs]}


def allreduce_child(rank: int, world: int, port: int, rows: list[int], results) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, None, False)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    out = {}
    for n in rows:
        x = torch.randn(n, 1024, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(500):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        if rank == 0:
            out[str(n)] = start.elapsed_time(end) / 500 * 1e3  # us per call
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def kill_child(model: str) -> dict:
    import psutil

    from nanovllm import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.5)
    pids = list(llm.engine.executor.worker_pids)
    killed_at: list[float] = []

    def kill_when_decoding() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(s.num_completion_tokens >= 3 for s in list(llm.engine.scheduler.running)):
                killed_at.append(time.monotonic())
                os.kill(pids[0], signal.SIGKILL)
                return
            time.sleep(0.001)

    threading.Thread(target=kill_when_decoding, daemon=True).start()
    error = None
    try:
        llm.generate([[1, 2, 3] * 50] * 32, SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    raised_at = time.monotonic()
    llm.shutdown()
    time.sleep(1.0)
    workers_left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    # multiprocessing's resource tracker is the one child expected to stay until this process exits.
    others = [" ".join(c.cmdline())[-80:] for c in psutil.Process().children(recursive=True) if c.pid not in pids]
    return {"error": error, "raise_after_kill_s": raised_at - killed_at[0] if killed_at else None,
            "workers_left": workers_left, "other_children": others}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs="*", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-w1", action="store_true")
    args = ap.parse_args()
    if args.child is not None:
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ.get("HANG_DUMP_S", "210")), exit=True)
        kind, *rest = args.child
        if kind == "parity":
            tp, dtype, eager = rest
            print(json.dumps(parity_child(args.model, int(tp), dtype, eager == "1")))
        elif kind == "kill":
            print(json.dumps(kill_child(args.model)))
        return

    report: dict = {"parity": {}, "w1": {}}
    runs = {}
    for tp, dtype, eager in [(1, "float32", "0"), (2, "float32", "0"), (2, "float32", "1"),
                             (1, "bfloat16", "0"), (2, "bfloat16", "0")]:
        runs[(tp, dtype, eager)] = r = child(["--model", args.model, "--child", "parity", str(tp), dtype, eager])
        print(f"parity run tp={tp} {dtype} eager={eager}: start {r.get('start_s', float('nan')):.1f} s"
              + (f" ERROR {r['error']}" if "error" in r else ""), flush=True)
    for dtype, eager in [("float32", "0"), ("float32", "1"), ("bfloat16", "0")]:
        ref, tp2 = runs[(1, dtype, "0")].get("tokens"), runs[(2, dtype, eager)].get("tokens")
        if ref is None or tp2 is None:
            continue
        label = f"{dtype} graphs={'off' if eager == '1' else 'on'}"
        report["parity"][label] = compare(ref, tp2)
        print("parity", label, report["parity"][label], flush=True)

    if not args.skip_w1:
        for tp in (1, 2):
            proc = subprocess.run([sys.executable, "benchmarks/bench.py", "--model", args.model, "--workload", "w1",
                                   "--runs", "2", "--tensor-parallel-size", str(tp)],
                                  capture_output=True, text=True, cwd=ROOT, timeout=400)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("startup", "W1", "{"))]
            report["w1"][f"tp{tp}"] = lines or proc.stderr[-1500:]
            print(f"W1 tp={tp}:", *lines, sep="\n  ", flush=True)

    import multiprocessing

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # port 0: a free one
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=allreduce_child, args=(r, 2, store.port, [8, 64, 256], results)) for r in range(2)]
    for p in procs:
        p.start()
    us = results.get(timeout=180)
    for p in procs:
        p.join(60)
    # Two all-reduces per layer (after o_proj and down_proj), 28 layers.
    report["allreduce_us_per_call"] = us
    report["allreduce_ms_per_step"] = {n: v * 56 / 1e3 for n, v in us.items()}
    print("all-reduce (bf16 rows x 1024), us per call:", us, "-> ms per step (x56):", report["allreduce_ms_per_step"],
          flush=True)

    report["kill"] = child(["--model", args.model, "--child", "kill"])
    print("kill:", report["kill"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
