"""Tensor parallelism across processes: rank 0 in the driver, ranks 1..N-1 in spawned workers.

Every rank holds a ModelRunner over its shard of the model (the layers shard themselves from the
torch.distributed process group, see layers/linear.py); the collectives inside the forward pass
keep the ranks' activations identical. What the ranks need besides the collectives is the same
step, in the same order. This module supplies that, and makes failures loud instead of hangs.

Process group. NCCL on CUDA (rank r on cuda:r), gloo on CPU, so TP runs and is tested without a
GPU. Rendezvous goes through a TCPStore that the driver opens on 127.0.0.1 port 0, so the kernel
picks a free port and there is no window between choosing a port and binding it (a port can be
forced with `port=` or NANOVLLM_TP_PORT). Nothing is named globally: no fixed port, no
shared-memory name, so engines in different processes on one host never collide. torch.distributed
has one default group per process and the layers read it, so a process holds one TP engine at a time.

Control channel. One anonymous multiprocessing Pipe (a socketpair) per worker carries pickled
messages, and every step is acknowledged:

    driver -> worker   (step, payload)            payload = the step's plain data; None = stop
    worker -> driver   ("ack", step) | ("error", step, traceback) | ("hello",) | ("ready", blocks)

Why it is correct under any timing:
- No shared buffer: `send_bytes` copies the message into the kernel, so the driver never reuses
  memory a worker may still be reading, and each pipe delivers whole frames in FIFO order.
- Lockstep: the driver sends step k+1 only after every worker acknowledged step k, and every ack
  carries its step number (a mismatch raises). At most one step is in flight per pipe, so a
  worker is already waiting in `recv` when its next message arrives and a send never waits on
  a worker that is busy. Since every rank runs the same steps in the same order with the same
  batch shape, every rank issues the same collectives in the same order.
- Self-contained messages: a step carries everything the worker needs (full block tables, no
  deltas against earlier steps), so no state can drift between the driver and a worker.
- Small, bounded messages: only what a step needs crosses (per scheduled sequence: id, the token
  ids computed this step, start position, block table, whether it samples). Sampling parameters
  stay with rank 0, the only rank that samples. A message is pickled once for all workers, at
  `execute` time, before the scheduler can mutate the lists it points at.
- Empty steps (nothing scheduled) run no collective and are not sent.

Across machines (executor/multinode.py, config `nnodes` > 1) the ranks of other nodes have no
pipe to the driver: the rendezvous store binds `master_port` on `master_addr`, and every rank,
local ones included, gets each step from rank 0 by a broadcast (`broadcast_step`) on a gloo
group of its own instead. No ack is needed there: a broadcast is a collective, so step k+1's
cannot start before every rank has left step k's collectives. Local ranks keep their pipe for
start-up and errors.
Ranks on other nodes send a heartbeat through the store; rank 0 marks the group failed when one
stops (HEARTBEAT_S, SILENCE_S), and its gloo collectives then raise (distributed.finish). The
step broadcast waits without a practical limit (STEP_WAIT), so an idle engine stays up.

Failure handling. A worker that raises sends its traceback and exits; a worker that dies just
exits. Either way its sockets close, so a gloo collective waiting on it on rank 0 fails at once
(connection reset) rather than at the timeout, and the driver then names the cause: the worker's
traceback, or its exit code / signal. The driver also checks liveness before sending a step and
waits for acks on the pipes *and* the process sentinels, so a death between collectives is seen
too. A worker that hangs while alive is caught by the process-group timeout (`timeout_s`,
NANOVLLM_TP_TIMEOUT_S, default 300 s; it must also cover the skew of model loading across ranks,
and the waits of start-up itself are never shorter than the default). On CUDA a dead peer can
leave NCCL kernels spinning; a watcher thread aborts the NCCL group when a worker process dies,
so the driver's pending sync returns and the error is raised (that path needs several GPUs and
is not exercised in CPU CI); on the CPU the same watcher marks the group failed, for the case
where gloo misses the closed connection. After any failure the executor shuts everything down
and refuses further steps; a new engine can be created in the same process.

Cleanup. `shutdown()` (also run by weakref.finalize when the executor is collected or the
interpreter exits) sends stop, joins the workers (terminate, then kill, after a grace period),
closes the pipes and destroys the process group. Workers are daemonic, so even if the finalizer
runs after multiprocessing's own exit handler they are terminated and reaped, never left as
zombies. Only pipes and processes are used: no semaphores or shared memory that could leak.
Workers ignore SIGINT: Ctrl-C reaches the driver only, which then shuts the workers down. As with
any spawn-based library, code creating a TP engine in a script must sit under
`if __name__ == "__main__":`.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from nanovllm.config import EngineConfig
from nanovllm.distributed import GroupFailedError, finish, mark_failed
from nanovllm.loaders.source import ModelSource
from nanovllm.runner.device import resolve_device
from nanovllm.runner.model_runner import ModelRunner, RunnerOutput
from nanovllm.step_result import Done, StepResult
from nanovllm.step import ScheduledSeq, SchedulerOutput

logger = logging.getLogger("nanovllm")

PORT_ENV = "NANOVLLM_TP_PORT"
TIMEOUT_ENV = "NANOVLLM_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
HOST = "127.0.0.1"
STOP_GRACE_S = 10.0  # how long a clean shutdown waits for workers before terminating them
EXPLAIN_GRACE_S = 3.0  # after a failed step, how long to wait for a worker to report why


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed (raised, died or hung); the executor is shut down."""


