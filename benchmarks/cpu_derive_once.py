"""W3 A/B: the CPU decode path with its per-step values derived once (the default) against
derived in every layer, switched in one process (docs/benchmarks.md, W3).

    python benchmarks/cpu_derive_once.py [--quantization int4] [--batch] [--pairs 8]

The torch attention backend keeps a step's plan (slot check, decode block ids and mask) in the
metadata, and the rotary embedding its last cos/sin (attention/torch_backend.py,
layers/rotary.py). "Off" swaps in versions that build them per layer, as before. The two modes
alternate, pair by pair, in one process: this VM's speed drifts by 10-30% between processes,
so per-pair ratios say more than two separate runs. Single-stream: one prompt, 64 greedy
tokens, decode steps only; --batch: 16 prompts, 64 tokens each, one `generate`.
"""
from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
             "What is the boiling point of water?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default=None, choices=["int4"])
    ap.add_argument("--batch", action="store_true")
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    import nanovllm.attention.torch_backend as torch_backend
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.rotary import RotaryEmbedding

    llm = LLM(device="cpu", quantization=args.quantization, dtype="bfloat16" if args.quantization else "auto")
    tok = llm.tokenizer
    prompts = [tok.encode(llm.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS * 4]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    derived_plan, derived_cos_sin = torch_backend._step_plan, RotaryEmbedding._cos_sin

    def plan_per_layer(meta, block_size):
        return torch_backend._StepPlan(meta, block_size)

    def cos_sin_per_layer(self, positions, dtype):
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
        return cos.to(dtype), sin.to(dtype)

    def use(once: bool) -> None:
        torch_backend._step_plan = derived_plan if once else plan_per_layer
        RotaryEmbedding._cos_sin = derived_cos_sin if once else cos_sin_per_layer

    engine = llm.engine

    def single() -> float:
        llm.reset_prefix_cache()
        engine.add_request("s", prompts[0], sp)
        engine.step()
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps / (time.perf_counter() - t)

    def batch() -> float:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    run = batch if args.batch else single
    run()  # warm-up
    results: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.pairs):
        for once in (False, True):
            use(once)
            results[once].append(run())
    use(True)
    ratios = [b / a for a, b in zip(results[False], results[True])]
    print(f"{args.quantization or 'fp32'} {'batch of 16' if args.batch else 'single-stream'}: per layer "
          f"{statistics.median(results[False]):.1f}, once {statistics.median(results[True]):.1f} tok/s (medians); "
          f"per-pair ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
