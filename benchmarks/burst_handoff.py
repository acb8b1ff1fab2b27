"""What a decode burst pays between two graph replays, by where its inputs come from and where
its tokens go (H200; docs/benchmarks.md, W5 session 21).

    python benchmarks/burst_handoff.py [--us 400] [--replays 40]

A stand-in for the burst's kernel spins for --us microseconds on one program per SM (global
timer), reads its input records and writes 8 tokens. Each variant replays it --replays times
back to back (the host far ahead, as async scheduling keeps it) and prints the time per replay
beyond the spin, four rounds:
  now-before   input copy, graph, token copy, all on one stream (the engine before session 21)
  graph-only   the graph alone: the floor
  to-host      the graph alone, the kernel writing its tokens into pinned host memory
  copy+to-host input copy on the same stream, then that graph
  side-stream  inputs copied on a second stream into one of two buffers (one graph each, in
               turn) while the replay before runs; the kernel writes its tokens to the host
               (what the engine does now: CudaGraphRunner.uploading, replay_burst)
  fetch        the kernel reads its inputs from pinned host memory itself (zero-copy)
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

RECORD = 12  # int64 words per input record (SingleDecodeInputs.RECORD bytes / 8)
STEPS = 8


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin(src, dst, tokens, ns, FETCH: tl.constexpr, STEPS: tl.constexpr, RECORD: tl.constexpr):
    """Program p < STEPS copies record p from src to dst if FETCH; every program spins ns
    nanoseconds; program 0 writes STEPS tokens."""
    pid = tl.program_id(0)
    words = tl.arange(0, 16)
    if FETCH:
        if pid < STEPS:
            v = tl.load(src + pid * RECORD + words, mask=words < RECORD, volatile=True)
            tl.store(dst + pid * RECORD + words, v, mask=words < RECORD)
    t0 = _now()
    x = tl.load(dst + pid % STEPS * RECORD)
    while _now() - t0 < ns:
        x += 1
    if pid == 0:
        tl.store(tokens + tl.arange(0, STEPS), x + tl.arange(0, STEPS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--us", type=int, default=400)
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ns = args.us * 1000
    words = STEPS * RECORD
    host_in = [torch.zeros(words, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    host_tokens = [torch.zeros(STEPS, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    inputs = [torch.zeros(words, dtype=torch.int64, device=dev) for _ in range(2)]
    dev_tokens = torch.zeros(STEPS, dtype=torch.int64, device=dev)
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()

    def graph(fn) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                fn()
        torch.cuda.synchronize()
        return g

    def spin(j: int, fetch: bool = False, to_host: bool = True) -> None:
        _spin[(sms,)](host_in[j] if fetch else inputs[j], inputs[j], host_tokens[j] if to_host else dev_tokens, ns,
                      fetch, STEPS, RECORD, num_warps=8)

    on_device = graph(lambda: spin(0, to_host=False))
    to_host = [graph(lambda j=j: spin(j)) for j in range(2)]
    fetch = [graph(lambda j=j: spin(j, fetch=True)) for j in range(2)]
    uploaded = [torch.cuda.Event() for _ in range(2)]
    done_with = [torch.cuda.Event() for _ in range(2)]

    def now_before(j: int) -> None:
        inputs[0].copy_(host_in[j], non_blocking=True)
        on_device.replay()
        host_tokens[j].copy_(dev_tokens, non_blocking=True)

    def copy_to_host(j: int) -> None:
        inputs[j].copy_(host_in[j], non_blocking=True)
        to_host[j].replay()

    def side_stream(j: int) -> None:
        side.wait_event(done_with[j])
        with torch.cuda.stream(side):
            inputs[j].copy_(host_in[j], non_blocking=True)
            uploaded[j].record(side)
        stream.wait_event(uploaded[j])
        to_host[j].replay()
        done_with[j].record(stream)

    variants = {
        "now-before": now_before, "graph-only": lambda j: on_device.replay(), "to-host": lambda j: to_host[j].replay(),
        "copy+to-host": copy_to_host, "side-stream": side_stream, "fetch": lambda j: fetch[j].replay(),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    with torch.cuda.stream(stream):
        for _ in range(4):
            for name, fn in variants.items():
                for i in range(3):
                    fn(i % 2)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for i in range(args.replays):
                    fn(i % 2)
                end.record(stream)
                end.synchronize()
                results[name].append(start.elapsed_time(end) * 1e3 / args.replays - args.us)
    for name, overheads in results.items():
        print(f"{name:13s} us per replay beyond the kernel: " + " ".join(f"{x:6.2f}" for x in overheads))


if __name__ == "__main__":
    main()
