"""The engine loop on its own thread, for asyncio callers (the HTTP server).

`LLMEngine` is not thread-safe, so exactly one thread ever touches it: the engine thread started
here. Callers talk to it through a thread-safe inbox (`queue.SimpleQueue`) of commands (add a
request, abort one, stop); outputs travel back to each request's `asyncio.Queue` through
`loop.call_soon_threadsafe`, the one safe way to wake an event loop from another thread (one
call per loop per step, not one per request). With no work the thread blocks on the inbox, so an
idle server burns no CPU; with work it drains the inbox without blocking between steps.

Outputs are cumulative (each carries all text and tokens so far), so a consumer that falls
behind needs only the newest: `RequestStream` drains its queue and yields the latest output,
which bounds what a slow client costs.

Aborts go through the inbox too and free the request's KV blocks on the next loop iteration
(before the next step). If `LLMEngine.step` raises, the engine's state is unknown: every
in-flight request gets an `EngineDeadError`, the engine is marked failed (the server answers
503 from then on) and the thread stays only to reject new work until `shutdown()`.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class EngineDeadError(RuntimeError):
    """The engine failed or is shutting down: it accepts no more requests."""


class EngineOverloadedError(RuntimeError):
    """The engine has as many requests queued or running as it admits: retry later."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, published by the engine thread after each iteration so
    other threads can read it (metrics, health) without touching the engine."""

    num_requests_running: int = 0  # requests with at least one sequence running
    num_requests_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_queries: int = 0  # prompt blocks looked up in the prefix cache
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0  # requests aborted while still running
    num_steps: int = 0  # engine steps since start
    step_seconds: float = 0.0  # seconds spent inside them
    device_wait_seconds: float = 0.0  # of which waiting for a launched step's tokens
    num_prompt_steps: int = 0  # steps with a prompt chunk of 2+ tokens (outside the decode's CUDA graphs)
    prompt_step_seconds: float = 0.0  # seconds spent inside them
    time: float = 0.0  # time.monotonic() of the snapshot

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class RequestStream:
    """The outputs of one request, as an async iterator (created by `AsyncEngine.add_request`).

    Yields cumulative `RequestOutput`s; the last one has `finished=True`. Raises the engine's
    error (`EngineDeadError`) if the engine fails while the request runs.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._latest: RequestOutput | None = None

    # Called on the event loop's thread (scheduled by the engine thread).
    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self._latest = item
        self._queue.put_nowait(item)

    def snapshot(self) -> RequestOutput | None:
        """The newest output the engine sent, read or not (an unstreamed request gets only its
        final one); None before any."""
        return self._latest

    def _settle(self, error: BaseException | None) -> None:
        if self._accepted.done():  # the caller gave up waiting
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # Outputs are cumulative: skip to the newest, but never past a final output or an error.
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams | None
    stream_outputs: bool


@dataclass
class _Abort:
    request_id: str
    stream: RequestStream | None = None  # abort only if the id still belongs to this stream


