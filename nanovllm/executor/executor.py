"""Runs each step on every tensor-parallel rank.

The engine sees the `Executor` interface below. With one rank the model runner lives in this
process and a step is a method call, which can be launched without waiting for it
(`supports_async`). With N ranks, `multiproc.MultiprocExecutor` keeps rank 0 here and runs
ranks 1..N-1 in worker processes behind the same interface, one step at a time.
"""
from __future__ import annotations

from typing import Protocol

from nanovllm.config import EngineConfig
from nanovllm.distributed import tp_size
from nanovllm.loaders.source import ModelSource
from nanovllm.runner.model_runner import DeferredSample, ModelRunner, RunnerOutput
from nanovllm.step_result import StepResult
from nanovllm.step import SchedulerOutput


class Executor(Protocol):
    num_kvcache_blocks: int
    decode_burst: int  # decode steps a lone greedy or plain-temperature sequence may run per step
    device_type: str  # "cuda" or "cpu": where the steps run
    supports_async: bool  # execute_async launches a step without waiting for it
    # launch_forward launches a step's forward pass and leaves its sampling for later
    defers_sampling: bool

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    def execute_async(self, out: SchedulerOutput) -> StepResult:
        """Launch the step; `.result()` on the return value waits for its sampled ids (only
        where supports_async)."""
        ...

    def launch_forward(self, out: SchedulerOutput) -> DeferredSample:
        """Launch the step's forward pass; `.sample()` on the return value launches its
        sampling and returns what execute_async would (only where defers_sampling)."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    supports_async = True
    defers_sampling = True

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

    def execute_async(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute_async(out)

    def launch_forward(self, out: SchedulerOutput) -> DeferredSample:
        return self.runner.launch_forward(out)

    def shutdown(self) -> None:
        self.runner.release_compiled()


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config, source)
    from nanovllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source)
