"""Where a decode step's host time goes, unconstrained and with every request under a JSON
schema (benchmarks/structured_schema.json), offline: 64 greedy requests of 128 prompt tokens,
128 tokens each, decode bursts off (so both sides step one token at a time).

    python benchmarks/structured_steps.py MODEL        # a model directory (152k vocabulary on the H200:
                                                       # see docs/benchmarks.md, Structured output)
    python benchmarks/structured_steps.py MODEL --arrivals steady   # 512 requests, 64 in flight, as under load

Prints, for each of two rounds of each kind, tok/s, ms per engine step, how many greedy tokens
sampled without their masks were checked and refused, how many masks were filled, and per
step the time spent in the engine's phases (wall time around the engine's and runner's
methods; nested ones are counted in their callers too): scheduling, building the forward
pass's inputs and launching it, checking the previous step's unmasked greedy tokens (and
rolling back refused ones), waiting for and processing the previous step's tokens, filling
the step's masks, staging them for the device, launching the sampling.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

SCHEMA_FILE = Path(__file__).with_name("structured_schema.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--arrivals", choices=["together", "steady"], default="together",
                    help="together: 64 requests start at once; steady: 512 requests, 64 in flight, a new one "
                         "as one ends, the first 64 of staggered lengths (new requests arrive every other step, "
                         "as under W4's load)")
    args = ap.parse_args()

    import nanovllm.engine.grammars as grammars
    import nanovllm.engine.llm_engine as llm_engine
    import nanovllm.layers.sampler as sampler
    import nanovllm.runner.model_runner as model_runner
    import nanovllm.step_result as step_result
    import nanovllm.structured.bitmask as bitmask
    from nanovllm import LLM, SamplingParams
    from nanovllm.sampling_params import StructuredOutputsParams

    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # a phase this checkout does not have (comparing with another tree)
            return

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(owner, name, wrapper)

    timed(llm_engine.LLMEngine, "step", "engine step")
    timed(model_runner.ModelRunner, "execute_async", "launch forward + sampling (unconstrained)")
    timed(model_runner.ModelRunner, "launch_forward", "build the inputs and launch forward (constrained)")
    timed(step_result.PendingOutput, "result", "wait for the previous tokens")
    timed(llm_engine.LLMEngine, "_process", "process the previous tokens")
    timed(grammars.Grammars, "refresh", "fill the masks")
    timed(bitmask.BitmaskStaging, "build", "stage the masks")
    timed(model_runner.DeferredSample, "sample", "launch sampling (constrained)")
    timed(llm_engine.LLMEngine, "_check", "check unmasked greedy tokens, roll back refused ones")
    timed(grammars.Grammars, "check", "  of which: matchers take the unmasked tokens")
    timed(grammars.Grammars, "_fill", "  xgrammar fills masks (in refresh)")
    timed(sampler.SamplingTensors, "from_params", "  sampling parameters to tensors")
    timed(sampler.Sampler, "forward", "  sampler launches")
    checks = collections.Counter()
    check = grammars.Grammars.check

    def counted_check(self, rows, tokens):
        refused = check(self, rows, tokens)
        checks["checked"] += len(rows)
        checks["refused"] += len(refused)
        return refused

    grammars.Grammars.check = counted_check
    fill = grammars.Grammars._fill

    def counted_fill(self, seq_ids):
        fill(self, seq_ids)
        checks["filled"] += len(seq_ids)

    grammars.Grammars._fill = counted_fill

    llm = LLM(args.model, max_model_len=1024, decode_burst=1)
    timed(type(llm.engine.scheduler), "schedule", "schedule")
    schema = json.loads(SCHEMA_FILE.read_text())
    prompts = [[5 + i, 7, 9, 11] * 32 for i in range(64)]
    plain = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    llm.generate(prompts[:4], constrained, use_tqdm=False)  # the grammar compiled, both paths warm
    llm.generate(prompts, plain, use_tqdm=False)
    run = run_together if args.arrivals == "together" else run_steady
    for name, params in [("unconstrained", plain), ("JSON schema", constrained)] * 2:
        seconds.clear()
        calls.clear()
        checks.clear()
        t = time.perf_counter()
        tokens = run(llm, prompts, params)
        elapsed = time.perf_counter() - t
        steps = calls["engine step"]
        print(f"{name}: {tokens} tokens in {elapsed:.3f} s, {tokens / elapsed:.0f} tok/s, {steps} steps, "
              f"{elapsed / steps * 1e3:.2f} ms per step; unmasked tokens checked {checks['checked']}, "
              f"refused {checks['refused']}; masks filled {checks['filled']}")
        for label in seconds:
            print(f"    {label:45s} {seconds[label] / steps * 1e3:6.3f} ms per step")


def run_together(llm, prompts, params) -> int:
    """Every prompt at once; the tokens generated."""
    return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))


def run_steady(llm, prompts, params, total: int = 512) -> int:
    """`total` requests, len(prompts) in flight: the first ones end after 2, 4, ... tokens (up
    to params.max_tokens), and each that ends is replaced by one of params.max_tokens, so
    requests start and end all the time. The tokens generated."""
    from dataclasses import replace

    engine = llm.engine
    started = tokens = 0

    def start(max_tokens: int) -> None:
        nonlocal started
        engine.add_request(f"steady-{started}", prompts[started % len(prompts)], replace(params, max_tokens=max_tokens))
        started += 1

    for i in range(len(prompts)):
        start(max(1, params.max_tokens * (i + 1) // len(prompts)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                if started < total:
                    start(params.max_tokens)
    return tokens


if __name__ == "__main__":
    main()