@dataclass
class _Stop:
    abort: bool  # True: abort in-flight requests; False: let them finish first


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread and serves requests to asyncio code.

    `generate()` (or `add_request()` then iterate) from any event loop; `abort()` and
    `shutdown()` from any thread. `stats` and `error` are safe to read from anywhere.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # The engine thread detokenizes with engine.tokenizer; callers (chat templates, token
        # strings for logprobs) get their own copy, since HF tokenizers are not thread-safe.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.model_path = engine.source.path  # /v1/models reports it as `root`
        self.generation_defaults = engine.generation_defaults
        self.error: BaseException | None = None  # set once the engine has failed
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_aborted = 0  # engine thread only
        self._lock = threading.Lock()  # orders "check closed + enqueue" against "close + stop"
        self._closed = False
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "AsyncEngine":
        """Build the engine like `LLM(model, **kwargs)` does, then start its thread."""
        return cls(LLMEngine(EngineConfig.from_kwargs(model, **kwargs)))

    # ---- caller side (any thread / event loop) ---------------------------------------------
    @property
    def is_running(self) -> bool:
        """True while the engine accepts requests (not failed, not shut down)."""
        return self.error is None and not self._closed and self._thread.is_alive()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error!r}")
        if self._closed:
            raise EngineDeadError("the engine is shutting down")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has died")

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Submit a request; returns its output stream once the engine has accepted it.

        Raises ValueError (bad prompt or parameters, duplicate id) or EngineDeadError. With
        stream=False the stream yields only the final output.
        """
        loop = asyncio.get_running_loop()
        out = RequestStream(request_id, loop)
        with self._lock:
            self._check_alive()
            self._inbox.put(_Add(out, prompt, params, stream))
        try:
            await out._accepted
        except asyncio.CancelledError:
            self._inbox.put(_Abort(request_id, out))
            raise
        return out

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's cumulative outputs; leaving the loop early aborts the request."""
        out = await self.add_request(request_id, prompt, params, stream=True)
        try:
            async for item in out:
                yield item
        finally:
            if not out.finished:
                self.abort_stream(out)

    async def fresh_stats(self) -> EngineStats:
        """The engine's stats, published after each of its iterations (as CoreClient.fresh_stats)."""
        return self.stats

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once). Its blocks are freed before the
        engine's next step; its stream ends with a final output whose finish_reason is "abort"."""
        self._inbox.put(_Abort(request_id))

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort the request behind `stream`, unless it already finished (no-op then)."""
        if not stream.finished:
            self._inbox.put(_Abort(stream.request_id, stream))

    def shutdown(self, abort: bool = True, timeout: float | None = 60.0, wait: bool = True) -> None:
        """Stop the engine thread: abort in-flight requests (their streams end with
        finish_reason "abort") or, with abort=False, let them finish; reject new ones; shut the
        executor down; join the thread unless wait=False (safe to call from an event loop then).
        Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(_Stop(abort))
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s", timeout)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if stopping and not busy:
                    break
                # Block only when idle: an idle engine waits on the inbox without spinning.
                commands = [] if busy else [self._inbox.get()]
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    stopping = self._handle(command, stopping) or stopping
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                self._publish_stats()
        except Exception as exc:  # the engine's state is unknown from here on
            logger.exception("the engine failed; failing every in-flight request")
            self.error = exc
            self._fail_all(exc)
            self._reject_until_stopped(stopping)
        finally:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _handle(self, command: _Add | _Abort | _Stop, stopping: bool) -> bool:
        """Apply one command; returns True when it asks the loop to stop."""
        if isinstance(command, _Add):
            stream = command.stream
            if stopping:
                self._settle(stream, EngineDeadError("the engine is shutting down"))
                return False
            try:
                self.engine.add_request(stream.request_id, command.prompt, command.params, stream=command.stream_outputs)
            except Exception as exc:  # rejected before the engine changed: only this request fails
                if not isinstance(exc, ValueError):
                    logger.exception("add_request(%r) failed", stream.request_id)
                self._settle(stream, exc)
                return False
            self._streams[stream.request_id] = stream
            self._settle(stream, None)
            return False
        if isinstance(command, _Abort):
            current = self._streams.get(command.request_id)
            if command.stream is not None and current is not command.stream:
                return False  # finished already, or the id now belongs to another request
            output = self.engine.abort_request(command.request_id)
            if output is not None:
                self._num_aborted += 1
                self._deliver([output])
            return False
        if command.abort:
            for request_id in list(self._streams):
                output = self.engine.abort_request(request_id)
                if output is not None:
                    self._num_aborted += 1
                    self._deliver([output])
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            self._call_in_loop(loop, _put_all, items)

    def _settle(self, stream: RequestStream, error: BaseException | None) -> None:
        self._call_in_loop(stream.loop, stream._settle, error)

    @staticmethod
    def _call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _fail_all(self, exc: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, BaseException]]] = {}
        for stream in self._streams.values():
            error = EngineDeadError(f"the engine failed: {exc!r}")
            error.__cause__ = exc
            by_loop.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        for loop, items in by_loop.items():
            self._call_in_loop(loop, _put_all, items)

    def _reject_until_stopped(self, stopping: bool) -> None:
        """After a failure: answer every new request with the error until shutdown()."""
        while not stopping:
            command = self._inbox.get()
            if isinstance(command, _Add):
                self._settle(command.stream, EngineDeadError(f"the engine has failed: {self.error!r}"))
            elif isinstance(command, _Stop):
                stopping = True
        while True:  # anything enqueued before the stop command
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._settle(command.stream, EngineDeadError("the engine is shutting down"))

    def _publish_stats(self) -> None:
        self.stats = EngineStats(**self.engine.load_snapshot(), num_aborted=self._num_aborted, time=time.monotonic())


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)
