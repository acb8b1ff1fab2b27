"""Tensor parallelism across "nodes" (executor/multinode.py), on the CPU over gloo.

Node 0 is this process (`LLM(..., nnodes=2, master_port=P)`); the other node is a
`nanovllm worker` subprocess against 127.0.0.1. TP=4 as 2 nodes x 2 ranks must give TP=1's
greedy tokens; a node that never joins, or dies mid-run, must fail the engine within a bounded
time with an error that says so; a worker with no node 0 to reach must give up likewise.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.executor.multiproc import TensorParallelError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(arch="qwen3", num_heads=4, num_kv_heads=4, head_dim=16)  # 4 heads and KV heads: 1 per rank at TP=4
FAILURE_BOUND_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(port: int, join_timeout_s: float = 60.0, node_rank: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "worker", "--nnodes", "2", "--node-rank", str(node_rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", str(join_timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def test_tp4_as_two_nodes_of_two_ranks_matches_tp1(checkpoint_factory):
    path = str(checkpoint_factory(**SHAPE))
    prompts = [[5, 9, 14, 20, 33], list(range(40, 90)), [7] * 12]
    ref = LLM(path, device="cpu")
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy(16), use_tqdm=False)]
    ref.shutdown()

    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(path, device="cpu", tensor_parallel_size=4, nnodes=2, master_port=port, join_timeout_s=60,
                  kvcache_block_size=4, num_kvcache_blocks=64)
        try:
            assert llm.engine.executor.world_size == 4 and len(llm.engine.executor.worker_pids) == 1
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
        finally:
            llm.shutdown()
        assert got == expected
        _, err = node.communicate(timeout=30)  # node 0's stop message ends the node cleanly
        assert node.returncode == 0, err
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    assert not dist.is_initialized()


def test_a_node_that_never_joins_is_named_within_the_join_timeout(qwen3_tiny):
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] of node\(s\) \[1\] did not join within 3s"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=free_port(), join_timeout_s=3)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert not dist.is_initialized()


def test_a_node_that_dies_mid_run_fails_the_engine_fast(qwen3_tiny):
    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, join_timeout_s=60)
        killed_at: list[float] = []

        def kill_when_decoding() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(s.num_completion_tokens >= 3 for s in list(llm.engine.scheduler.running)):
                    killed_at.append(time.monotonic())
                    os.killpg(node.pid, signal.SIGKILL)  # the whole "machine": node process and ranks
                    return
                time.sleep(0.001)

        killer = threading.Thread(target=kill_when_decoding)
        killer.start()
        with pytest.raises(TensorParallelError, match=r"(?s)failed during step .*rank 1 runs on another node"):
            llm.generate([[5, 6, 7, 8]] * 4, greedy(400), use_tqdm=False)
        raised_at = time.monotonic()
        killer.join()
        assert killed_at and raised_at - killed_at[0] < FAILURE_BOUND_S
        with pytest.raises(TensorParallelError, match="shut down after a failure"):
            llm.generate([[5, 6]], greedy(2), use_tqdm=False)
        assert not dist.is_initialized()
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def test_a_worker_with_no_node_0_gives_up_within_its_join_timeout():
    t0 = time.monotonic()
    node = start_node(free_port(), join_timeout_s=2)
    _, err = node.communicate(timeout=60)
    assert node.returncode == 1
    assert "could not reach node 0 at 127.0.0.1:" in err and "--join-timeout" in err
    assert time.monotonic() - t0 < 60


def test_multinode_flags_are_checked(qwen3_tiny):
    with pytest.raises(ValueError, match="nnodes"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="master_port"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="join_timeout_s"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=1234, join_timeout_s=0)
