"""Tensor parallelism across "nodes" (executor/multinode.py), on the CPU over gloo.

Node 0 is this process (`LLM(..., nnodes=2, master_port=P)`); the other node is a
`nanovllm worker` subprocess against 127.0.0.1. TP=4 as 2 nodes x 2 ranks must give TP=1's
greedy tokens; a node that never joins, or dies mid-run, must fail the engine within a bounded
time with an error that says so; a worker with no node 0 to reach must give up likewise.
Launched by torchrun instead (every rank one of its processes, the same `nanovllm generate`
on each node), TP=2 over 2 nodes must print TP=1's greedy text.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from nanovllm import LLM
from nanovllm.executor.multinode import TorchrunEnv, torchrun_env
from nanovllm.executor import multiproc
from nanovllm.executor.multiproc import TensorParallelError
from test_tensor_parallel import FAILURE_BOUND_S, greedy, when_decoding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(arch="qwen3", num_heads=4, num_kv_heads=4, head_dim=16)  # 4 heads and KV heads: 1 per rank at TP=4


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


def test_an_idle_engine_outlives_the_step_timeout(qwen3_tiny, monkeypatch):
    """The other node's ranks wait for the next step for as long as the engine is idle, not
    only NANOVLLM_TP_TIMEOUT_S (the step timeout, here 3 s, which gloo used to apply to them)."""
    monkeypatch.setenv("NANOVLLM_TP_TIMEOUT_S", "3")
    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, join_timeout_s=60)
        try:
            first = llm.generate([[5, 6, 7, 8]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
            time.sleep(5)
            again = llm.generate([[5, 6, 7, 8]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.shutdown()
        assert again == first and len(first) == 4
        _, err = node.communicate(timeout=30)
        assert node.returncode == 0, err
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def test_a_node_that_never_joins_is_named_within_the_join_timeout(qwen3_tiny):
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] of node\(s\) \[1\] did not join within 1s"):
        LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=free_port(), join_timeout_s=1)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert not dist.is_initialized()


def test_a_node_that_dies_mid_run_fails_the_engine_fast(qwen3_tiny):
    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, join_timeout_s=60)
        # the whole "machine": node process and ranks
        killer, killed_at = when_decoding(llm, lambda: os.killpg(node.pid, signal.SIGKILL))
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


def test_a_node_that_goes_silent_mid_run_fails_the_engine_on_its_heartbeat(qwen3_tiny, monkeypatch):
    """A node that stops answering without closing its connections (here: stopped with SIGSTOP,
    as a machine cut off from the network) is caught by its missing heartbeat, not by gloo.
    Node 0 here takes 4 s without a heartbeat (4 beats missed) for silence."""
    monkeypatch.setattr(multiproc, "SILENCE_S", 4.0)
    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(str(qwen3_tiny), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, join_timeout_s=60)
        stopper, stopped_at = when_decoding(llm, lambda: os.killpg(node.pid, signal.SIGSTOP))
        with pytest.raises(TensorParallelError, match=r"(?s)failed during step .*rank 1 \(node 1\) sent no heartbeat"):
            llm.generate([[5, 6, 7, 8]] * 4, greedy(400), use_tqdm=False)
        raised_at = time.monotonic()
        stopper.join()
        assert stopped_at and raised_at - stopped_at[0] < multiproc.SILENCE_S + FAILURE_BOUND_S
        assert not dist.is_initialized()  # a new engine could start its group
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def test_a_worker_with_no_node_0_gives_up_within_its_join_timeout():
    t0 = time.monotonic()
    node = start_node(free_port(), join_timeout_s=1)
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


def start_torchrun_node(port: int, node_rank: int, model: str, prompt: str, max_tokens: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "nanovllm", "generate", "--model", model, "--device", "cpu", "--max-tokens", str(max_tokens),
         "--ignore-eos", "--quiet", "--join-timeout", "60", prompt],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )


def test_torchrun_two_nodes_match_tp1(checkpoint_factory):
    path = str(checkpoint_factory(**SHAPE))
    prompt = "hello world, the quick brown fox"
    ref = LLM(path, device="cpu")
    [expected] = ref.generate([prompt], greedy(12), use_tqdm=False)
    ref.shutdown()
    assert len(expected.outputs[0].token_ids) == 12

    port = free_port()
    nodes = [start_torchrun_node(port, k, path, prompt, 12) for k in (0, 1)]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    assert "tensor parallel: 2 ranks (gloo)" in results[0][1]  # rank 0 ran the engine over both nodes
    assert results[0][0] == expected.outputs[0].text + "\n"  # only rank 0 prints
    assert results[1][0] == ""


def test_torchrun_env_is_read_and_checked():
    base = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2",
                MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert torchrun_env(base) == TorchrunEnv(3, 1, 4, 2, 2, "10.0.0.1", 29500)
    assert torchrun_env({}) is None and torchrun_env(dict(base, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")) is None
    for bad, field in ((dict(MASTER_PORT="0"), "MASTER_PORT"), (dict(RANK="x"), "RANK"),
                       (dict(GROUP_WORLD_SIZE="3"), "GROUP_WORLD_SIZE"), (dict(LOCAL_WORLD_SIZE="3"), "LOCAL_WORLD_SIZE")):
        with pytest.raises(ValueError, match=field):
            torchrun_env(dict(base, **bad))
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        torchrun_env({k: v for k, v in base.items() if k != "MASTER_PORT"})
