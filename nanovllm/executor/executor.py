"""Runs each step on every tensor-parallel rank.

With one rank the model runner lives in this process and a step is a method call. (Worker
processes for tensor parallelism plug in behind the same three methods.)
"""
from __future__ import annotations

from nanovllm.config import EngineConfig
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.loaders.source import ModelSource
from nanovllm.runner.model_runner import ModelRunner, RunnerOutput


class InProcessExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.runner = ModelRunner(config, source, rank=0)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(out)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, source: ModelSource):
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config, source)
    from nanovllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source)
