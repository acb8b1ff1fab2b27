"""Tensor parallelism on CPU over gloo (executor/multiproc.py).

TP=2 must give the same greedy fp32 tokens as TP=1, on a run that goes through prefix-cache hits,
chunked prefill and preemption. A worker that is killed, raises or hangs must make `generate`
raise within a bounded time, leave no process behind, and let a new engine start in the same
process. Two TP engines in two processes at once must not collide, and a process that exits
without calling shutdown() must leave nothing behind either.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.executor.multiproc import MultiprocExecutor, TensorParallelError
from nanovllm.runner.model_runner import ModelRunner

SHAPES = [
    pytest.param(dict(arch="qwen3"), id="qwen3-kv2"),  # one KV head per rank
    pytest.param(dict(arch="llama", num_heads=4, num_kv_heads=1, head_dim=16, tie_word_embeddings=False),
                 id="llama-kv1-replicated-untied"),
    pytest.param(dict(arch="qwen2", num_heads=4, num_kv_heads=2, head_dim=16), id="qwen2-bias"),
]
# Small blocks, a small pool, a small token budget and the prefix cache: the run preempts,
# chunks prompts and (the second time) hits the cache.
STRESSED = dict(kvcache_block_size=4, num_kvcache_blocks=40, max_num_batched_tokens=16, enable_prefix_caching=True)
FAILURE_BOUND_S = 20.0  # generous for a loaded 2-core CI machine; failures take ~0.1-5 s here


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 17, 90, 8, 33)]
    prompts.append(prompts[1][:30] + [5, 6, 7])  # shares a prefix with prompt 1
    return prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def when_decoding(llm: LLM, act) -> tuple[threading.Thread, list[float]]:
    """A started thread that calls act() once a running sequence of llm has 3 tokens (so the
    act lands wherever the driver happens to be: in a collective, sending, waiting for acks),
    and the list it appends that moment to."""
    acted_at: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(s.num_completion_tokens >= 3 for s in list(llm.engine.scheduler.running)):
                acted_at.append(time.monotonic())
                act()
                return
            time.sleep(0.001)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread, acted_at


def tokens(llm: LLM, prompts, n: int = 20) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


def zombie_children() -> list[int]:
    """Our child processes that exited but were never reaped."""
    me, zombies = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            zombies.append(int(entry))
    return zombies


def assert_cleaned_up(pids: list[int]) -> None:
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} still exists"
    assert zombie_children() == []
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_tiny):
    llm = LLM(str(qwen3_tiny), device="cpu", enable_prefix_caching=False)
    prompts = prompts_for(llm.engine.vocab_size)
    return prompts, tokens(llm, prompts)


@pytest.mark.parametrize("shape", SHAPES)
def test_tp2_matches_tp1_through_prefix_cache_chunking_and_preemption(checkpoint_factory, shape):
    path = str(checkpoint_factory(**shape))
    ref = LLM(path, device="cpu", enable_prefix_caching=False)
    prompts = prompts_for(ref.engine.vocab_size)
    expected = tokens(ref, prompts)

    llm = LLM(path, device="cpu", tensor_parallel_size=2, **STRESSED)
    pids = llm.engine.executor.worker_pids
    try:
        assert tokens(llm, prompts) == expected
        second = llm.generate(prompts, greedy(20), use_tqdm=False)  # prefix-cache hits this time
        assert [o.outputs[0].token_ids for o in second] == expected
        assert any(o.num_cached_tokens > 0 for o in second)
        assert llm.engine.scheduler.num_preemptions > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks == 40
    finally:
        llm.shutdown()
    assert_cleaned_up(pids)


def test_killed_worker_raises_fast_and_a_new_engine_starts(qwen3_tiny, qwen3_reference):
    prompts, expected = qwen3_reference
    llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    # One process holds one TP engine: a second one (of any size) is refused clearly.
    with pytest.raises(RuntimeError, match="already initialized"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="shut it down"):
        LLM(str(qwen3_tiny), device="cpu")

    # Kill the worker from another thread once decoding is under way.
    killer, killed_at = when_decoding(llm, lambda: os.kill(pids[0], signal.SIGKILL))
    with pytest.raises(TensorParallelError, match=r"rank 1 .* killed by SIGKILL"):
        llm.generate(prompts * 4, greedy(400), use_tqdm=False)
    raised_at = time.monotonic()
    killer.join()
    assert killed_at and raised_at - killed_at[0] < FAILURE_BOUND_S
    with pytest.raises(TensorParallelError, match="shut down after a failure"):
        llm.generate(prompts[:1], greedy(2), use_tqdm=False)
    assert_cleaned_up(pids)

    # Same process, right after: a new TP engine starts (no port or group left over) and is correct.
    llm2 = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2)
    pids2 = llm2.engine.executor.worker_pids
    try:
        assert tokens(llm2, prompts) == expected
    finally:
        llm2.shutdown()
    assert_cleaned_up(pids2)


class RaisingRunner(ModelRunner):
    """Rank >= 1 runner that raises on its third step."""

    def execute(self, out):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            raise RuntimeError("injected failure on purpose")
        return super().execute(out)


class HangingRunner(ModelRunner):
    """Rank >= 1 runner that stops answering on its third step (alive, never joins the collective)."""

    def execute(self, out):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            time.sleep(3600)
        return super().execute(out)


@pytest.mark.parametrize(
    "runner_cls, timeout_s, message",
    [(RaisingRunner, None, r"rank 1 .* raised at step 3:\n(.|\n)*injected failure on purpose"),
     (HangingRunner, 2.0, r"Timed out")],
    ids=["raises", "hangs"],
)
def test_worker_that_raises_or_hangs_fails_the_step(qwen3_tiny, qwen3_reference, monkeypatch, runner_cls, timeout_s, message):
    prompts, _ = qwen3_reference

    def make(config, source):
        return MultiprocExecutor(config, source, timeout_s=timeout_s, worker_runner_cls=runner_cls)

    monkeypatch.setattr(llm_engine, "make_executor", make)
    llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=message):
        llm.generate(prompts, greedy(20), use_tqdm=False)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert_cleaned_up(pids)


CHILD = textwrap.dedent(
    """
    import json, sys
    from nanovllm import LLM, SamplingParams

    if __name__ == "__main__":
        path, prompts, shutdown = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
        llm = LLM(path, device="cpu", tensor_parallel_size=2)
        sp = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                          "pids": llm.engine.executor.worker_pids}), flush=True)
        if shutdown:
            llm.shutdown()
        # else: leave it to interpreter exit (weakref.finalize)
    """
)


def test_two_engines_at_once_and_clean_interpreter_exit(qwen3_tiny, qwen3_reference, tmp_path):
    prompts, expected = qwen3_reference
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOVLLM_TP")}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(qwen3_tiny), json.dumps(prompts[:3]), flag],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for flag in ("1", "0")
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        data = json.loads(out.strip().splitlines()[-1])
        assert data["tokens"] == expected[:3]
        for word in ("leaked", "Traceback", "Error"):
            assert word not in err, err
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in data["pids"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in data["pids"])


class GraphReleaseRecorder(ModelRunner):
    """Worker runner that notes, in the file named by $NANOVLLM_TEST_RELEASE_LOG, whether the
    process group still existed when it was asked to release its CUDA graphs."""

    def release_graphs(self):
        with open(os.environ["NANOVLLM_TEST_RELEASE_LOG"], "a") as f:
            f.write(f"rank {self.rank} released, group alive={dist.is_initialized()}\n")
        super().release_graphs()


def test_graphs_are_released_before_the_group_is_destroyed(qwen3_tiny, qwen3_reference, monkeypatch, tmp_path):
    """A CUDA graph that captured NCCL collectives pins the communicator: destroying the group
    first waits forever (PyTorch issue 115388). Every rank must drop its graphs first."""
    prompts, expected = qwen3_reference
    log = tmp_path / "release.log"
    monkeypatch.setenv("NANOVLLM_TEST_RELEASE_LOG", str(log))
    events: list[str] = []
    real_release, real_destroy = ModelRunner.release_graphs, dist.destroy_process_group

    def release(self):
        events.append(f"release rank {self.rank}")
        real_release(self)

    def destroy(*args, **kwargs):
        events.append("destroy")
        real_destroy(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "release_graphs", release)
    monkeypatch.setattr("nanovllm.executor.multiproc.dist.destroy_process_group", destroy)
    monkeypatch.setattr(llm_engine, "make_executor",
                        lambda config, source: MultiprocExecutor(config, source, worker_runner_cls=GraphReleaseRecorder))
    llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    assert tokens(llm, prompts[:2]) == expected[:2]
    llm.shutdown()
    assert events == ["release rank 0", "destroy"]
    assert log.read_text() == "rank 1 released, group alive=True\n"
    assert_cleaned_up(pids)
