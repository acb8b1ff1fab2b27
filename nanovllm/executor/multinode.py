"""The ranks of one node other than node 0, for tensor parallelism across machines.

Node 0 runs the engine (`LLM(..., nnodes=N, master_port=P)` or `nanovllm serve --nnodes N ...`):
its driver is rank 0, opens the rendezvous (a TCPStore on master_port) and spawns its other
local ranks (executor/multiproc.py). Every other node runs `nanovllm worker --nnodes N
--node-rank K --master-addr A --master-port P`, which is `run_node` below: it reads what to build
from the store (the engine config and model source that node 0 published, so the model path
must be valid on every node), starts ranks K*L .. K*L+L-1 (L = tensor_parallel_size // N, rank
r on cuda:r mod L), and waits for them. Each rank joins the process group, checks in, builds its
shard, and runs the steps rank 0 broadcasts over a gloo group until the stop message.

torchrun. `torchrun --nnodes N --nproc-per-node L ... -m nanovllm serve ...` starts every rank
itself, the same command on every node: `torchrun_env` reads its environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 runs the
engine with `torchrun=True` (it spawns no ranks) and every other rank runs `run_torchrun_rank`,
which is one rank of the loop above, in torchrun's process. The rendezvous store is the one
torchrun's agent serves on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), else rank 0 opens it.

Failures. A node that cannot reach node 0 within join_timeout_s exits with an error; node 0
waits as long for every rank and names the missing ones. A rank that raises writes its
traceback to the store (node 0 reports it) and exits, which closes its connections and fails
its peers' collectives; a node process that loses one rank terminates the others and exits 1.
A dead node is seen by node 0 as a peer that closed its connection, at its next collective;
every rank here also sends node 0 a heartbeat through the store (multiproc.start_heartbeat), so
a node that stops answering without closing anything fails the engine as well.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import NoReturn

import torch
import torch.distributed as dist

from nanovllm.executor.multiproc import (
    DEFAULT_TIMEOUT_S, SPEC_KEY, NodeSpec, _collective_device, _min_across_ranks, error_key, exit_rank, join_group,
    joined_key, make_step_group, serve_broadcast, start_heartbeat,
)
from nanovllm.runner.model_runner import ModelRunner

logger = logging.getLogger("nanovllm")


class NodeError(RuntimeError):
    """This node could not join the tensor-parallel group, or one of its ranks failed."""


def _rank_main(rank: int, local_rank: int, addr: str, port: int, join_timeout_s: float, num_threads: int) -> NoReturn:
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
        start_heartbeat(addr, port, rank)
        group = make_step_group()
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
    exit_rank()


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


# ---- torchrun ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts."""

    rank: int
    local_rank: int
    world: int
    local_world: int
    nnodes: int
    master_addr: str
    master_port: int


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun launch this process is part of, or None when torchrun did not start it (no
    RANK / WORLD_SIZE / LOCAL_RANK) or started one process in all; ValueError on a bad value."""
    env = os.environ if environ is None else environ
    if not all(env.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None

    def number(name: str, default: str | None = None) -> int:
        raw = env.get(name) or default
        if raw is None:
            raise ValueError(f"torchrun environment: {name} is not set")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"torchrun environment: {name}={raw!r} is not an integer") from None

    world = number("WORLD_SIZE")
    if world < 2:
        return None
    rank, local_rank = number("RANK"), number("LOCAL_RANK")
    local_world = number("LOCAL_WORLD_SIZE", str(world))
    if not (0 <= rank < world and 0 <= local_rank < local_world and world % local_world == 0):
        raise ValueError(f"torchrun environment: RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world}, "
                         f"LOCAL_WORLD_SIZE={local_world} do not fit together (every node needs as many ranks)")
    nnodes = world // local_world
    if number("GROUP_WORLD_SIZE", str(nnodes)) != nnodes:
        raise ValueError(f"torchrun environment: GROUP_WORLD_SIZE={env['GROUP_WORLD_SIZE']} nodes, but WORLD_SIZE="
                         f"{world} over LOCAL_WORLD_SIZE={local_world} ranks per node is {nnodes}")
    port = number("MASTER_PORT")
    if not 1 <= port < 65536:
        raise ValueError(f"torchrun environment: MASTER_PORT={port} is not in [1, 65535]")
    return TorchrunEnv(rank, local_rank, world, local_world, nnodes, env.get("MASTER_ADDR") or "127.0.0.1", port)


def run_torchrun_rank(env: TorchrunEnv, join_timeout_s: float) -> NoReturn:
    """Run rank `env.rank` >= 1 of a torchrun launch in this process until rank 0 stops it; the
    process then ends with status 0 (exit_rank), or raises SystemExit(1) where the rank failed."""
    if env.rank == 0:
        raise ValueError("rank 0 of a torchrun launch runs the engine, not a worker rank")
    if join_timeout_s <= 0:
        raise ValueError(f"--join-timeout must be positive, got {join_timeout_s}")
    num_threads = max(1, (os.cpu_count() or 1) // env.local_world)
    if os.environ.get("OMP_NUM_THREADS"):  # torchrun sets 1 when it starts several ranks per node
        num_threads = torch.get_num_threads()
    _rank_main(env.rank, env.local_rank, env.master_addr, env.master_port, join_timeout_s, num_threads)
