"""Cold start: process start to the first generated token, with each part (issue: <= 20 s).

Run it twice in fresh processes: the first start on a new machine compiles the Triton kernels
(and fills Triton's on-disk cache); the second start reads them from the cache. Also printed:
when the persistent decode kernel, compiled in the background, was ready (after the first token).

    python benchmarks/startup.py --model /tmp/q06
"""
from __future__ import annotations

import argparse
import json
import time

T_SCRIPT = time.time()


def process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except ImportError:
        return T_SCRIPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-persistent-decode", dest="persistent_decode", action="store_false")
    args = ap.parse_args()
    t0 = process_start()
    t = time.time()
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()
    t_torch = time.time()
    from nanovllm import LLM, SamplingParams

    t_import = time.time()
    llm = LLM(args.model, max_model_len=4096, enforce_eager=args.enforce_eager, device=args.device,
              persistent_decode=args.persistent_decode)
    t_llm = time.time()
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=1), use_tqdm=False)
    t_first = time.time()
    # The persistent decode kernel compiles in the background; from when on a lone decode uses it.
    llm.engine.executor.runner.finish_background_compile()
    t_persistent = time.time()
    parts = {
        "interpreter_to_script_s": t - t0,
        "import_torch_and_cuda_init_s": t_torch - t,
        "import_nanovllm_s": t_import - t_torch,
        **{f"engine_{k}_s": v for k, v in llm.engine.startup_seconds.items()},
        **{f"runner_{k}_s": v for k, v in llm.engine.executor.runner.startup_seconds.items()},
        "llm_total_s": t_llm - t_import,
        "first_token_s": t_first - t_llm,
        "total_process_start_to_first_token_s": t_first - t0,
        "process_start_to_persistent_kernel_ready_s": t_persistent - t0,
    }
    print(json.dumps({k: round(v, 2) for k, v in parts.items()}))


if __name__ == "__main__":
    main()
