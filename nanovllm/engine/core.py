"""The engine core process: `LLMEngine` in a busy loop of its own, front-ends over ZeroMQ.

The HTTP front-ends (tokenization, detokenization, stop strings, SSE) live in other processes,
so the GIL of this one is spent on scheduling and the model. Two threads:

- loop (main thread): reads and decodes the front-ends' messages (`messages.py`) from a ROUTER
  socket (blocking only when idle), runs `LLMEngine.step()`, turns its outputs (the engine's
  delta outputs: only the new token ids) into one `CoreOutput` per front-end, and encodes and
  sends them on a second ROUTER socket, so a step's outputs leave without a hand-over to
  another thread. Front-ends send `Hello` every HEARTBEAT_S; one silent for FRONTEND_TIMEOUT_S
  (its process died) has its requests aborted by the loop, which frees their KV blocks.
- heartbeat: every HEARTBEAT_S sends the current stats (its liveness signal and its metrics'
  engine gauges) to each front-end the loop has not written to lately, on the output socket
  (under a lock), so that front-ends hear from the core during a long step too.

Admission control: with `max_pending` requests queued or running, new ones are rejected as
"overloaded" (the front-end answers 503 with Retry-After). If a step raises, every front-end
gets the error and the process exits with status 1. It exits with its parent too (Linux
PR_SET_PDEATHSIG, plus a parent-pid watch), so a killed server leaves no orphan.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from nanovllm.engine.messages import (
    Abort,
    AddRequest,
    CoreOutput,
    Delta,
    FrontendMessage,
    Hello,
    Stats,
    params_from_wire,
    prompt_logprobs_to_wire,
)

logger = logging.getLogger("nanovllm.core")

HEARTBEAT_S = 0.5
FRONTEND_TIMEOUT_S = 3.0  # a front-end silent this long is dead: its requests are aborted
# A front-end taken for dead that speaks again within this long (it was stalled, not dead) gets
# the endings ("abort") of the requests aborted for it, so that its streams end.
DROPPED_ENDINGS_KEPT_S = 60.0


@dataclass
class CoreAddresses:
    input: str  # front-ends' DEALERs connect here to send requests
    output: str  # and here to receive outputs


@dataclass
class CoreInfo:
    """What a front-end needs to know about the engine, sent once the core is ready."""

    model_path: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the engine's tokenizer (pickled across processes), or None
    num_blocks: int
    # The model's sampling defaults (LLMEngine.generation_defaults): front-ends build SamplingParams.
    generation_defaults: dict = field(default_factory=dict)
    # The ids that end a sample as EOS: a sample they end leaves their text out (front-ends detokenize).
    eos_token_ids: list[int] = field(default_factory=list)
    # Requests the core queues or runs at once before it refuses more ("overloaded").
    max_pending: int | None = None


# ---- the process, parent side -----------------------------------------------------------------
class CoreProcess:
    """Starts the core (spawn context) and waits until it serves; `shutdown()` stops it and
    removes its socket directory."""

    def __init__(self, model: str | None, engine_kwargs: dict, max_pending: int, start_timeout: float = 600.0,
                 frontend_timeout: float = FRONTEND_TIMEOUT_S) -> None:
        import multiprocessing as mp

        self._dir = tempfile.mkdtemp(prefix="nanovllm-core-")
        self.addresses = CoreAddresses(f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_core, name="nanovllm-core",
                                   args=(model, engine_kwargs, self.addresses, max_pending, child_conn, os.getpid(),
                                         frontend_timeout))
        self.process.start()
        logger.info("engine core: pid %d, sockets in %s", self.process.pid, self._dir)
        child_conn.close()
        try:
            if not parent_conn.poll(start_timeout):
                raise RuntimeError(f"the engine core did not start within {start_timeout:.0f} s")
            try:
                result = parent_conn.recv()
            except EOFError:
                raise RuntimeError(f"the engine core exited while starting (status {self._exitcode()})") from None
            if isinstance(result, BaseException):
                raise result
            self.info: CoreInfo = result
        except BaseException:
            self.shutdown(timeout=5)
            raise
        finally:
            parent_conn.close()

    def _exitcode(self) -> int | None:
        self.process.join(5)
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """SIGTERM (the core stops its executor and exits), SIGKILL after `timeout`. Idempotent."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- the process, core side -------------------------------------------------------------------
def die_with_parent(parent_pid: int) -> None:
    """Exit (SIGTERM to ourselves) when the parent process dies, so nothing is left orphaned."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the parent dies
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="nanovllm-core-parent-watch", daemon=True).start()


def run_core(model: str | None, engine_kwargs: dict, addresses: CoreAddresses, max_pending: int, conn,
             parent_pid: int, frontend_timeout: float = FRONTEND_TIMEOUT_S) -> None:
    """The core process's entry point."""
    # Out of the server's process group (setsid): a SIGTERM to that group (a shell's or a service
    # manager's stop) reaches the parent, which drains its requests and then stops the core.
    os.setsid()
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    # SIGTERM ends the loop through SystemExit, so the executor's workers are stopped too.
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        from nanovllm.config import EngineConfig
        from nanovllm.engine.llm_engine import LLMEngine

        # The front-ends check each request's grammar before they send it (OpenAIServer.submit);
        # here a grammar that takes seconds to build must not hold up the loop.
        engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs), detokenize=False, grammars_checked=True)
    except BaseException as exc:  # the parent re-raises it
        try:
            conn.send(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            conn.close()
        except OSError:  # the parent is gone (a SIGTERM to it and to us while loading): nobody to tell
            pass
        # The parent stops this process now; exiting here leaves no SystemExit for the
        # SIGTERM handler to raise into the interpreter's exit handlers (a stray traceback).
        logging.shutdown()
        os._exit(1)
    core = EngineCore(engine, addresses, max_pending, frontend_timeout)
    conn.send(CoreInfo(engine.source.path, engine.max_model_len, engine.vocab_size, engine.tokenizer,
                       engine.block_manager.num_blocks, engine.generation_defaults, list(engine.eos_token_ids),
                       max_pending))
    conn.close()
    signal.signal(signal.SIGTERM, core.on_sigterm)
    status = core.run()
    # os._exit: a ZeroMQ context with sockets open would hang the interpreter's exit.
    logging.shutdown()
    os._exit(status)


class EngineCore:
    def __init__(self, engine, addresses: CoreAddresses, max_pending: int,
                 frontend_timeout: float = FRONTEND_TIMEOUT_S) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.frontend_timeout = frontend_timeout
        self.ctx = zmq.Context()
        self.owner: dict[str, bytes] = {}  # request id -> front-end identity
        self.clients: dict[bytes, float] = {}  # front-end identity -> when last heard
        # front-end taken for dead -> (when, the deltas that end its aborted requests)
        self._dropped_endings: dict[bytes, tuple[float, list[Delta]]] = {}
        self._next_liveness_check = 0.0
        self._drained_at = time.monotonic()  # when _receive last read every message waiting
        self.num_aborted = 0
        self.stats = Stats()
        # Bind here, before the parent is told we are ready, so front-ends can connect at once.
        self._in = self.ctx.socket(zmq.ROUTER)
        # No high-water mark: between two reads a step runs, and a front-end sending into a full
        # pipe would block (its event loop with it) until the step ends.
        self._in.setsockopt(zmq.RCVHWM, 0)
        self._in.bind(addresses.input)
        self._out = self.ctx.socket(zmq.ROUTER)
        self._out.setsockopt(zmq.LINGER, 1000)
        # No high-water mark: a ROUTER drops what it cannot queue, so a front-end that stalls
        # for a while (CPU starved, paused) would lose tokens and hang its requests. What queues
        # is at most its requests' outputs; one silent for FRONTEND_TIMEOUT_S has them aborted.
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.bind(addresses.output)
        self._decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()  # the output socket is the loop's and the heartbeat's
        self._last_sent: dict[bytes, float] = {}  # front-end identity -> when last written to (under the lock)
        self._stopped = threading.Event()
        # SIGTERM (on_sigterm) waits for a send of the loop's in progress, which must not be
        # cut between its frames.
        self._sending = False
        self._exit_after_send = False
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="nanovllm-core-beat", daemon=True)
        self._heartbeat_thread.start()

    # ---- I/O ----
    def _receive(self, timeout_s: float) -> list[tuple[bytes, Any]]:
        """The front-ends' messages waiting now, decoded (after up to timeout_s for the first)."""
        commands = []
        if timeout_s > 0 and not self._in.poll(int(timeout_s * 1000)):
            self._drained_at = time.monotonic()
            return commands
        while True:
            try:
                ident, payload = self._in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self._drained_at = time.monotonic()
                return commands
            try:
                commands.append((ident, self._decoder.decode(payload)))
            except msgspec.DecodeError:
                logger.error("dropped an undecodable message from a front-end")

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM ends the loop through SystemExit (run's clean-up aborts the requests and
        stops the executor), once a send of the loop's in progress has finished."""
        if self._sending:
            self._exit_after_send = True
            return
        raise SystemExit(0)

    def _send(self, ident: bytes, out: CoreOutput) -> None:
        payload = self._encoder.encode(out)
        with self._send_lock:
            self._sending = True
            try:
                self._out.send_multipart([ident, payload])
            finally:
                self._sending = False
            self._last_sent[ident] = time.monotonic()
        if self._exit_after_send:
            self._exit_after_send = False
            raise SystemExit(0)

    def _heartbeat_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while not self._stopped.wait(HEARTBEAT_S / 2):
            beat = None
            with self._send_lock:
                now = time.monotonic()
                for ident in list(self.clients):
                    if now - self._last_sent.get(ident, 0.0) >= HEARTBEAT_S:
                        if beat is None:
                            beat = encoder.encode(CoreOutput(stats=self.stats))
                        self._out.send_multipart([ident, beat])
                        self._last_sent[ident] = now

    # ---- the loop ----
    def run(self) -> int:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                commands = self._receive(0.0 if busy else 1.0)  # idle: wait for work without spinning
                if not busy and not commands:
                    self._drop_silent_frontends()
                    continue
                replies: dict[bytes, CoreOutput] = {}
                for ident, msg in commands:
                    self._handle(ident, msg, replies)
                self._drop_silent_frontends()
                if self.engine.has_unfinished_requests():
                    self._collect(self.engine.step(), replies)
                self._publish(replies)
        except SystemExit:  # SIGTERM: the front-ends have drained (or are gone)
            try:
                self._abort_all()
            except Exception:  # interrupted mid-step: the state may be torn, and we exit anyway
                pass
            return 0
        except Exception as exc:  # the engine's state is unknown: tell every front-end, then exit
            logger.exception("the engine failed; the core exits")
            error = f"the engine failed: {exc!r}"
            for ident in list(self.clients):
                self._send(ident, CoreOutput(error=error))
            return 1
        finally:
            self._stopped.set()
            self._heartbeat_thread.join(5)
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _reply(self, replies: dict[bytes, CoreOutput], ident: bytes) -> CoreOutput:
        out = replies.get(ident)
        if out is None:
            out = replies[ident] = CoreOutput(deltas=[], accepted=[], rejected=[])
        return out

    def _drop_silent_frontends(self) -> None:
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + HEARTBEAT_S
        for ident, seen in list(self.clients.items()):
            # Silent up to the loop's last read of the socket: messages sent while the loop was
            # busy (a long step, a slow request) wait unread and do not make their sender silent.
            if self._drained_at - seen < self.frontend_timeout:
                continue
            del self.clients[ident]
            mine = [rid for rid, owner in self.owner.items() if owner == ident]
            if mine:
                logger.warning("a front-end went silent: aborting its %d requests", len(mine))
            endings: dict[bytes, CoreOutput] = {}
            for rid in mine:
                output = self.engine.abort_request(rid)
                if output is not None:
                    self.num_aborted += 1
                    self._collect([output], endings)
                self.owner.pop(rid, None)
            if ident in endings:
                self._dropped_endings[ident] = (now, endings[ident].deltas)
        for ident, (when, _) in list(self._dropped_endings.items()):
            if now - when > DROPPED_ENDINGS_KEPT_S:
                del self._dropped_endings[ident]

    def _handle(self, ident: bytes, msg: Any, replies: dict[bytes, CoreOutput]) -> None:
        known = ident in self.clients
        self.clients[ident] = time.monotonic()
        if not known and ident in self._dropped_endings:  # it was stalled, not dead: end its streams
            self._reply(replies, ident).deltas.extend(self._dropped_endings.pop(ident)[1])
        if isinstance(msg, Hello):
            if not known or msg.stats_request:  # answered with the stats: the front-end knows it is heard
                out = self._reply(replies, ident)
                out.stats_answer = max(out.stats_answer, msg.stats_request)
            return
        if isinstance(msg, AddRequest):
            out = self._reply(replies, ident)
            if self.engine.num_unfinished_requests >= self.max_pending:
                out.rejected.append((msg.request_id, "overloaded",
                                     f"the server has {self.max_pending} requests queued or running; retry later"))
                return
            try:
                params = params_from_wire(msg.params)
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, stream=True, delta=True)
            except ValueError as exc:
                out.rejected.append((msg.request_id, "invalid", str(exc)))
                return
            except Exception as exc:  # rejected before the engine changed: only this request fails
                logger.exception("add_request(%r) failed", msg.request_id)
                out.rejected.append((msg.request_id, "invalid", f"{type(exc).__name__}: {exc}"))
                return
            self.owner[msg.request_id] = ident
            out.accepted.append(msg.request_id)
            return
        if isinstance(msg, Abort):
            if self.owner.get(msg.request_id) != ident:
                return  # finished already, or not this front-end's
            output = self.engine.abort_request(msg.request_id, msg.index)
            if output is not None:
                if msg.index is None:
                    self.num_aborted += 1
                self._collect([output], replies)

    def _collect(self, outputs: list, replies: dict[bytes, CoreOutput]) -> None:
        """The engine's outputs (deltas: the engine was asked for them) into their front-ends' replies."""
        for output in outputs:
            rid = output.request_id
            ident = self.owner.get(rid)
            if ident is None:
                continue
            samples = output.outputs
            logprobs = None
            if samples[0].logprobs is not None:
                logprobs = [[list(entry.items()) for entry in c.logprobs] for c in samples]
            self._reply(replies, ident).deltas.append(
                Delta(rid, [c.token_ids for c in samples], [c.finish_reason for c in samples], output.finished,
                      logprobs, output.num_cached_tokens, prompt_logprobs_to_wire(output.prompt_logprobs)))
            if output.finished:
                del self.owner[rid]

    def _abort_all(self) -> None:
        replies: dict[bytes, CoreOutput] = {}
        for rid in list(self.owner):
            output = self.engine.abort_request(rid)
            if output is not None:
                self.num_aborted += 1
                self._collect([output], replies)
        self._publish(replies)

    def _publish(self, replies: dict[bytes, CoreOutput]) -> None:
        self.stats = stats = Stats(**self.engine.load_snapshot(), num_aborted=self.num_aborted)
        for ident, out in replies.items():
            out.stats = stats
            self._send(ident, out)
