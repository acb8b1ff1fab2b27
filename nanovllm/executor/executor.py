"""Runs each step on every tensor-parallel rank.

The engine sees three things: `num_kvcache_blocks` (the pool every rank allocated), `execute(step)`
and `shutdown()`. With one rank the model runner lives in this process and a step is a method
call. With N ranks, `multiproc.MultiprocExecutor` keeps rank 0 here and runs ranks 1..N-1 in
worker processes behind the same three members.

`NANOVLLM_EXECUTOR=mp` sends a one-rank engine through MultiprocExecutor too (no workers; the
process group has one rank). It exists to measure that path's overhead against the in-process
one (benchmarks/tp_overhead.py), not for serving.
"""
from __future__ import annotations

import os
from typing import Protocol

from nanovllm.config import EngineConfig
from nanovllm.distributed import tp_size
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.loaders.source import ModelSource
from nanovllm.runner.model_runner import ModelRunner, RunnerOutput

EXECUTOR_ENV = "NANOVLLM_EXECUTOR"


class Executor(Protocol):
    num_kvcache_blocks: int
    decode_burst: int

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        if tp_size() != 1:
            # The layers would shard themselves by the process group already set up here.
            raise RuntimeError(
                f"torch.distributed is initialized with {tp_size()} ranks in this process (a tensor-parallel "
                "engine is running?); shut it down before creating a single-rank engine"
            )
        self.runner = ModelRunner(config, source, rank=0)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.device_type = self.runner.device.type

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(out)

    @property
    def decode_burst(self) -> int:
        """Decode steps a lone greedy or plain-temperature sequence may run per engine step
        (Scheduler.schedule)."""
        return self.runner.decode_burst

    def execute_async(self, out: SchedulerOutput):
        """Launch the step; `.result()` on the return value waits for its sampled ids."""
        return self.runner.execute_async(out)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    kind = os.environ.get(EXECUTOR_ENV, "")
    if kind not in ("", "inprocess", "mp"):
        raise ValueError(f"{EXECUTOR_ENV}={kind!r}: expected 'inprocess' or 'mp'")
    if config.tensor_parallel_size == 1 and kind != "mp":
        return InProcessExecutor(config, source)
    from nanovllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source)
