"""The front-end's side of the engine core: `CoreClient`, shaped like `AsyncEngine` for the server.

Requests go out as token ids (`AddRequest`); what comes back per engine step is each request's
new token ids. This side turns them into text (`IncrementalDetokenizer`), applies stop strings
(a match finishes the sample here and aborts it in the core, which frees its blocks) and keeps
each request's state in its `CoreStream`.

A `CoreStream` is not a queue: new tokens are merged into the request's state as they arrive
and the consumer gets a snapshot of the newest state when it asks, so a client that reads slower
than tokens arrive costs O(its tokens) memory, never a backlog of outputs.

Threads: one I/O thread receives and decodes the core's messages and watches the core's health;
everything that touches request state (detokenization, stop strings, waking consumers) runs on
the event loop of the request, via one `call_soon_threadsafe` per loop per message. Sends are
serialised by a lock (any thread may abort).

The core is declared dead when its process is gone (a sentinel check, when the caller passes
one), its socket disconnects (a ZeroMQ monitor event), or it is silent for HEARTBEAT_TIMEOUT_S
(it sends stats every 0.5 s even when idle). Then every in-flight request fails with
`EngineDeadError`, new ones are refused, and `on_dead` is called.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from nanovllm.engine.async_engine import EngineDeadError, EngineOverloadedError, EngineStats
from nanovllm.engine.core import CoreAddresses, CoreInfo
from nanovllm.engine.detokenizer import (
    IncrementalDetokenizer, decode_after, ended_by_stop_token, stop_token_reason, streamable_text, text_token_ids,
    truncate_at_stop,
)
from nanovllm.engine.messages import (
    Abort, AddRequest, CoreOutput, Delta, Hello, params_to_wire, prompt_logprobs_from_wire,
)
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams, truncate_prompt
from nanovllm.text import check_token_ids

logger = logging.getLogger("nanovllm.client")

HEARTBEAT_TIMEOUT_S = 10.0  # backstop only: a dead process or a dropped socket is seen at once
POLL_S = 0.1
HELLO_S = 0.5


class _Sample:
    __slots__ = ("token_ids", "logprobs", "cumulative_logprob", "detok", "finish_reason", "stop_reason")

    def __init__(self, detok: IncrementalDetokenizer | None, logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None  # of the sampled tokens
        self.detok = detok
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or stop token id of a "stop"


class CoreStream:
    """One request's outputs as an async iterator of cumulative `RequestOutput`s (the last has
    finished=True); raises `EngineDeadError` if the core dies meanwhile. State lives here and
    is only touched on `loop`'s thread."""

    def __init__(self, client: "CoreClient", request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 stream: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.request_id = request_id
        self.loop = loop
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream_outputs = stream
        detok = (stream or bool(params.stop_list)) and client.tokenizer is not None
        self.samples = [
            _Sample(IncrementalDetokenizer(client.tokenizer, prompt_token_ids, params.skip_special_tokens)
                    if detok else None, params.logprobs is not None)
            for _ in range(params.n)
        ]
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs = None  # RequestOutput.prompt_logprobs: the core sends them once
        self.done = False  # every sample finished (state complete)
        self.finished = False  # the consumer has been given the final output
        self.error: BaseException | None = None
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._changed = asyncio.Event()

    # ---- loop thread: state updates ----
    def _settle(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def _fail(self, error: BaseException) -> None:
        self._settle(error)
        if not self.done:
            self.error = error
            self.done = True
            self._changed.set()

    def _apply(self, delta: Delta) -> None:
        if self.done:
            return  # e.g. the core's answer to our own stop-string abort
        stops, min_tokens = self.params.stop_list, self.params.min_tokens
        include = self.params.include_stop_str_in_output  # the stop string (or token) stays in the text
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_from_wire(delta.prompt_logprobs)
        for i, sample in enumerate(self.samples):
            if sample.finish_reason is not None or i >= len(delta.new_token_ids):
                continue
            new = delta.new_token_ids[i]
            if new and self.first_token_time is None:
                self.first_token_time = time.monotonic()
            lps = delta.logprobs[i] if delta.logprobs is not None else None
            reason = delta.finish_reasons[i] if i < len(delta.finish_reasons) else None
            with_text = len(new)  # the new tokens whose text the sample shows
            stop_reason = None
            if new and ended_by_stop_token(reason, new[-1], self.params.stop_token_ids, self.client.eos_token_ids):
                if not include:  # the token that ended the sample as a stop token keeps its id, not its text
                    with_text -= 1
                stop_reason = stop_token_reason(new[-1], self.params.ignore_eos, self.params.stop_token_ids,
                                                self.client.eos_token_ids)
            stopped = False
            for j, token in enumerate(new):
                sample.token_ids.append(token)
                if sample.logprobs is not None and lps is not None:
                    entry = dict(lps[j])
                    sample.logprobs.append(entry)
                    sample.cumulative_logprob += entry[token]
                if sample.detok is not None and j < with_text:
                    sample.detok.add(token)
                    found = None
                    if stops:
                        found = truncate_at_stop(sample.detok, stops, len(sample.token_ids) > min_tokens, include)
                    if found is not None:
                        stopped, stop_reason = True, found
                        break
            if not stopped and reason is not None and sample.detok is not None:
                sample.detok.flush()
                found = None
                if stops and reason != "abort":
                    found = truncate_at_stop(sample.detok, stops, len(sample.token_ids) > min_tokens, include)
                if found is not None:
                    reason = "stop"
                    stop_reason = found if stop_reason is None else stop_reason
            if stopped:
                sample.finish_reason, sample.stop_reason = "stop", stop_reason
                if not delta.finished:
                    self.client._send(Abort(self.request_id, i))  # free its blocks in the core now
            elif reason is not None:
                sample.finish_reason = reason
                sample.stop_reason = stop_reason if reason == "stop" else None
        if delta.finished:  # the core is done with the request
            for sample in self.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
        if all(s.finish_reason is not None for s in self.samples):
            self.done = True
            self.client._streams.pop(self.request_id, None)
        if self.stream_outputs or self.done:
            self._changed.set()

    # ---- loop thread: the consumer ----
    def _text(self, sample: _Sample, final: bool) -> str:
        if sample.detok is not None:
            return streamable_text(sample.detok, self.params.stop_list, final or sample.finish_reason is not None,
                                   self.params.include_stop_str_in_output)
        if self.client.tokenizer is None or not final:
            return ""
        ids = text_token_ids(sample.token_ids, sample.finish_reason, self.params.stop_token_ids,
                             self.client.eos_token_ids, self.params.include_stop_str_in_output)
        return decode_after(self.client.tokenizer, self.prompt_token_ids, ids, self.params.skip_special_tokens)

    def snapshot(self) -> RequestOutput:
        final = self.done
        outputs = []
        for i, s in enumerate(self.samples):
            outputs.append(CompletionOutput(index=i, text=self._text(s, final), token_ids=list(s.token_ids),
                                            finish_reason=s.finish_reason,
                                            logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                            cumulative_logprob=s.cumulative_logprob,
                                            stop_reason=s.stop_reason))
        return RequestOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=self.prompt_token_ids, outputs=outputs,
            finished=final, num_cached_tokens=self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs,
            metrics={"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                     "finished_time": time.monotonic() if final else None},
        )

    def __aiter__(self) -> "CoreStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._changed.wait()
        self._changed.clear()
        if self.error is not None:
            self.finished = True
            raise self.error
        out = self.snapshot()
        if out.finished:
            self.finished = True
        return out


class CoreClient:
    """Talks to one engine core. `add_request` from an event loop; `abort`, `shutdown` and the
    `stats` / `error` / `is_running` reads from anywhere."""

    def __init__(self, addresses: CoreAddresses, info: CoreInfo, core_alive: Callable[[], bool] | None = None,
                 on_dead: Callable[[], None] | None = None, connect_timeout: float = 30.0) -> None:
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.generation_defaults = info.generation_defaults
        self.eos_token_ids = list(info.eos_token_ids)
        self.model_path = info.model_path
        self.max_pending = info.max_pending  # the core's bound on requests queued or running
        self.error: BaseException | None = None
        self.stats = EngineStats(num_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        self._stats_requests = itertools.count(1)  # fresh_stats' Hello.stats_request numbers
        self._stats_answered = 0  # the largest of them answered (I/O thread)
        self._core_alive = core_alive
        self._on_dead = on_dead
        self._streams: dict[str, CoreStream] = {}
        self._closed = False
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        identity = os.urandom(8)
        self._in = self._ctx.socket(zmq.DEALER)
        self._in.setsockopt(zmq.IDENTITY, identity)
        self._in.setsockopt(zmq.LINGER, 1000)
        self._in.setsockopt(zmq.SNDHWM, 0)  # requests queue while the core runs a step (core.py)
        self._monitor = self._in.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._in.connect(addresses.input)
        self._out = self._ctx.socket(zmq.DEALER)
        self._out.setsockopt(zmq.IDENTITY, identity)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.RCVHWM, 0)  # outputs queue here rather than be dropped (core.py)
        self._out.connect(addresses.output)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._last_heard = time.monotonic()
        self._connect(connect_timeout)
        self._thread = threading.Thread(target=self._run, name="nanovllm-core-client", daemon=True)
        self._thread.start()

    def _connect(self, timeout: float) -> None:
        """Hello until the core answers on the output socket (both connections are up then)."""
        deadline = time.monotonic() + timeout
        while True:
            self._send(Hello())
            if self._out.poll(200):
                self._dispatch(self._decoder.decode(self._out.recv()))
                return
            if time.monotonic() > deadline or (self._core_alive is not None and not self._core_alive()):
                self.close()
                raise EngineDeadError("the engine core did not answer")

    # ---- any thread ----
    @property
    def is_running(self) -> bool:
        return self.error is None and not self._closed

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if self._closed:
            raise EngineDeadError("the engine is shutting down")

    async def fresh_stats(self, timeout: float = 1.0) -> EngineStats:
        """The core's stats as of now: asked for and answered (within timeout, else the latest
        ones). Several front-ends each keep the stats that reached them, the core sends them
        with each front-end's outputs only, so a scrape of an idle one would read older counters
        than the last scrape of a busy one; asked for, they never go backwards."""
        if self._closed or self.error is not None:
            return self.stats
        asked = next(self._stats_requests)
        self._send(Hello(stats_request=asked))
        deadline = time.monotonic() + timeout
        while self._stats_answered < asked and self.error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return self.stats

    def _send(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            if not self._in.closed:
                self._in.send(data)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def abort_stream(self, stream: CoreStream) -> None:
        if not stream.done:
            self._send(Abort(stream.request_id))

    def shutdown(self, abort: bool = True, timeout: float | None = 60.0, wait: bool = True) -> None:
        """Refuse new requests; with abort, abort those in flight (their streams end with
        finish_reason "abort"); with wait, close the connection. Idempotent."""
        self._closed = True
        if abort:
            for rid in list(self._streams):
                self.abort(rid)
        if wait:
            deadline = time.monotonic() + min(timeout if timeout is not None else 5.0, 2.0)
            while self._streams and self.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            self.close()

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if getattr(self, "_thread", None) is not None and self._thread is not threading.current_thread():
            self._thread.join(2)
        with self._send_lock:
            if self._in.closed:
                return
            try:
                self._in.disable_monitor()
            except zmq.ZMQError:
                pass
            self._ctx.destroy(linger=500)  # closes the sockets (our aborts still go out), then terminates

    # ---- event loop ----
    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams | None = None,
                          stream: bool = True) -> CoreStream:
        """Submit a tokenized prompt; returns its stream once the core accepted it. Raises
        ValueError (bad prompt or parameters), EngineOverloadedError or EngineDeadError."""
        params = params if params is not None else SamplingParams()
        self._check_alive()
        ids = self._validate(prompt, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        out = CoreStream(self, request_id, ids, params, stream, asyncio.get_running_loop())
        self._streams[request_id] = out
        if params.truncate_prompt_tokens is not None:  # applied by _validate: the core runs the ids as sent
            params = dataclasses.replace(params, truncate_prompt_tokens=None)
        self._send(AddRequest(request_id, ids, params_to_wire(params)))
        try:
            await out._accepted
        except asyncio.CancelledError:
            self._send(Abort(request_id))
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return out

    def _validate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The ids the request runs on (truncate_prompt_tokens applied here, so that its outputs
        carry them); ValueError for a prompt the engine would refuse."""
        if not isinstance(prompt, (list, tuple)):
            raise ValueError("the core takes prompts as token ids; tokenize them first")
        ids = check_token_ids(prompt, self.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty")
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             "(it must leave room for at least one generated token)")
        return ids

    async def generate(self, request_id: str, prompt: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        out = await self.add_request(request_id, prompt, params, stream=True)
        try:
            async for item in out:
                yield item
        finally:
            if not out.done:
                self.abort_stream(out)

    # ---- I/O thread ----
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_hello = 0.0
        try:
            while not self._stop.is_set() and self.error is None:
                if time.monotonic() >= next_hello:  # our heartbeat: the core aborts a silent front-end's requests
                    self._send(Hello())
                    next_hello = time.monotonic() + HELLO_S
                events = dict(poller.poll(int(POLL_S * 1000)))
                if self._out in events:
                    while True:
                        try:
                            data = self._out.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._last_heard = time.monotonic()
                        self._dispatch(self._decoder.decode(data))
                if self._monitor in events:
                    event = recv_monitor_message(self._monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED and not self._stop.is_set():
                        self._die("the engine core closed its connection (the process died)")
                if self._core_alive is not None and not self._core_alive() and not self._stop.is_set():
                    self._die("the engine core process died")
                if time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S and not self._stop.is_set():
                    self._die(f"the engine core sent nothing for {HEARTBEAT_TIMEOUT_S:.0f} s")
        except zmq.ContextTerminated:
            pass
        except Exception as exc:
            if not self._stop.is_set():
                logger.exception("the core client failed")
                self._die(f"the core client failed: {exc!r}")

    def _dispatch(self, out: CoreOutput) -> None:
        if out.stats is not None:  # the core's Stats carry EngineStats' fields but its time
            self.stats = EngineStats(**msgspec.structs.asdict(out.stats), time=time.monotonic())
            self._stats_answered = max(self._stats_answered, out.stats_answer)
        if out.error is not None:
            self._die(out.error)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, CoreStream, Any]]] = {}
        for rid in out.accepted:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(("ok", stream, None))
        for rid, kind, message in out.rejected:
            stream = self._streams.get(rid)
            if stream is not None:
                error = (ValueError(message) if kind == "invalid" else
                         EngineOverloadedError(message) if kind == "overloaded" else EngineDeadError(message))
                by_loop.setdefault(stream.loop, []).append(("fail", stream, error))
        for delta in out.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(("delta", stream, delta))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _apply_all, items)

    def _die(self, message: str) -> None:
        if self.error is not None:
            return
        logger.error("%s: failing %d in-flight requests", message, len(self._streams))
        self.error = EngineDeadError(message)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, CoreStream, Any]]] = {}
        for stream in list(self._streams.values()):
            by_loop.setdefault(stream.loop, []).append(("fail", stream, EngineDeadError(message)))
        self._streams.clear()
        for loop, items in by_loop.items():
            _call_in_loop(loop, _apply_all, items)
        if self._on_dead is not None:
            self._on_dead()


def _apply_all(items: list[tuple[str, CoreStream, Any]]) -> None:
    for kind, stream, payload in items:
        if kind == "ok":
            stream._settle(None)
        elif kind == "fail":
            stream._fail(payload)
        else:
            stream._apply(payload)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass
