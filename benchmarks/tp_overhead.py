"""What the tensor-parallel executor path costs at TP=1 (issue 4: at most 3% of W1 throughput).

Run on the H200 from the repository root:

    python3 benchmarks/tp_overhead.py [--repeats 3] [--out DIR]

1. Builds a random-weight Qwen3-0.6B-shaped checkpoint (bf16) in a temporary directory, unless
   --model names one.
2. Creates two engines side by side in this process, on the same GPU: one through
   InProcessExecutor, one through MultiprocExecutor with one rank (put in by this script: the
   process group, the per-step checks and bookkeeping of the TP path, with no worker to talk
   to). Both get the same explicit KV pool (--num-kvcache-blocks, default: enough for the whole
   workload, so neither preempts) so the two fit on one GPU together.
3. Warms both up on a slice of the workload, then runs W1 (docs/benchmarks.md: nano-vllm's bench.py
   workload) on each, alternating A B, B A, A B ... so drift hits both alike; reports the median
   output tok/s of each and the ratio.
4. Times the TP>1 control channel alone, which TP=1 never pays: a W1-sized step message
   (a 256-sequence decode step, a 16k-token prefill step) is encoded, pickled, sent through a
   Pipe to a spawned process that decodes it and acknowledges, and compared with the measured
   mean step time.

The short table is printed last; with --out the numbers are also written as JSON.
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import llm_engine  # noqa: E402
from nanovllm.executor.multiproc import MultiprocExecutor, _dumps, decode_step, encode_step  # noqa: E402
from nanovllm.step import ScheduledSeq, SchedulerOutput  # noqa: E402

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
)


def make_checkpoint(path: Path, device: str) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_06B), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def w1(num_seqs: int, max_input: int, max_output: int, vocab: int):
    """nano-vllm's bench.py workload (W1), token ids capped to the vocabulary."""
    random.seed(0)
    top = min(10000, vocab - 1)
    prompts = [[random.randint(0, top) for _ in range(random.randint(100, max_input))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, max_output))
              for _ in range(num_seqs)]
    return prompts, params


def count_steps(llm: LLM) -> list[int]:
    """Count executor steps (a wrapper on the instance, installed on both engines alike)."""
    counter = [0]
    ex = llm.engine.executor
    execute = ex.execute

    def counted(out):
        counter[0] += 1
        return execute(out)

    ex.execute = counted
    return counter


# ---- the control channel alone ----------------------------------------------------------------
def _echo(conn) -> None:
    """Stand-in worker: decode each step message and acknowledge it, as _worker_main does."""
    while True:
        step, payload = pickle.loads(conn.recv_bytes())
        if payload is None:
            return
        decode_step(payload)
        conn.send_bytes(_dumps(("ack", step)))


def synthetic_step(num_seqs: int, tokens_per_seq: int, blocks_per_seq: int) -> SchedulerOutput:
    rng = random.Random(0)
    seqs = [
        ScheduledSeq(i, [rng.randrange(10000) for _ in range(tokens_per_seq)], 1000,
                     [rng.randrange(20000) for _ in range(blocks_per_seq)], True, SamplingParams(), None, None)
        for i in range(num_seqs)
    ]
    decodes = num_seqs if tokens_per_seq == 1 else 0
    return SchedulerOutput(seqs, decodes, num_seqs * tokens_per_seq)


