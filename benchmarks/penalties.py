"""What penalties cost a sampling step, and the two ways to keep the token counts they need.

    python benchmarks/penalties.py [--rows 32] [--vocab 151936] [--output-len 1000] [--device cpu]

Per step, milliseconds (median of --iters):
- sampler_plain: the per-op sampler (temperature 0.7) with no penalties;
- sampler_half / sampler_all: the same with presence, frequency and repetition penalties and a
  logit bias on half / all of the rows (counts gathered from runner/penalty_state.py);
- incremental: PenaltyState.gather + record, the runner's bookkeeping per step;
- rebuild: building the [rows, vocab] counts and seen mask from scratch with scatter_add_
  from each row's prompt and --output-len output ids (what a stateless design pays per step,
  growing with the output length), host lists included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.runner.penalty_state import PenaltyState
from nanovllm.sampling_params import SamplingParams
from nanovllm.step import ScheduledSeq


def median_ms(fn, iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times[2:]), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows, vocab = args.rows, args.vocab
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    logits = torch.randn(rows, vocab, device=device)
    plain = SamplingParams(temperature=0.7)
    pen = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                         repetition_penalty=1.1, logit_bias={5: 2.0, 77: -100.0})
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, vocab, args.output_len).tolist() for _ in range(rows)]
    sampler = Sampler(fused=False)
    result = {"rows": rows, "vocab": vocab, "output_len": args.output_len, "device": str(device)}

    def step(params: list[SamplingParams], state: PenaltyState, first: bool) -> None:
        items = [ScheduledSeq(i, [0], 0, [], True, p, None, None,
                              penalty_prompt_ids=prompts[i] if first and p.penalized else None)
                 for i, p in enumerate(params)]
        slots = stats = None
        if any(p.penalized for p in params):
            slots, *stats = state.gather(items)
        st = SamplingTensors.from_params(params, None, vocab, device, token_stats=stats)
        out = sampler(logits, st)
        if st.penalties is not None:
            state.record(slots, out.token_ids[st.penalties.rows])

    for name, params in (("sampler_plain", [plain] * rows),
                         ("sampler_half", [pen if i % 2 else plain for i in range(rows)]),
                         ("sampler_all", [pen] * rows)):
        state = PenaltyState(vocab, device)
        step(params, state, first=True)
        result[f"{name}_ms"] = median_ms(lambda: step(params, state, first=False), args.iters, device)

    state = PenaltyState(vocab, device)
    items = [ScheduledSeq(i, [0], 0, [], True, pen, None, None, penalty_prompt_ids=prompts[i]) for i in range(rows)]
    state.gather(items)
    decode_items = [ScheduledSeq(i, [0], 0, [], True, pen, None, None) for i in range(rows)]
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)

    def incremental() -> None:
        slots, _, _ = state.gather(decode_items)
        state.record(slots, tokens)

    def rebuild() -> None:
        lengths = [len(o) for o in outputs]
        out_ids = torch.from_numpy(np.concatenate([np.asarray(o, dtype=np.int64) for o in outputs])).to(device)
        row_of = torch.from_numpy(np.repeat(np.arange(rows), lengths)).to(device)
        counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        counts.view(-1).scatter_add_(0, row_of * vocab + out_ids, torch.ones_like(out_ids, dtype=torch.int32))
        prompt_ids = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])).to(device)
        prompt_row = torch.from_numpy(np.repeat(np.arange(rows), [len(p) for p in prompts])).to(device)
        seen = counts > 0
        seen.view(-1)[prompt_row * vocab + prompt_ids] = True

    result["incremental_ms"] = median_ms(incremental, args.iters, device)
    result["rebuild_ms"] = median_ms(rebuild, args.iters, device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
