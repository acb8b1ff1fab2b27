"""Host time of one engine-core step at 64 streaming requests, by how far their outputs have
grown: the engine's own work (scheduling, resolving the step's tokens, stop rules, building the
outputs), the core's conversion of the outputs into per-front-end messages, and the model runner
beside them. A micro model on the CPU keeps the runner small, so the engine's part shows; the
same Python runs on a GPU host.

    python benchmarks/core_steps.py                     # a micro Qwen3 built in /tmp/nanovllm-micro
    python benchmarks/core_steps.py --lengths 256 2048 8192 --rows 64
    python benchmarks/core_steps.py --stub-runner       # the engine's time alone, steadier

Prints, per output length: microseconds a step in the engine outside the runner, in the runner,
in the core's collect (outputs into messages) and publish (stats, encoding and sending the messages).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MICRO_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960, hidden_act="silu",
    attention_bias=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model directory (default: a micro Qwen3, built once)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192],
                    help="output lengths at which the steps are timed")
    ap.add_argument("--steps", type=int, default=200, help="steps timed at each length")
    ap.add_argument("--stub-runner", action="store_true",
                    help="replace the model runner by a stub that samples token 5 at once: the engine's "
                         "own time without the runner's effect on the CPU's caches")
    args = ap.parse_args()

    from common import make_random_checkpoint

    from nanovllm.config import EngineConfig
    from nanovllm.engine.core import CoreAddresses, EngineCore
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.messages import AddRequest, params_to_wire
    from nanovllm.sampling_params import SamplingParams

    model = args.model or str(make_random_checkpoint(Path(tempfile.gettempdir()) / "nanovllm-micro", MICRO_QWEN3))
    longest = max(args.lengths) + args.steps
    engine = LLMEngine(EngineConfig.from_kwargs(model, device="cpu", max_model_len=longest + 64, decode_burst=1,
                                                max_num_seqs=args.rows), detokenize=False)
    sockets = tempfile.mkdtemp(prefix="core-steps-")
    core = EngineCore(engine, CoreAddresses(f"ipc://{sockets}/in", f"ipc://{sockets}/out"), max_pending=10**6)

    executor = engine.executor
    if args.stub_runner:
        from nanovllm.runner.model_runner import RunnerOutput

        class Sampled:
            def __init__(self, out: RunnerOutput) -> None:
                self.out = out

            def result(self) -> RunnerOutput:
                return self.out

        def execute_async(sched):
            return Sampled(RunnerOutput([5] * sum(1 for s in sched.seqs if s.sample)))

        executor.execute_async = execute_async
        executor.execute = lambda sched: execute_async(sched).result()
    runner_seconds = [0.0]
    for name in ("execute", "execute_async", "launch_forward"):
        inner = getattr(executor, name, None)
        if inner is None:
            continue

        def timed(*a, _inner=inner, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                runner_seconds[0] += time.perf_counter() - t

        setattr(executor, name, timed)

    params = params_to_wire(SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True))
    replies: dict = {}
    for i in range(args.rows):  # the front-end's identity need not be connected: sends to it are dropped
        core._handle(b"frontend", AddRequest(f"r{i}", [5 + i % 400, 7, 9, 11] * 8, params), replies)
    core._publish(replies)

    def step() -> tuple[float, float, float]:
        replies: dict = {}
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        core._collect(outputs, replies)
        t2 = time.perf_counter()
        core._publish(replies)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    print(f"{args.rows} streaming requests, {model}")
    print(f"{'output length':>14} {'engine us':>10} {'runner us':>10} {'collect us':>11} {'publish us':>11}")
    done = 0
    for length in sorted(args.lengths):
        while done < length:
            step()
            done += 1
        runner_seconds[0] = 0.0
        totals = [0.0, 0.0, 0.0]
        for _ in range(args.steps):
            for k, seconds in enumerate(step()):
                totals[k] += seconds
        done += args.steps
        per = [1e6 * t / args.steps for t in totals]
        runner = 1e6 * runner_seconds[0] / args.steps
        print(f"{length:>14} {per[0] - runner:>10.0f} {runner:>10.0f} {per[1]:>11.0f} {per[2]:>11.0f}")
    os._exit(0)  # the core's I/O threads block in their sockets


if __name__ == "__main__":
    main()