def time_channel(iters: int = 200) -> list[dict]:
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    rows = []
    try:
        for name, out in [
            ("decode: 256 seqs x 70 blocks", synthetic_step(256, 1, 70)),
            ("prefill: 16 seqs x 1024 tokens", synthetic_step(16, 1024, 64)),
        ]:
            sent, roundtrip = [], []
            for k in range(iters):
                t0 = time.perf_counter()
                data = _dumps((k, encode_step(out)))
                parent.send_bytes(data)
                t1 = time.perf_counter()
                parent.recv_bytes()
                t2 = time.perf_counter()
                sent.append(t1 - t0)
                roundtrip.append(t2 - t0)
            rows.append(dict(step=name, bytes=len(data), send_us=statistics.median(sent) * 1e6,
                             roundtrip_us=statistics.median(roundtrip) * 1e6))
    finally:
        parent.send_bytes(_dumps((None, None)))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an existing Qwen3-0.6B-shaped checkpoint (default: build a random one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--num-kvcache-blocks", type=int, default=None)
    ap.add_argument("--out", help="directory for results.json")
    args = ap.parse_args()

    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="tp_overhead_")
        t0 = time.perf_counter()
        path = str(make_checkpoint(Path(tmp.name), args.device))
        print(f"random Qwen3-0.6B checkpoint written in {time.perf_counter() - t0:.1f}s", flush=True)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts, params = w1(args.num_seqs, args.max_input_len, args.max_output_len, vocab)
    block_size = 16
    blocks = args.num_kvcache_blocks or sum(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params)) + 256
    # Like for like: the multiprocess executor steps synchronously, so the in-process engine is
    # measured with async scheduling off too (the overlap is measured in bench.py).
    opts = dict(device=args.device, max_model_len=4096, num_kvcache_blocks=blocks, kvcache_block_size=block_size,
                async_scheduling=False)
    # Every timed run must prefill from scratch, as W1 does once: clear the prefix cache between
    # runs, or (on a checkout without reset_prefix_cache) run without it.
    can_reset = hasattr(LLM, "reset_prefix_cache")
    if not can_reset:
        opts["enable_prefix_caching"] = False

    engines: dict[str, LLM] = {}
    make_executor = llm_engine.make_executor
    for name, multiproc in [("in-process", False), ("mp, TP=1", True)]:
        if multiproc:  # the TP path with one rank, which the engine never takes on its own
            llm_engine.make_executor = lambda config, source: MultiprocExecutor(config, source)
        t0 = time.perf_counter()
        try:
            engines[name] = LLM(path, **opts)
        finally:
            llm_engine.make_executor = make_executor
        print(f"{name}: {type(engines[name].engine.executor).__name__} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    # Warm-up (bench.py does one short generate): a slice of the workload, so kernels for
    # long prefills and large decode batches are compiled before either path is timed.
    warm = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=32)] * min(32, len(prompts))
    for llm in engines.values():
        llm.generate(prompts[: len(warm)], warm, use_tqdm=False)

    names = list(engines)
    counters = {name: count_steps(llm) for name, llm in engines.items()}
    results: dict[str, dict] = {n: dict(tok_s=[], seconds=[], steps=[]) for n in names}
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            llm = engines[name]
            steps = counters[name]
            steps[0] = 0
            preempt0 = llm.engine.scheduler.num_preemptions
            if can_reset:
                llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            res = results[name]
            res["tok_s"].append(n_out / dt)
            res["seconds"].append(dt)
            res["steps"].append(steps[0])
            res["output_tokens"] = n_out
            res["preemptions"] = llm.engine.scheduler.num_preemptions - preempt0
            print(f"run {r} {name}: {n_out / dt:,.0f} tok/s ({dt:.2f}s, {steps[0]} steps)", flush=True)
    for llm in engines.values():
        llm.shutdown()
    channel = time_channel()
    if tmp is not None:
        tmp.cleanup()

    base = statistics.median(results[names[0]]["tok_s"])
    mean_step_ms = statistics.median(results[names[0]]["seconds"]) / statistics.median(results[names[0]]["steps"]) * 1e3
    print(f"\nW1 ({args.num_seqs} seqs, {results[names[0]]['output_tokens']:,} output tokens) on "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, KV pool {blocks} blocks, "
          f"prefix cache {'reset before each run' if can_reset else 'off'}")
    print("| path | median tok/s | runs tok/s | steps | preemptions | vs in-process |")
    print("|---|---|---|---|---|---|")
    for name in names:
        res = results[name]
        med = statistics.median(res["tok_s"])
        runs = " ".join(f"{x:,.0f}" for x in res["tok_s"])
        print(f"| {name} | {med:,.0f} | {runs} | {res['steps'][-1]} | {res['preemptions']} | {med / base:.3f} |")
    # The driver pays encode+send before rank 0 starts; the worker's decode overlaps rank 0's own
    # batch preparation, and its ack arrives while rank 0 samples, so the round trip is an upper bound.
    print(f"\nTP>1 control channel per step (one worker; mean W1 step here {mean_step_ms:.2f} ms):")
    print("| step message | bytes | driver encode+send us | round trip us (upper bound) | of a mean step |")
    print("|---|---|---|---|---|")
    for row in channel:
        print(f"| {row['step']} | {row['bytes']:,} | {row['send_us']:.0f} | {row['roundtrip_us']:.0f} | "
              f"{row['send_us'] / 1e3 / mean_step_ms:.1%} - {row['roundtrip_us'] / 1e3 / mean_step_ms:.1%} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_overhead.json").write_text(json.dumps(
            dict(results=results, channel=channel, mean_step_ms=mean_step_ms, blocks=blocks, args=vars(args)), indent=1))


if __name__ == "__main__":
    main()
