"""The ranks of one node other than node 0, for tensor parallelism across machines.

Node 0 runs the engine (`LLM(..., nnodes=N, master_port=P)` or `nanovllm serve --nnodes N ...`):
its driver is rank 0, opens the rendezvous (a TCPStore on master_port) and spawns its other
local ranks (executor/multiproc.py). Every other node runs `nanovllm worker --nnodes N
--node-rank K --master-addr A --master-port P`, which is `run_node` below: it reads what to build
from the store (the engine config and model source that node 0 published, so the model path
must be valid on every node), starts ranks K*L .. K*L+L-1 (L = tensor_parallel_size // N, rank
r on cuda:r mod L), and waits for them. Each rank joins the process group, checks in, builds its
shard, and runs the steps rank 0 broadcasts over a gloo group until the stop message.

Failures. A node that cannot reach node 0 within join_timeout_s exits with an error; node 0
waits as long for every rank and names the missing ones. A rank that raises writes its
traceback to the store (node 0 reports it) and exits, which closes its connections and fails
its peers' collectives; a node process that loses one rank terminates the others and exits 1.
A dead node is seen by node 0 as a peer that closed its connection, at its next collective.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from datetime import timedelta
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist

from nanovllm.executor.multiproc import (
    DEFAULT_TIMEOUT_S, SPEC_KEY, NodeSpec, _collective_device, _min_across_ranks, error_key, join_group, joined_key,
    make_step_group, serve_broadcast,
)
from nanovllm.runner.model_runner import ModelRunner

logger = logging.getLogger("nanovllm")


class NodeError(RuntimeError):
    """This node could not join the tensor-parallel group, or one of its ranks failed."""


def _rank_main(rank: int, local_rank: int, addr: str, port: int, join_timeout_s: float, num_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node process handles Ctrl-C
    store = None
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=join_timeout_s))
        spec: NodeSpec = pickle.loads(store.get(SPEC_KEY))
        if spec.backend == "nccl":
            torch.cuda.set_device(local_rank)
        else:
            torch.set_num_threads(num_threads)
        store.set(joined_key(rank), b"1")
        startup_s = max(spec.timeout_s, DEFAULT_TIMEOUT_S, join_timeout_s)
        join_group(spec.backend, addr, port, rank, spec.world, spec.timeout_s, startup_s)
        group = make_step_group(spec.backend)
        device = _collective_device(spec.backend)
        runner = ModelRunner(spec.config, spec.source, rank=rank, agree_num_blocks=lambda n: _min_across_ranks(n, device))
        serve_broadcast(runner, group)
    except BaseException:
        tb = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", rank, tb)
        try:
            if store is not None:
                store.set(error_key(rank), tb.encode())
        except Exception:  # noqa: BLE001 - node 0 is gone too
            pass
        raise SystemExit(1) from None  # exiting closes our sockets, which releases our peers
    runner.release_graphs()
    dist.destroy_process_group()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_node(nnodes: int, node_rank: int, master_addr: str, master_port: int, join_timeout_s: float) -> int:
    """Run node `node_rank`'s ranks until node 0 stops them; 0 on a clean stop."""
    if nnodes < 2:
        raise ValueError(f"--nnodes must be >= 2 for a worker node, got {nnodes}")
    if not 1 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [1, {nnodes - 1}] (node 0 runs the engine), got {node_rank}")
    if not 1 <= master_port < 65536:
        raise ValueError(f"--master-port must be in [1, 65535], got {master_port}")
    if join_timeout_s <= 0:
        raise ValueError(f"--join-timeout must be positive, got {join_timeout_s}")
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=join_timeout_s))
        spec: NodeSpec = pickle.loads(store.get(SPEC_KEY))
    except (RuntimeError, dist.DistError) as exc:
        raise NodeError(f"could not reach node 0 at {master_addr}:{master_port} within {join_timeout_s:g}s "
                        f"(--master-addr/--master-port, --join-timeout): {exc}") from None
    if spec.nnodes != nnodes:
        raise NodeError(f"node 0 runs {spec.nnodes} nodes, this node was started with --nnodes {nnodes}")
    local = spec.world // nnodes
    if spec.backend == "nccl" and torch.cuda.device_count() < local:
        raise NodeError(f"{local} ranks per node need {local} GPUs; torch sees {torch.cuda.device_count()}")
    del store
    ctx = get_context("spawn")
    num_threads = max(1, (os.cpu_count() or 1) // local)
    procs = []
    for i in range(local):
        rank = node_rank * local + i
        proc = ctx.Process(target=_rank_main, args=(rank, i, master_addr, master_port, join_timeout_s, num_threads),
                           name=f"nanovllm-tp{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    logger.info("node %d of %d: ranks %d..%d, pids %s", node_rank, nnodes, node_rank * local,
                node_rank * local + local - 1, [p.pid for p in procs])
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)  # so the ranks are stopped below
    try:
        pending = list(procs)
        while pending:
            ready = connection.wait([p.sentinel for p in pending])
            for proc in [p for p in pending if p.sentinel in ready]:
                proc.join()
                pending.remove(proc)
                if proc.exitcode != 0:
                    raise NodeError(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}; "
                                    "stopping this node's other ranks")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return 0