# ---- multi-node rendezvous keys (executor/multinode.py runs the other nodes) -------------------
SPEC_KEY = "nanovllm/spec"


@dataclass
class NodeSpec:
    """What node 0 publishes in the store for the other nodes: they build their ranks from it,
    so they need only the rendezvous address on their command line."""

    config: EngineConfig
    source: ModelSource
    backend: str
    world: int
    nnodes: int
    timeout_s: float


def joined_key(rank: int) -> str:
    return f"nanovllm/joined/{rank}"


def error_key(rank: int) -> str:
    return f"nanovllm/error/{rank}"


# A rank on another node bumps its heartbeat counter in the store every HEARTBEAT_S; node 0 takes
# one whose counter stays put for SILENCE_S as gone and marks the group failed, so that its
# collectives give up (distributed.finish) instead of waiting on gloo, which may not notice.
HEARTBEAT_S = 1.0
SILENCE_S = 10.0


def beat_key(rank: int) -> str:
    return f"nanovllm/beat/{rank}"


def start_heartbeat(host: str, port: int, rank: int) -> None:
    """Bump `rank`'s heartbeat counter every HEARTBEAT_S, from a daemon thread with a store
    connection of its own, for as long as this process lives (or node 0 answers)."""
    def beat() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=SILENCE_S))
            while True:
                store.add(beat_key(rank), 1)
                time.sleep(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - node 0 is gone: its collectives fail ours
            return

    threading.Thread(target=beat, name="nanovllm-heartbeat", daemon=True).start()


# ---- the step message ------------------------------------------------------------------------
StepPayload = tuple[int, int, list[tuple[int, list[int], int, list[int], bool, list[int] | None, int]]]


def encode_step(out: SchedulerOutput) -> StepPayload:
    """What a non-sampling rank needs from a step: tuples of builtins, which pickle fast."""
    seqs = [(s.seq_id, s.token_ids, s.start_pos, s.block_table, s.sample, s.prompt_logprob_ids, s.prompt_logprobs_from)
            for s in out.seqs]
    return out.num_decodes, out.num_batched_tokens, seqs


def decode_step(payload: StepPayload) -> SchedulerOutput:
    """Rebuild a SchedulerOutput on a worker (no sampling params: workers never sample)."""
    num_decodes, num_tokens, seqs = payload
    return SchedulerOutput(
        seqs=[ScheduledSeq(i, t, p, b, s, None, None, None, prompt_logprob_ids=ids, prompt_logprobs_from=first)  # type: ignore[arg-type]
              for i, t, p, b, s, ids, first in seqs],
        num_decodes=num_decodes,
        num_batched_tokens=num_tokens,
    )


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _min_across_ranks(n: int, device: torch.device) -> int:
    """The KV pool size every rank can afford (block ids must mean the same everywhere)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _collective_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# ---- the worker process ----------------------------------------------------------------------
def join_group(backend: str, host: str, port: int, rank: int, world: int, timeout_s: float, startup_s: float) -> Any:
    """Join the process group of `world` ranks through the TCPStore at host:port; returns the store."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=startup_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return store


# How long a rank waits in the step broadcast: an idle engine sends no step for as long as it
# likes, and a peer that is gone is caught by its closed connection or its heartbeat instead.
STEP_WAIT = timedelta(days=365)


def make_step_group() -> Any:
    """The group that carries step messages when they go by broadcast: gloo, since a step is a
    pickled host object, with a timeout of STEP_WAIT (a collective that every rank must call,
    in order)."""
    return dist.new_group(backend="gloo", timeout=STEP_WAIT)


def broadcast_step(msg: Any, group: Any) -> Any:
    """Rank 0 sends `msg` (a step payload, or None = stop); every other rank gets it back. Its
    length, then its pickle, each a gloo broadcast that gives up once the group is marked
    failed (distributed.finish)."""
    sender = dist.get_rank() == 0
    data = _dumps(msg) if sender else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    finish(dist.broadcast(size, src=0, group=group, async_op=True))
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if sender else torch.empty(int(size), dtype=torch.uint8)
    finish(dist.broadcast(buf, src=0, group=group, async_op=True))
    return msg if sender else pickle.loads(buf.numpy().tobytes())


def serve_broadcast(runner: ModelRunner, group: Any) -> None:
    """A rank's step loop when steps come by broadcast: run each until rank 0 sends None. The
    next broadcast cannot start before every rank left the previous step's collectives, so no
    acknowledgement is needed."""
    while (payload := broadcast_step(None, group)) is not None:
        runner.execute(decode_step(payload))


def _worker_main(
    rank: int,
    local_rank: int,
    world: int,
    backend: str,
    host: str,
    port: int,
    timeout_s: float,
    startup_s: float,
    num_threads: int,
    config: EngineConfig,
    source: ModelSource,
    conn: connection.Connection,
    runner_cls: type[ModelRunner],
    by_broadcast: bool,
) -> None:
    """Entry point of rank `rank` >= 1 on node 0: join the group, build the runner, then serve
    steps (from the pipe, or by broadcast when ranks on other nodes take part)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    step: int | None = None
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        else:
            torch.set_num_threads(num_threads)
        conn.send_bytes(_dumps(("hello",)))  # imports done: the driver may now join the group
        join_group(backend, host, port, rank, world, timeout_s, startup_s)
        group = make_step_group() if by_broadcast else None
        device = _collective_device(backend)
        runner = runner_cls(config, source, rank=rank, agree_num_blocks=lambda n: _min_across_ranks(n, device))
        conn.send_bytes(_dumps(("ready", runner.num_kvcache_blocks)))
        if by_broadcast:
            serve_broadcast(runner, group)
        while not by_broadcast:
            try:
                data = conn.recv_bytes()
            except EOFError:
                return  # the driver went away: nobody to report to; exiting frees our peers
            step, payload = pickle.loads(data)
            if payload is None:
                break
            runner.execute(decode_step(payload))
            conn.send_bytes(_dumps(("ack", step)))
    except BaseException:
        try:
            conn.send_bytes(_dumps(("error", step, traceback.format_exc())))
        except OSError:
            pass  # the driver is gone too
        # Exit without destroying the group: peers may be stuck in a collective with us, and
        # closing our sockets by exiting is what releases them.
        raise SystemExit(1) from None
    runner.release_graphs()  # before the group: graphs that captured collectives pin it
    dist.destroy_process_group()
    exit_rank()


def exit_rank() -> NoReturn:
    """End a rank's process once its group is destroyed, without the interpreter's teardown:
    the heartbeat thread may be inside a store call then, and destroying its store under it
    aborted the process now and then ("terminate called without an active exception")."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _keep(*objects: Any) -> None:
    """Hold `objects` until the process ends (the target of a daemon thread)."""
    threading.Event().wait()


# ---- the driver's view of the workers --------------------------------------------------------
class _Workers:
    """Processes, pipes and the process group of one executor; `close()` releases them all.

    Kept apart from MultiprocExecutor so that weakref.finalize can hold `close` without keeping
    the executor alive.
    """

    def __init__(self, backend: str, timeout_s: float, nnodes: int = 1, join_timeout_s: float = DEFAULT_TIMEOUT_S,
                 torchrun: bool = False) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.nnodes = nnodes
        self.join_timeout_s = join_timeout_s
        self.torchrun = torchrun  # torchrun started every rank: spawn none
        self.world = 1
        self.local_world = 1
        self.first_remote = 1  # ranks >= this one have no pipe: they join through the store
        self.step_group: Any = None  # multi-node: the group steps are broadcast on
        self.procs: list[Any] = []  # multiprocessing SpawnProcess, index i = rank i + 1
        self.conns: list[connection.Connection] = []
        self.store: dist.TCPStore | None = None
        self.group: Any = None  # the default group we created, destroyed by close()
        self.broken = False  # set after a failure: close() then terminates instead of stopping
        self.closed = False
        # Run by close() just before it destroys the group: rank 0's runner drops its CUDA graphs,
        # whose captured collectives would otherwise make the destruction wait forever.
        self.before_destroy: list[Callable[[], None]] = []
        self._watcher: threading.Thread | None = None
        self._wake: connection.Connection | None = None
        self._stop_watching_remote = threading.Event()
        self._remote_watcher: threading.Thread | None = None
        # Set after a failure in which a collective may still wait on a lost peer (distributed.
        # GroupFailedError): close() then keeps the group instead of destroying it.
        self.collective_stuck = False

    def rank_name(self, i: int) -> str:
        return f"tensor-parallel worker rank {i + 1} (pid {self.procs[i].pid})"

    # -- start-up --
    def start(self, world: int, port: int, config: EngineConfig, source: ModelSource, runner_cls: type) -> None:
        """Open the rendezvous and spawn this node's ranks 1..local-1 (ranks on other nodes are
        started there, by `nanovllm worker`, and find us through the store)."""
        self.world, self.local_world = world, world // self.nnodes
        self.first_remote = 1 if self.torchrun else self.local_world
        host = HOST if self.nnodes == 1 and not self.torchrun else config.master_addr
        # The store only serves the rendezvous, which waits on start-up, not on a step. Under
        # torchrun its agent already serves one on the master port (TORCHELASTIC_USE_AGENT_STORE).
        startup_s = max(self.timeout_s, DEFAULT_TIMEOUT_S)
        agent_store = self.torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = dist.TCPStore(host, port, is_master=not agent_store, wait_for_workers=False,
                                   timeout=timedelta(seconds=startup_s))
        if self.has_remote_ranks:  # what the other ranks need to build their shards: published once
            self.store.set(SPEC_KEY, _dumps(NodeSpec(config, source, self.backend, world, self.nnodes, self.timeout_s)))
        ctx = get_context("spawn")
        num_threads = max(1, torch.get_num_threads() // self.local_world)
        for rank in range(1, self.first_remote):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, rank, world, self.backend, host, self.store.port, self.timeout_s, startup_s, num_threads,
                      config, source, child, runner_cls, self.has_remote_ranks),
                name=f"nanovllm-tp{rank}",
                daemon=True,
            )
            try:
                proc.start()
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()  # only the worker holds its end, so its death reads as EOF here
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def has_remote_ranks(self) -> bool:
        """Whether some ranks have no pipe (other nodes, or torchrun's): steps then go by broadcast."""
        return self.first_remote < self.world

    def join_group(self, world: int) -> None:
        """Join as rank 0 once every worker has imported (a worker dying before that is seen at
        once here, instead of as a rendezvous timeout). Spawning and importing torch can take
        a while on a loaded machine, so this wait is not cut short by a small step timeout."""
        self.collect("hello", None, max(self.timeout_s, DEFAULT_TIMEOUT_S))
        if self.has_remote_ranks:
            self._await_other_nodes()
        dist.init_process_group(
            self.backend, store=self.store, rank=0, world_size=world, timeout=timedelta(seconds=self.timeout_s)
        )
        self.group = dist.group.WORLD
        if self.has_remote_ranks:
            self.step_group = make_step_group()
            self._watch_remote_ranks()
        if self.procs:
            self._start_watcher()

    def _await_other_nodes(self) -> None:
        """Wait up to join_timeout_s for every rank of the other nodes to check in; name the
        missing ones otherwise (init_process_group alone would only say which key timed out)."""
        store, remote = self.store, range(self.first_remote, self.world)
        try:
            store.wait([joined_key(r) for r in remote], timedelta(seconds=self.join_timeout_s))
        except (RuntimeError, dist.DistError):
            missing = [r for r in remote if not store.check([joined_key(r)])]
            nodes = sorted({r // self.local_world for r in missing})
            how = ("run the same torchrun command on every node" if self.torchrun else
                   f"start `nanovllm worker --nnodes {self.nnodes} --node-rank K --master-addr ADDR --master-port "
                   f"{store.port}` on each other node, with ADDR this node's address as they reach it")
            raise TensorParallelError(
                f"rank(s) {missing} of node(s) {nodes} did not join within {self.join_timeout_s:g}s: {how}"
            ) from None

    def remote_errors(self) -> str | None:
        """What ranks on other nodes reported before exiting (they write to the store)."""
        if self.store is None or not self.has_remote_ranks:
            return None
        found = []
        for r in range(self.first_remote, self.world):
            try:
                if self.store.check([error_key(r)]):
                    found.append(f"rank {r} (node {r // self.local_world}) raised:\n{self.store.get(error_key(r)).decode()}")
            except Exception:  # noqa: BLE001 - the store is best effort once things fail
                break
        return "\n".join(found) or None

    # -- per step --
    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise TensorParallelError(self._describe_exit(i))

    def send(self, data: bytes) -> None:
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise TensorParallelError(self._describe_exit(i)) from exc

    def collect(self, kind: str, step: int | None, timeout_s: float) -> list[tuple]:
        """Wait until every worker sent a `kind` message (for `step`), watching the pipes and the
        process sentinels; raise TensorParallelError on an error report, a death or the timeout."""
        pending = dict(enumerate(self.conns))
        got: list[tuple] = [()] * len(self.conns)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = ", ".join(self.rank_name(i) for i in pending)
                raise TensorParallelError(f"{late}: no {kind!r} for step {step} within {timeout_s:.0f}s")
            sentinels = {self.procs[i].sentinel: i for i in pending}
            ready = connection.wait(list(pending.values()) + list(sentinels), remaining)
            # Pipes first: a worker that reported an error and exited has both ready.
            for i, conn in list(pending.items()):
                if conn in ready:
                    got[i] = self._recv(i)
                    if got[i][0] != kind or (step is not None and got[i][1] != step):
                        raise TensorParallelError(f"{self.rank_name(i)} sent {got[i]!r}, expected {kind!r} for step {step}")
                    del pending[i]
            for sentinel, i in sentinels.items():
                if sentinel in ready and i in pending and not pending[i].poll():
                    raise TensorParallelError(self._describe_exit(i))
        return got

    def _recv(self, i: int) -> tuple:
        try:
            msg = pickle.loads(self.conns[i].recv_bytes())
        except (EOFError, OSError):
            raise TensorParallelError(self._describe_exit(i)) from None
        if msg[0] == "error":
            where = "while starting" if msg[1] is None else f"at step {msg[1]}"
            raise TensorParallelError(f"{self.rank_name(i)} raised {where}:\n{msg[2]}")
        return msg

    def _describe_exit(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(1.0)  # reap it, so the exit code is known
        code = proc.exitcode
        if code is None:
            return f"{self.rank_name(i)} closed its pipe"
        if code < 0:
            return f"{self.rank_name(i)} was killed by {signal.Signals(-code).name}"
        return f"{self.rank_name(i)} exited with code {code}"

    def explain(self, grace_s: float) -> str | None:
        """After rank 0 failed inside a step: wait briefly for a worker to report an error or
        die (its sockets closing is usually what made rank 0 fail) and describe it."""
        deadline = time.monotonic() + grace_s
        while self.procs:
            for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
                try:
                    if conn.poll():
                        self._recv(i)  # raises on an error report or EOF
                        continue  # a late ack: this worker is fine
                except TensorParallelError as exc:
                    return str(exc)
                if not proc.is_alive():
                    return self._describe_exit(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            connection.wait(self.conns + [p.sentinel for p in self.procs], remaining)
        return None

    # -- watchers --
    def _start_watcher(self) -> None:
        """As soon as a worker process dies, fail the group, so rank 0 is not left waiting in a
        collective with a dead peer until the timeout: on CUDA abort the NCCL group, on the CPU
        mark the group failed (distributed.finish)."""
        wake_r, self._wake = get_context("spawn").Pipe(duplex=False)

        def watch() -> None:
            try:
                ready = connection.wait([p.sentinel for p in self.procs] + [wake_r])
            finally:
                wake_r.close()
            if wake_r in ready or self.closed:
                return
            dead = next(i for i, p in enumerate(self.procs) if p.sentinel in ready)
            try:
                if self.backend != "nccl":
                    mark_failed(f"{self.rank_name(dead)} died")
                    return
                logger.error("a tensor-parallel worker died; aborting the NCCL process group")
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception:  # best effort: the step will still raise from the sentinel
                logger.exception("failing the process group after a worker died failed")

        self._watcher = threading.Thread(target=watch, name="nanovllm-tp-watch", daemon=True)
        self._watcher.start()

    def _watch_remote_ranks(self) -> None:
        """Mark the group failed (distributed.mark_failed) once a rank on another node sends no
        heartbeat for SILENCE_S: rank 0's collectives then raise, and the step fails, naming it."""
        host, port = self.store.host, self.store.port
        remote = range(self.first_remote, self.world)

        def watch() -> None:
            try:
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=SILENCE_S))
                last = {r: (-1, time.monotonic()) for r in remote}  # rank -> (count, when it last moved)
                while not self._stop_watching_remote.wait(HEARTBEAT_S):
                    now = time.monotonic()
                    for r in remote:
                        count = store.add(beat_key(r), 0)
                        if count != last[r][0]:
                            last[r] = (count, now)
                        elif now - last[r][1] >= SILENCE_S:
                            why = f"rank {r} (node {r // self.local_world}) sent no heartbeat for {SILENCE_S:g}s"
                            logger.error("tensor parallel: %s; the process group is marked failed", why)
                            mark_failed(why)
                            return
            except Exception:  # noqa: BLE001 - the store is gone: the engine is closing or failed already
                if not self._stop_watching_remote.is_set():
                    logger.exception("tensor parallel: watching the other nodes' heartbeats failed")

        self._remote_watcher = threading.Thread(target=watch, name="nanovllm-tp-heartbeats", daemon=True)
        self._remote_watcher.start()

    # -- shutdown --
    def close(self) -> None:
        """Stop (or, after a failure, terminate) every worker, reap it, and destroy the group."""
        if self.closed:
            return
        self.closed = True
        self._stop_watching_remote.set()
        if self._remote_watcher is not None:
            self._remote_watcher.join(2 * HEARTBEAT_S)
        if self._wake is not None:
            self._wake.close()  # wakes the watcher, which sees `closed` and returns
            if self._watcher is not None:
                self._watcher.join(5.0)
        if not self.broken and self.step_group is not None:
            try:
                broadcast_step(None, self.step_group)
            except Exception:  # noqa: BLE001 - a rank is gone: the group is destroyed below anyway
                logger.warning("tensor parallel: the stop message did not reach every rank")
        if not self.broken:
            stop = _dumps((None, None))
            for conn, proc in zip(self.conns, self.procs):
                if proc.is_alive():
                    try:
                        conn.send_bytes(stop)
                    except OSError:
                        pass  # already gone; reaped below
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.close()
        if self.group is not None and dist.is_initialized() and dist.group.WORLD is self.group:
            for release in self.before_destroy:
                try:
                    release()
                except Exception:  # noqa: BLE001 - closing goes on; the group must still be destroyed
                    logger.exception("tensor parallel: releasing %s before destroying the group failed", release)
            # A collective that gave up on a lost peer (collective_stuck) may still wait in
            # gloo, and whoever drops its group's last reference (a traceback's frame, too) joins
            # gloo's threads, which then wait for it. So that group is unregistered (a new engine
            # can start one, on another master port: this one stays bound) and a daemon thread
            # keeps it for the rest of the process.
            groups = (self.group, self.step_group)
            self.group = self.step_group = None
            if self.collective_stuck:
                threading.Thread(target=_keep, args=groups, name="nanovllm-tp-failed-group", daemon=True).start()
            dist.destroy_process_group()
            del groups
        self.group = None
        self.step_group = None
        self.store = None


# ---- the executor ----------------------------------------------------------------------------
class MultiprocExecutor:
    """Runs each step on `config.tensor_parallel_size` ranks; rank 0's runner is in this process.

    `port` (else NANOVLLM_TP_PORT, else 0 = a free one) and `timeout_s` (else
    NANOVLLM_TP_TIMEOUT_S, else 300) are read here because EngineConfig does not carry them;
    `worker_runner_cls` replaces the runner of ranks >= 1 (tests use it to inject failures).
    With one rank there are no workers: only the process group and the bookkeeping remain
    (benchmarks/tp_overhead.py measures that path). Steps run one at a time: every rank must
    answer before the next is sent (supports_async is False).
    """

    supports_async = False
    defers_sampling = False

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        *,
        port: int | None = None,
        timeout_s: float | None = None,
        worker_runner_cls: type[ModelRunner] = ModelRunner,
    ) -> None:
        world = config.tensor_parallel_size
        port = _env_number(PORT_ENV, int, 0) if port is None else port
        if not 0 <= port < 65536:
            raise ValueError(f"rendezvous port must be in [0, 65535] (0 = pick a free one), got {port}")
        timeout_s = _env_number(TIMEOUT_ENV, float, DEFAULT_TIMEOUT_S) if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        device = resolve_device(config.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        local_world = world // config.nnodes
        if backend == "nccl" and torch.cuda.device_count() < local_world:
            raise ValueError(f"tensor_parallel_size={world} over {config.nnodes} node(s) needs {local_world} GPUs "
                             f"per node; torch sees {torch.cuda.device_count()}")
        if config.nnodes > 1 or config.torchrun:
            port = config.master_port
        if dist.is_initialized():
            gc.collect()  # an engine that was dropped but not yet collected releases its group
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process (another tensor-parallel "
                "engine is running?); shut it down first: one process holds one TP engine at a time"
            )
        if backend == "nccl" and world > 1:
            torch.cuda.set_device(0)  # rank r lives on cuda:r

        self.world_size = world
        self.timeout_s = timeout_s
        self._step = 0
        self._failure: str | None = None
        self._workers = _Workers(backend, timeout_s, config.nnodes, config.join_timeout_s, config.torchrun)
        self._finalizer = weakref.finalize(self, self._workers.close)
        try:
            self._workers.start(world, port, config, source, worker_runner_cls)
            self._workers.join_group(world)
            device = _collective_device(backend)
            agree = None if world == 1 else (lambda n: _min_across_ranks(n, device))
            self.runner = ModelRunner(config, source, rank=0, agree_num_blocks=agree)
            self._workers.before_destroy.append(self.runner.release_graphs)
            # Workers finish building (CUDA graphs...) about when rank 0 does; a small step
            # timeout must not cut that short.
            ready = self._workers.collect("ready", None, max(timeout_s, DEFAULT_TIMEOUT_S))
            if any(msg[1] != self.runner.num_kvcache_blocks for msg in ready):
                raise TensorParallelError(
                    f"ranks disagree on the KV pool size: rank 0 has {self.runner.num_kvcache_blocks}, workers {ready}"
                )
        except BaseException as exc:
            self._fail(exc, "start-up")
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.device_type = self.runner.device.type
        self.decode_burst = 1  # bursts run on one rank (EngineConfig checks decode_burst)
        logger.info("tensor parallel: %d ranks (%s), pids %s", world, backend, [p.pid for p in self._workers.procs])

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    def execute_async(self, out: SchedulerOutput) -> StepResult:
        """The step, run to completion (see supports_async)."""
        return Done(self.execute(out))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel executor was shut down after a failure: {self._failure}")
        if self._workers.closed:
            raise RuntimeError("the tensor-parallel executor is shut down")
        if out.is_empty or self.world_size == 1:
            return self.runner.execute(out)
        self._step += 1
        try:
            self._workers.check_alive()
            if self._workers.step_group is not None:
                broadcast_step(encode_step(out), self._workers.step_group)
                return self.runner.execute(out)
            self._workers.send(_dumps((self._step, encode_step(out))))
            result = self.runner.execute(out)
            self._workers.collect("ack", self._step, self.timeout_s)
        except BaseException as exc:
            self._fail(exc, f"step {self._step}")
            raise
        return result

    def _fail(self, exc: BaseException, when: str) -> None:
        """Record why, shut everything down, and raise a TensorParallelError naming the cause.

        Rank 0's own errors usually come from a collective whose peer failed, so the workers are
        asked why first. Our own TensorParallelErrors, rank 0's ValueErrors (bad configuration,
        e.g. a shape that cannot be split, which every rank hits alike) and KeyboardInterrupt
        and the like propagate unchanged (the caller re-raises them).
        """
        wrap = isinstance(exc, Exception) and not isinstance(exc, (TensorParallelError, ValueError))
        if wrap:
            why = (self._workers.remote_errors() or self._workers.explain(EXPLAIN_GRACE_S)
                   or f"rank 0 raised {type(exc).__name__}: {exc}")
            if self._workers.has_remote_ranks:
                lo, hi = self._workers.first_remote, self.world_size - 1
                if self._workers.torchrun:
                    remote = f"rank {lo} is torchrun's" if lo == hi else f"ranks {lo}..{hi} are torchrun's"
                else:
                    remote = f"rank {lo} runs on another node" if lo == hi else f"ranks {lo}..{hi} run on other nodes"
                why += (f"\n({remote}: a node that died or became unreachable shows up as a peer that closed "
                        "its connection)")
        elif isinstance(exc, Exception):
            why = str(exc)
        else:
            why = f"interrupted ({type(exc).__name__})"
        self._failure = why
        self._workers.broken = True
        self._workers.collective_stuck = _caused_by(exc, GroupFailedError)
        self._finalizer()
        if wrap:
            raise TensorParallelError(f"tensor parallelism failed during {when}: {why}") from exc

    def shutdown(self) -> None:
        self._finalizer()


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether exc, or an exception it was raised from or during, is a `kind`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _env_number(name: str, kind: type, default: float) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
