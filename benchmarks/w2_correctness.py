"""W2: correctness at speed on the Qwen3-0.6B shape (random weights), against transformers.

For 16 prompts: first-step logits (max abs difference, and whether the argmax agrees) and how
many greedy tokens agree before the first divergence, in fp32 and bf16. fp32 must agree token
for token; bf16 kernels legitimately diverge after some tokens (reported, not hidden).

    python benchmarks/w2_correctness.py --model /tmp/qwen3-0.6b --make-model
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--make-model", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if args.make_model:
        from common import make_qwen3_06b

        make_qwen3_06b(args.model)
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM, SamplingParams

    seed(1)
    prompts = [[randint(0, 10000) for _ in range(randint(16, 512))] for _ in range(16)]
    n = args.tokens
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        llm = LLM(args.model, dtype=name, max_model_len=2048, gpu_memory_utilization=0.4)
        ours = llm.generate(prompts, sp, use_tqdm=False)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
        agree, exact, first_ok, lp_diff = [], 0, 0, []
        with torch.no_grad():
            for p, o in zip(prompts, ours):
                ids = torch.tensor([p], device="cuda")
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                mine = o.outputs[0].token_ids
                k = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), n)
                agree.append(k)
                exact += k == n
                logits = hf(ids).logits[0, -1].float()
                ref_lp = torch.log_softmax(logits, -1)
                first_ok += int(torch.argmax(logits).item() == mine[0])
                lp_diff.append(abs(ref_lp[mine[0]].item() - o.outputs[0].logprobs[0][mine[0]]))
        del hf
        torch.cuda.empty_cache()
        row = dict(dtype=name, prompts=len(prompts), tokens=n, all_tokens_equal=exact, first_token_equal=first_ok,
                   mean_tokens_before_divergence=sum(agree) / len(agree), min_tokens_before_divergence=min(agree),
                   max_first_logprob_abs_diff=max(lp_diff))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n== W2 summary ==")
    for r in rows:
        print(f"{r['dtype']:>9}: {r['all_tokens_equal']}/{r['prompts']} prompts identical over {r['tokens']} tokens; "
              f"first token equal {r['first_token_equal']}/{r['prompts']}; mean agreement {r['mean_tokens_before_divergence']:.1f} tokens; "
              f"max |first logprob diff| {r['max_first_logprob_abs_diff']:.2e}")


if __name__ == "__main__":
    main()
