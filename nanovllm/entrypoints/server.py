"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics.

`create_app(engine, model_name, api_key)` builds an app around a running engine: a `CoreClient`
(the engine core in its own process, as `nanovllm serve` runs it) or an in-process
`AsyncEngine`; both take token ids and give cumulative outputs per request. The app does not
own the engine: `nanovllm serve` shuts it down after uvicorn has stopped (after in-flight
requests finished, or were cancelled at the graceful-shutdown timeout).

A request goes: `CORSGuard` (a browser's preflight is answered there) -> `RequestGuard` (Host
header, API key and body limits, before the body is parsed; entrypoints/guard.py, docs/server.md
"Limits and security") -> parse (pydantic) -> checks (a prompt's characters are counted before
it is tokenized) -> tokenize on the tokenizer thread -> `SamplingParams` -> `engine.add_request`
for each prompt. The engine accepts or rejects a prompt before any byte of the response is sent,
so a bad prompt (too long, empty, ids outside the vocabulary) is a clean 400 even for a stream,
and a full engine a 503 with Retry-After. Then the handler streams SSE chunks or waits for the
final outputs.

Clients that go away abort their requests (blocks freed at once): for streams, Starlette cancels
the response when it sees `http.disconnect` and `_EventStream` aborts whatever is unfinished; for
non-streaming requests a watcher on `receive()` does the same. A stream whose client stops
reading is cut off after `stream_write_timeout` seconds.

Every error leaves in OpenAI's shape. Client mistakes are 400 (FastAPI's 422 is overridden),
401 for a wrong API key, 404/405 for unknown routes, 503 once the engine has failed, is
shutting down or is full; 500 is only for bugs.

Metrics live in a per-app `CollectorRegistry` (two apps in one process do not collide): HTTP
responses by endpoint and code, finished completions by reason, prompt/generation tokens, TTFT,
inter-token latency and end-to-end histograms, engine gauges read from `engine.stats` (a
snapshot, so scraping never touches the engine), and, with one front-end process, that
process's CPU time and memory (prometheus_client's process collector: `process_*`).
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm import __version__
from nanovllm.bad_words import bad_words_token_ids
from nanovllm.chat import chat_prompt_ids, error_field
from nanovllm.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream
from nanovllm.entrypoints.guard import CORSGuard, InternalErrorGuard, RequestGuard
from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.openapi import document_responses
from nanovllm.entrypoints.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    OpenAIError,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    bad_request,
    error_body,
)
from nanovllm.entrypoints.reasoning import prompt_opens_reasoning
from nanovllm.entrypoints.token_bytes import TokenBytes
from nanovllm.entrypoints.tokenization import (
    ChatOptions, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, parse_detokenize, parse_tokenize, tokenize,
)
from nanovllm.entrypoints.tool_parsers import ParsedDelta
from nanovllm.entrypoints.tools import ChoiceParser, ParserConfig, plan_tools
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams, truncate_prompt
from nanovllm.text import check_token_ids

logger = logging.getLogger("nanovllm.server")
# Constraints (kind, spec text) that passed the server's grammar check, remembered per server.
GRAMMARS_CHECKED_KEPT = 256
# Requests' grammars built at once for their errors (OpenAIServer._check_grammar), and how
# often a request waiting for its check looks whether the engine is shutting down.
GRAMMAR_CHECK_THREADS = 16
CHECK_WATCH_SECONDS = 0.25

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHARS_PER_TOKEN_LIMIT = 16  # default prompt character limit: max_model_len x this
DEFAULT_STREAM_WRITE_TIMEOUT = 60.0  # seconds a stream may wait for a client that does not read
RETRY_AFTER_S = 1
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version")
MODEL_ROUTE = "/v1/models/{model}"  # OpenAI's retrieve-model; the id may hold slashes ("org/name")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


# ---- metrics ---------------------------------------------------------------------------------
class _EngineCollector:
    """Engine gauges and counters, read from the engine's latest stats snapshot at scrape time.
    What vLLM also measures carries vLLM's name and `model_name` label, which routers, gateways
    and autoscalers read (docs/scaling.md); the nanovllm_ rest has no vLLM counterpart."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats
        vllm_gauges = [
            ("vllm:num_requests_running", "Requests with a sequence in the running batch.", s.num_requests_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", s.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).", s.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its older name.", s.kv_cache_usage),
        ]
        for name, doc, value in vllm_gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted (recomputed later) for "
                                          "lack of KV blocks.", labels=["model_name"])
        preemptions.add_metric([self.model_name], s.num_preemptions)
        yield preemptions
        gauges = [
            ("nanovllm_kv_cache_blocks_total", "KV cache blocks in the pool.", s.num_blocks),
            ("nanovllm_kv_cache_blocks_free", "Free KV cache blocks (prefix-cached but unreferenced count as free).", s.num_free_blocks),
            ("nanovllm_prefix_cache_hit_rate", "Prompt blocks served by the prefix cache / blocks looked up, since start.", s.prefix_cache_hit_rate),
            ("nanovllm_engine_healthy", "1 while the engine accepts requests, 0 once it failed or is shutting down.", float(self.engine.is_running)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("nanovllm_prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", s.prefix_queries),
            ("nanovllm_prefix_cache_hits", "Prompt blocks found in the prefix cache.", s.prefix_hits),
            ("nanovllm_num_aborted_requests", "Requests aborted while running (client gone, shutdown).", s.num_aborted),
            ("nanovllm_engine_steps", "Engine steps (scheduling, launching a step, processing the tokens of the "
             "one before).", s.num_steps),
            ("nanovllm_engine_step_seconds", "Seconds the engine spent inside its steps; its rate is the engine's "
             "busy fraction.", s.step_seconds),
            ("nanovllm_engine_device_wait_seconds", "Of nanovllm_engine_step_seconds, the seconds spent waiting "
             "for a launched step's tokens (async scheduling).", s.device_wait_seconds),
            ("nanovllm_engine_prompt_steps", "Of nanovllm_engine_steps, the steps that computed a prompt chunk "
             "of more than one token (beside decodes or not).", s.num_prompt_steps),
            ("nanovllm_engine_prompt_step_seconds", "Of nanovllm_engine_step_seconds, the seconds spent inside "
             "nanovllm_engine_prompt_steps.", s.prompt_step_seconds),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """With PROMETHEUS_MULTIPROC_DIR set (`--api-server-count` > 1), counters and histograms
    live in that directory's files and a scrape of any front-end sums every front-end's; the
    engine's gauges and counters come from the core's stats, asked for at scrape time
    (`engine.fresh_stats`)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        r = None if self.multiprocess else self.registry
        self.http_requests = Counter("nanovllm_http_requests", "HTTP responses by endpoint and status code.",
                                     ["endpoint", "code"], registry=r)
        # vLLM's names and label (docs/scaling.md); each is bound to this server's model_name.
        name = ["model_name"]
        self._finished = Counter("vllm:request_success", "Completions (choices) finished, by finish reason "
                                 "(stop, length, abort, error).", name + ["finished_reason"], registry=r)
        self.model_name = model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", name,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", name,
                                         registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Request arrival to first generated token.", name,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens of a streamed "
                             "request, as seen by the server.", name, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to last token.", name,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.registry.register(_EngineCollector(engine, model_name))
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry)
        else:  # process_cpu_seconds_total and the like, of this front-end's process (one process only:
            # with several, a scrape would show whichever one answered it)
            ProcessCollector(registry=self.registry)

    def finished(self, reason: str) -> Any:
        """The finished-completions counter for `reason`."""
        return self._finished.labels(self.model_name, reason)


class _HTTPMetricsMiddleware:
    """Counts responses by endpoint and status code (pure ASGI, so streaming passes through)."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else MODEL_ROUTE if path.startswith("/v1/models/") else "other"
        try:
            await self.app(scope, receive, send_and_record)
        except asyncio.CancelledError:
            raise
        except BaseException:
            status = status or 500  # a bug (logged by the server)
            raise
        finally:
            # Nothing answered and nothing failed: the client went away first (499, as nginx counts it).
            self.counter.labels(endpoint, str(status or 499)).inc()


class _Tracker:
    """Per-HTTP-request accounting for metrics: TTFT, inter-token latency, tokens, finish reasons."""

    def __init__(self, metrics: ServerMetrics, num_streams: int, n: int, streaming: bool) -> None:
        self.metrics = metrics
        self.n = n
        self.streaming = streaming
        self.start = time.monotonic()
        self.last_time = [self.start] * num_streams
        self.num_tokens = [0] * num_streams
        self.outputs: list[RequestOutput | None] = [None] * num_streams
        self.finished = False

    def update(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        count = max(len(c.token_ids) for c in out.outputs)
        prev = self.num_tokens[i]
        if count > prev:
            if prev == 0:
                first = out.metrics.get("first_token_time")
                self.metrics.ttft.observe((now if self.streaming or first is None else first) - self.start)
            elif self.streaming:
                gap = (now - self.last_time[i]) / (count - prev)
                for _ in range(count - prev):
                    self.metrics.itl.observe(gap)
            self.last_time[i] = now
            self.num_tokens[i] = count
        self.outputs[i] = out

    def finish(self, error: bool = False) -> None:
        """Record the request's outcome (once: a streamed one may end in its body or, cut off
        before its body ran, in its response's close)."""
        if self.finished:
            return
        self.finished = True
        m = self.metrics
        for out in self.outputs:
            if out is None:
                m.finished("error" if error else "abort").inc(self.n)
                continue
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                m.generation_tokens.inc(len(c.token_ids))
                reason = c.finish_reason if out.finished and c.finish_reason else ("error" if error else "abort")
                m.finished(reason).inc()
        m.e2e.observe(time.monotonic() - self.start)


# ---- helpers ---------------------------------------------------------------------------------
async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends (done, client gone, cancelled).

    A client that stops reading makes `send` wait (uvicorn's flow control) while the request's
    tokens keep merging into its stream's state; after `write_timeout` seconds of one blocked
    send the connection is dropped and the request aborted."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], write_timeout: float) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._write_timeout = write_timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_or_drop(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), self._write_timeout)
            except asyncio.TimeoutError:
                logger.warning("dropping a client that read nothing for %.0f s", self._write_timeout)
                raise _ClientStalled() from None

        try:
            await super().__call__(scope, receive, send_or_drop)
        except _ClientStalled:
            pass  # uvicorn closes a connection whose response did not complete
        finally:
            self._on_close()
            # A body left mid-stream (a dropped client) is closed here, so that its own clean-up
            # (the request's metrics) runs now rather than whenever it is collected.
            await self.body_iterator.aclose()


class _ClientStalled(Exception):
    pass


async def _sse_body(events: AsyncIterator[str], tracker: "_Tracker") -> AsyncIterator[str]:
    """A stream's events, then `[DONE]`; an engine failure, or an output constraint that
    allows no output (_check_constraint), becomes an error event (then `[DONE]`); the request's
    metrics are recorded however the stream ends."""
    error = False
    try:
        async for event in events:
            yield event
        yield "data: [DONE]\n\n"
    except EngineDeadError as exc:
        error = True
        yield _sse(error_body(str(exc), "service_unavailable", None, "engine_unavailable"))
        yield "data: [DONE]\n\n"
    except OpenAIError as exc:  # the request's own fault, found once it ran (_check_constraint)
        error = True
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # also when the client went away mid-stream
        tracker.finish(error=error)


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise bad_request("the request body must be JSON sent with 'Content-Type: application/json'") from None


# Characters JSON leaves unescaped (inside strings) that str.splitlines, and so line readers
# built on it (httpx's aiter_lines), take for line ends: escaped in events, so that such a
# client reads each event whole. Any JSON parser reads the escapes back as the characters.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    if not data.isascii():
        data = data.translate(_SPLITLINES_BREAKS)
    return f"data: {data}\n\n"


class _TokenText:
    """Token id -> its text, cached (for logprobs). Uses the AsyncEngine's tokenizer copy, which
    only the event loop's thread touches."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            self.cache[token_id] = text
        return text


def _delta_message(parsed: ParsedDelta) -> DeltaMessage:
    """A streamed step in OpenAI's shape: one entry per call, with its id, type and name the
    first time it appears."""
    calls: dict[int, DeltaToolCall] = {}
    for step in parsed.tool_calls:
        call = calls.get(step.index)
        if call is None:
            calls[step.index] = DeltaToolCall(
                index=step.index, id=step.id, type="function" if step.id else None,
                function=DeltaFunctionCall(name=step.name, arguments=step.arguments))
        else:
            call.function.arguments = (call.function.arguments or "") + step.arguments
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        tool_calls=list(calls.values()) or None)


def _build_grammar(spec: StructuredOutputsParams) -> None:
    from nanovllm.structured.grammar import build_grammar  # imports xgrammar: only once a request needs it

    build_grammar(spec)


def _constraint_param(params: SamplingParams, grammar_param: str) -> str:
    """The request field to name where a sample had nothing left to sample: its grammar's, or,
    without a grammar, allowed_token_ids (bad words of several tokens banned all of them)."""
    return grammar_param if params.structured_outputs is not None else "allowed_token_ids"


def _check_constraint(out: RequestOutput, param: str) -> None:
    """A 400 naming `param` (_constraint_param's) where a sample ended with nothing left to
    sample (finish reason "error"): its grammar allows no token at all (it matches no complete
    output), or its bad words ban every one of its allowed_token_ids."""
    for c in out.outputs:
        if c.finish_reason != "error":
            continue
        if param == "allowed_token_ids":
            raise bad_request(f"bad_words (and min_tokens, where given) ban every one of allowed_token_ids after "
                              f"{len(c.token_ids)} tokens of output", param=param)
        raise bad_request(f"the output constraint allows no token after {len(c.token_ids)} tokens of output "
                          "(with the request's allowed_token_ids, bad_words and min_tokens, where given): it "
                          "matches no complete output", param=param)


def _usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """Usage of these counts: a response's, or with stream_options.continuous_usage_stats
    (vLLM's) a streamed chunk's (its choice's prompt and the tokens that choice has generated so
    far)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _without_generation(out: RequestOutput) -> RequestOutput:
    """out with its samples' generated tokens left out (echo with max_tokens 0: the one token
    generated is not the client's)."""
    samples = [replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                       cumulative_logprob=None if c.cumulative_logprob is None else 0.0) for c in out.outputs]
    return replace(out, outputs=samples)


def _top(entry: dict[int, float], k: int, sampled: int | None = None) -> list[tuple[int, float]]:
    """The k most likely tokens of an entry (which holds the top-k alternatives plus the
    sampled token, which may rank below them); with `sampled`, that token too where it is not
    among them (a completion's top_logprobs: up to k + 1 entries, as OpenAI and vLLM give)."""
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
    if sampled is not None and sampled in entry and all(t != sampled for t, _ in top):
        top.append((sampled, entry[sampled]))
    return top


# ---- the server ------------------------------------------------------------------------------
class OpenAIServer:
    """Request handlers; `create_app` wires them to routes."""

    def __init__(self, engine: Any, model_name: str, limits: ServerLimits, max_prompt_chars: int | None = None,
                 stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT,
                 parsers: ParserConfig | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())  # the model card's `created`: when this server started
        self.limits = limits
        template = limits.chat_template or getattr(engine.tokenizer, "chat_template", None)
        self.parsers = (parsers or ParserConfig()).for_template(template)
        self.metrics = ServerMetrics(engine, model_name)
        self.token_text = _TokenText(engine.tokenizer)
        self.token_bytes = TokenBytes(engine.tokenizer, self.token_text)
        self.max_prompt_chars = max_prompt_chars or engine.max_model_len * CHARS_PER_TOKEN_LIMIT
        self.stream_write_timeout = stream_write_timeout
        # Prompts are tokenized (chat templates rendered) on this thread, with its own copy of
        # the tokenizer (HF tokenizers are not thread-safe), so a long prompt stalls neither
        # the event loop nor the engine.
        self._tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        if self._tokenizer is not None and limits.chat_template is not None:  # --chat-template
            self._tokenizer.chat_template = limits.chat_template
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenize")
        # Grammar checks (_check_grammar) apart: one that takes seconds holds up no tokenizing,
        # and, its C++ releasing the GIL, shares the cores with other checks rather than
        # holding them up in a queue.
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_CHECK_THREADS, thread_name_prefix="nanovllm-grammar-check")
        # (kind, spec text) of the constraints that passed the check, least recently used first:
        # a schema every request sends is built here once, not per request.
        self._grammars_checked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._checking = 0  # requests whose grammar is being checked
        # The engine core's bound on requests queued or running (None: an engine without one).
        self._max_pending: int | None = getattr(engine, "max_pending", None)

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Before tokenizing: a prompt far longer than any context is refused unread."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"the prompt has {num_chars} characters; this server accepts at most "
                              f"{self.max_prompt_chars} (max_model_len {self.engine.max_model_len} x "
                              f"{CHARS_PER_TOKEN_LIMIT}, or --max-prompt-chars)", param=param)

    def _encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        return self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if prompt else []

    async def tokenize(self, prompts: list[str | list[int]], param: str,
                       add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of every prompt (strings tokenized on the tokenizer thread, with the special
        tokens the tokenizer adds, such as a BOS, unless add_special_tokens is false)."""
        for p in prompts:
            if isinstance(p, str):
                self._check_chars(len(p), param)
        loop = asyncio.get_running_loop()
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                out.append(p)
                continue
            try:
                out.append(await loop.run_in_executor(self._tokenize_pool, self._encode, p, add_special_tokens))
            except ValueError as exc:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise bad_request(f"{where}{exc}", param=param) from None
        return out

    def _truncate(self, prompts: list[list[int]], k: int | None) -> list[list[int]]:
        """The prompts' ids as the engine runs them, with truncate_prompt_tokens k (vLLM's)
        applied here, the one place it is on a served request (its SamplingParams leave it
        out): their usage, a chat's default max_tokens and an echo count these. A k over
        max_model_len is a 400 naming the field."""
        try:
            return [truncate_prompt(p, k, self.engine.max_model_len) for p in prompts]
        except ValueError as exc:
            raise bad_request(str(exc), param="truncate_prompt_tokens") from None

    async def _echo_texts(self, prompts: list[str | list[int]], tokenized: list[list[int]],
                          kept: list[list[int]]) -> list[str]:
        """Each prompt's text, for echo: a text prompt as given, unless truncate_prompt_tokens cut
        it; token ids (and a cut text) decoded, special tokens kept, as vLLM decodes them. Ids
        are checked first (a 400 naming the prompt, as the engine's check), as the tokenizer
        fails on ones outside its range."""
        loop = asyncio.get_running_loop()
        texts = []
        for i, (p, t, k) in enumerate(zip(prompts, tokenized, kept)):
            if isinstance(p, str) and len(k) == len(t):
                texts.append(p)
                continue
            if self._tokenizer is None:
                raise bad_request("echo needs the model's tokenizer to give a token-id prompt's text", param="echo")
            try:
                check_token_ids(k, self.engine.vocab_size)
            except ValueError as exc:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise bad_request(f"{where}{exc}", param="prompt") from None
            texts.append(await loop.run_in_executor(self._tokenize_pool, self._tokenizer.decode, k))
        return texts

    # ---- checks ----
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise bad_request(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    async def submit(self, base_id: str, prompts: list[list[int]], params: SamplingParams, stream: bool,
                     param: str, grammar_param: str | None = None,
                     request: Request | None = None) -> list[RequestStream]:
        """Add one engine request per prompt (token ids: `tokenize` first), all at once; all or
        nothing. ValueError -> 400 naming `param`, or the sampling field the engine's message
        starts with (`grammar_param` for its grammar check: structured_outputs.*). `request`:
        the HTTP request, whose grammar check is dropped if its client leaves first."""
        if params.structured_outputs is not None:
            await self._check_grammar(params.structured_outputs, grammar_param, request)
        if params.bad_words and params.bad_words_token_ids is None:  # here, not in the engine core's loop
            params = replace(params, bad_words_token_ids=await self._bad_words_token_ids(params.bad_words))
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            *(self.engine.add_request(rid, prompt, params, stream=stream) for rid, prompt in zip(ids, prompts)),
            return_exceptions=True,
        )
        streams = [r for r in results if not isinstance(r, BaseException)]
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            self.abort(streams)
            i, exc = failed[0]
            if isinstance(exc, ValueError):
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise bad_request(f"{where}{exc}", param=_engine_error_field(str(exc), param, grammar_param)) from None
            raise exc
        return streams

    async def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """bad_words tokenized on the tokenizer thread (nanovllm/bad_words.py); a 400 naming them."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, bad_words_token_ids, self._tokenizer, bad_words, self.engine.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), param="bad_words") from None

    async def _check_grammar(self, spec: StructuredOutputsParams, param: str | None,
                             request: Request | None = None) -> None:
        """Build the request's grammar on a thread of the front-end's, for its errors (a 400
        naming `param`): a schema can take seconds to build, so the engine core builds it off
        its loop, where an error could no longer refuse the request. A constraint that passed
        lately is not built again. Where the client of `request` leaves first, the request ends
        (a 499 nobody reads), and where the engine shuts down first, a 503; either way its
        check, if still waiting for a thread, is dropped."""
        key = (spec.kind, spec.spec)
        if key in self._grammars_checked:
            self._grammars_checked.move_to_end(key)
            return
        self._refuse_if_full()
        check = asyncio.get_running_loop().run_in_executor(self._grammar_pool, _build_grammar, spec)
        gone = asyncio.ensure_future(_wait_for_disconnect(request)) if request is not None else None
        self._checking += 1
        try:
            while not check.done():
                await asyncio.wait({check} | ({gone} if gone else set()), timeout=CHECK_WATCH_SECONDS,
                                   return_when=asyncio.FIRST_COMPLETED)
                if check.done():
                    break
                if gone is not None and gone.done():
                    check.cancel()  # if not started yet, it never runs (a running one ends unheard)
                    raise OpenAIError(499, "the client closed the connection before its grammar was checked")
                if not self.engine.is_running:
                    check.cancel()
                    raise EngineDeadError("the request was aborted: the server is shutting down")
        finally:
            self._checking -= 1
            if gone is not None:
                gone.cancel()
        try:
            await check
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
        self._grammars_checked[key] = None
        while len(self._grammars_checked) > GRAMMARS_CHECKED_KEPT:
            self._grammars_checked.popitem(last=False)

    def _refuse_if_full(self) -> None:
        """Before a grammar check, which can keep a core busy for seconds: the 503 the engine
        core would give once the request is checked, where its latest stats (at most 0.5 s
        old), with the requests this front-end is checking, already reach its bound."""
        if self._max_pending is None:
            return
        stats = self.engine.stats
        if stats.num_requests_running + stats.num_requests_waiting + self._checking >= self._max_pending:
            raise EngineOverloadedError(f"the server has {self._max_pending} requests queued or running; retry later")

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort_stream(stream)

    def _close_stream(self, streams: list[RequestStream], tracker: _Tracker) -> None:
        """A streamed response's end, however it came: its requests are aborted (if still
        running) and its metrics recorded (if its body did not, cut off before it ran)."""
        self.abort(streams)
        tracker.finish()

    async def collect_finals(self, streams, request, tracker, constraint_param: str):
        """Final outputs of a non-streamed request (None if the client went away), with metrics;
        constraint_param: the request field to name (_constraint_param) in a 400 where a sample had
        nothing left to sample."""
        try:
            finals = await self.wait_final(streams, request, tracker)
            for out in finals or ():
                _check_constraint(out, constraint_param)
        except (EngineDeadError, OpenAIError):
            tracker.finish(error=True)
            raise
        tracker.finish()
        return finals

    async def wait_final(self, streams: list[RequestStream], request: Request,
                         tracker: _Tracker) -> list[RequestOutput] | None:
        """Final outputs in prompt order, or None when the client went away first (aborted)."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def collect() -> None:
            async for i, out in _merge(streams):
                tracker.update(i, out)
                if out.finished:
                    finals[i] = out

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # re-raises the engine's error, if any
                if any(c.finish_reason == "abort" for out in finals for c in out.outputs):  # type: ignore[union-attr]
                    raise EngineDeadError("the request was aborted: the server is shutting down")
                return finals  # type: ignore[return-value]
            # The client left: what its requests generated so far counts in the metrics.
            for i, stream in enumerate(streams):
                partial = stream.snapshot()
                if partial is not None and tracker.outputs[i] is None:
                    tracker.update(i, partial)
            return None
        finally:
            for task in (work, gone):
                task.cancel()
            self.abort(streams)

    # ---- /v1/completions ----
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check_unsupported()
        body.check_limits(self.limits.max_n, self.limits.max_prompts)
        prompts = body.prompts()
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params = body.sampling_params(max_tokens, body.logprobs, self.engine.vocab_size, self.engine.generation_defaults)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        tracker = _Tracker(self.metrics, len(prompts), params.n, body.stream)
        tokenized = await self.tokenize(prompts, "prompt", body.add_special_tokens)
        prompt_ids = self._truncate(tokenized, body.truncate_prompt_tokens)
        echoes = await self._echo_texts(prompts, tokenized, prompt_ids) if body.echo else None
        streams = await self.submit(request_id, prompt_ids, params, body.stream, "prompt", body.structured_param,
                                    request)
        if body.stream:
            events = self._completion_events(request_id, body, params, streams, tracker, echoes)
            return _EventStream(_sse_body(events, tracker), lambda: self._close_stream(streams, tracker),
                                self.stream_write_timeout)
        finals = await self.collect_finals(streams, request, tracker, _constraint_param(params, body.structured_param))
        if finals is None:
            return Response(status_code=499)  # client closed the connection; nobody reads this
        if body.echo_only:
            finals = [_without_generation(out) for out in finals]
        choices = []
        for i, out in enumerate(finals):
            prompt_logprobs = None
            if body.prompt_logprobs is not None:
                prompt_logprobs = self._prompt_logprobs(out, body.return_tokens_as_token_ids)
            for c in out.outputs:
                token_ids, entries, text = c.token_ids, c.logprobs or [], c.text
                if echoes is not None:
                    token_ids, entries, text = self._with_prompt(out, token_ids, entries, echoes[i] + text)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(token_ids, entries, body.logprobs, 0,
                                                         body.return_tokens_as_token_ids)
                choices.append(CompletionChoice(index=i * params.n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_logprobs))
        return JSONResponse(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                               usage=self._usage(finals)).model_dump())

    @staticmethod
    def _with_prompt(out: RequestOutput, token_ids: list[int], entries: list, text: str) -> tuple[list, list, str]:
        """An echoed choice's token ids and logprob entries, the prompt's first (its first
        token's entry None), and its text (the echo's already)."""
        prompt_entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return list(out.prompt_token_ids) + list(token_ids), list(prompt_entries) + list(entries), text

    async def _completion_events(self, request_id: str, body: CompletionRequest, params: SamplingParams,
                                 streams: list[RequestStream], tracker: _Tracker,
                                 echoes: list[str] | None = None) -> AsyncIterator[str]:
        """The SSE chunks of a streamed completion; `echoes` (echo: each prompt's text) comes
        first in the first chunk of each of its choices, as vLLM sends it."""
        created = int(time.time())
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        ended: set[int] = set()  # choices whose finish_reason went out (each in the chunk where it ends)
        constraint_param = _constraint_param(params, body.structured_param)
        async for i, out in _merge(streams):
            tracker.update(i, out)
            _check_constraint(out, constraint_param)
            if body.echo_only:
                out = _without_generation(out)
            for c in out.outputs:
                index = i * params.n + c.index
                if index in ended:
                    continue
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                delta = c.text[start_text:]
                new_ids = c.token_ids[start_tok:]
                new_entries = (c.logprobs or [])[start_tok:]
                finish = c.finish_reason
                if finish is not None:
                    ended.add(index)
                if not delta and not (body.logprobs is not None and new_ids) and finish is None:
                    continue
                if echoes is not None and index not in sent_text:  # the prompt before the choice's first tokens
                    new_ids, new_entries, delta = self._with_prompt(out, new_ids, new_entries, echoes[i] + delta)
                logprobs = None
                if body.logprobs is not None and new_ids:
                    logprobs = self._completion_logprobs(new_ids, new_entries, body.logprobs,
                                                         offsets.get(index, 0), body.return_tokens_as_token_ids)
                    offsets[index] = offsets.get(index, 0) + sum(len(self.token_text(t)) for t in new_ids)
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                usage = _usage_info(len(out.prompt_token_ids), len(c.token_ids)) if body.continuous_usage else None
                yield _sse(CompletionResponse(
                    id=request_id, created=created, model=self.model_name,
                    choices=[CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=finish,
                                              stop_reason=c.stop_reason if finish is not None else None)],
                    usage=usage,
                ))
        if body.include_usage:
            finals = tracker.outputs
            if body.echo_only:  # the token generated to end the request is not the client's
                finals = [out if out is None else _without_generation(out) for out in finals]
            yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                          usage=self._usage(finals)))

    # ---- /v1/chat/completions ----
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check_unsupported()
        body.check_limits(self.limits.max_n, self.limits.max_prompts)
        # checking the tools' schemas takes milliseconds each: on the tokenizer thread, not the event loop
        plan = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, plan_tools, body, self.parsers)
        messages = body.template_messages()
        self._check_chars(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls") or "")) for m in messages)
                          + len(json.dumps(plan.tools or "")), "messages")
        prompt_ids, prompt_tail = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self._chat_prompt, messages, body.add_generation_prompt, plan.tools,
            body.chat_template_kwargs, body.continue_final_message, body.add_special_tokens, self._request_template(body))
        (prompt_ids,) = self._truncate([prompt_ids], body.truncate_prompt_tokens)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # OpenAI's default: whatever room the context leaves
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, top, self.engine.vocab_size, self.engine.generation_defaults,
                                      structured_outputs=plan.structured_outputs)
        opens_reasoning = prompt_opens_reasoning(prompt_tail)
        constrained = params.structured_outputs is not None
        parsers = [ChoiceParser(plan, self.parsers, opens_reasoning, constrained) for _ in range(params.n)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = _Tracker(self.metrics, 1, params.n, body.stream)
        grammar_param = "tools" if plan.structured_outputs is not None else body.structured_param
        streams = await self.submit(request_id, [prompt_ids], params, body.stream, "messages", grammar_param, request)
        if body.stream:
            events = self._chat_events(request_id, body, params, parsers, streams[0], tracker,
                                       _constraint_param(params, grammar_param), len(prompt_ids))
            return _EventStream(_sse_body(events, tracker), lambda: self._close_stream(streams, tracker),
                                self.stream_write_timeout)
        finals = await self.collect_finals(streams, request, tracker, _constraint_param(params, grammar_param))
        if finals is None:
            return Response(status_code=499)  # client closed the connection; nobody reads this
        out = finals[0]
        echoed = body.echoed_text()
        choices = []
        for c in out.outputs:
            parser = parsers[c.index]
            parsed = parser.whole(c.text)
            content = parsed.content
            if content is None and not parsed.tool_calls and parsed.reasoning is None:
                content = ""
            if echoed:
                content = echoed + (content or "")
            calls = [ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                     for t in parsed.tool_calls]
            message = ChatResponseMessage(role=body.reply_role, content=content, reasoning_content=parsed.reasoning,
                                          tool_calls=calls)
            logprobs = None
            if top is not None:
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs or [], top, body.return_tokens_as_token_ids)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(out, body.return_tokens_as_token_ids)
        return JSONResponse(ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                                   usage=self._usage(finals), prompt_logprobs=prompt_logprobs
                                                   ).model_dump())

    def _request_template(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str | None:
        """The request's own chat_template, where the server trusts requests with one (a
        template is code the server runs); else a 400 naming the field."""
        if body.chat_template is not None and not self.limits.trust_request_chat_template:
            raise bad_request("a request's chat_template is rendered only by a server started with "
                              "--trust-request-chat-template", param="chat_template")
        return body.chat_template

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                     template_kwargs: dict[str, Any] | None, continue_final_message: bool = False,
                     add_special_tokens: bool = False, chat_template: str | None = None) -> tuple[list[int], str]:
        """Runs on the tokenizer thread: the prompt's ids, and the text of its last few tokens
        (does the template leave a think block open?). Contents are tokenized apart, so
        special-token text in them stays text, and add_special_tokens (vLLM's) puts the
        tokenizer's own BOS before the template's text (nanovllm/chat.py). chat_template: the
        request's own (checked against --trust-request-chat-template by the caller)."""
        tok = self._tokenizer
        if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
            raise bad_request("this model has no chat template; use /v1/completions, or start the server with "
                              "--chat-template", param="messages")
        try:
            ids = chat_prompt_ids(tok, messages, add_generation_prompt,
                                  parse_special_tokens=self.limits.parse_special_tokens_in_chat,
                                  tools=tools, template_kwargs=template_kwargs,
                                  continue_final_message=continue_final_message,
                                  add_special_tokens=add_special_tokens, chat_template=chat_template)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param=error_field(exc, request_template=chat_template is not None)) from None
        return ids, tok.decode(ids[-4:])

    async def _chat_events(self, request_id: str, body: ChatCompletionRequest, params: SamplingParams,
                           parsers: list[ChoiceParser], stream: RequestStream,
                           tracker: _Tracker, constraint_param: str, num_prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())
        top = (body.top_logprobs or 0) if body.logprobs else None

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                            choices=choices, usage=usage))

        sent_text = [0] * params.n
        sent_tokens = [0] * params.n
        ended: set[int] = set()  # choices whose finish_reason went out (each in the chunk where it ends)
        echoed = body.echoed_text()
        for i in range(params.n):
            usage = _usage_info(num_prompt_tokens, 0) if body.continuous_usage else None
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role=body.reply_role, content=""))], usage)
            if echoed:
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=echoed))], usage)
        async for _, out in _merge([stream]):
            tracker.update(0, out)
            _check_constraint(out, constraint_param)
            for c in out.outputs:
                i = c.index
                if i in ended:
                    continue
                text = c.text[sent_text[i]:]
                start_tok = sent_tokens[i]
                new_ids = c.token_ids[start_tok:]
                sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                parsed = parsers[i].feed(text) if text else ParsedDelta()
                finish = None
                if c.finish_reason is not None:
                    ended.add(i)
                    parsed.extend(parsers[i].finish())
                    finish = parsers[i].finish_reason(c.finish_reason)
                logprobs = None
                if top is not None and new_ids:
                    logprobs = self._chat_logprobs(new_ids, (c.logprobs or [])[start_tok:], top,
                                                   body.return_tokens_as_token_ids)
                if not parsed and logprobs is None and finish is None:
                    continue
                usage = _usage_info(num_prompt_tokens, len(c.token_ids)) if body.continuous_usage else None
                yield chunk([ChatChunkChoice(index=i, delta=_delta_message(parsed), logprobs=logprobs,
                                             finish_reason=finish, stop_reason=c.stop_reason if finish else None)],
                            usage)
        if body.include_usage:
            yield chunk([], usage=self._usage(tracker.outputs))

    # ---- formatting ----
    @staticmethod
    def _usage(outputs: list[RequestOutput | None]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
        completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
        return _usage_info(prompt, completion)

    def _token_str(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" with vLLM's
        return_tokens_as_token_ids (which tells apart tokens whose texts are partial characters)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None], k: int,
                             offset: int, as_ids: bool = False) -> CompletionLogprobs:
        """text_offset counts the tokens' text, also where as_ids names them by id. An entry None
        (an echoed prompt's first token) gives null logprobs."""
        result = CompletionLogprobs()
        for token, entry in zip(token_ids, logprobs):
            result.tokens.append(self._token_str(token, as_ids))
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(entry.get(token, float("-inf")))
                result.top_logprobs.append({self._token_str(t, as_ids): lp for t, lp in _top(entry, k, token)})
            result.text_offset.append(offset)
            offset += len(self.token_text(token))
        return result

    def _prompt_logprobs(self, out: RequestOutput, as_ids: bool) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of a response: per prompt token None (the first) or token id ->
        (logprob, rank, decoded_token); a logprob of -inf reads -9999.0, as vLLM clamps it."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(t): PromptLogprob(logprob=max(float(lp), -9999.0), rank=getattr(lp, "rank", None),
                                  decoded_token=self._token_str(t, as_ids))
            for t, lp in entry.items()} for entry in out.prompt_logprobs]

    def _token_bytes(self, token_id: int, as_id: bool) -> list[int]:
        """A token's `bytes` in chat logprobs: its raw bytes (token_bytes.py), or with as_id the
        UTF-8 of "token_id:<id>" (vLLM's)."""
        return list(f"token_id:{token_id}".encode()) if as_id else self.token_bytes(token_id)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                       as_ids: bool = False) -> ChatLogprobs:
        content = []
        for token, entry in zip(token_ids, logprobs):
            tops = [TopLogprob(token=self._token_str(t, as_ids), logprob=lp, bytes=self._token_bytes(t, as_ids))
                    for t, lp in _top(entry, k)]
            content.append(TokenLogprob(token=self._token_str(token, as_ids), logprob=entry.get(token, float("-inf")),
                                        bytes=self._token_bytes(token, as_ids), top_logprobs=tops))
        return ChatLogprobs(content=content)

    # ---- other endpoints ----
    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, root=getattr(self.engine, "model_path", None),
                         max_model_len=self.engine.max_model_len)

    async def models(self) -> ModelList:
        return ModelList(data=[self._model_card()])

    async def model(self, model: str) -> ModelCard:
        """GET /v1/models/{model}: OpenAI's retrieve-model, the card /v1/models lists under that id."""
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                              code="model_not_found")
        return self._model_card()

    async def tokenize_endpoint(self, request: Request) -> JSONResponse:
        """POST /tokenize (nanovllm/entrypoints/tokenization.py)."""
        body = parse_tokenize(await _json_body(request))
        self.check_model(body.model)
        if isinstance(body, TokenizeCompletionRequest):
            self._check_chars(len(body.prompt), "prompt")
            chat = None
        else:
            self._check_chars(sum(len(m.text()) for m in body.messages), "messages")
            chat = ChatOptions(self.limits.parse_special_tokens_in_chat, self._request_template(body))
        out = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, tokenize, self._tokenizer, body, self.engine.max_model_len, chat)
        return JSONResponse(out.model_dump())

    async def detokenize_endpoint(self, request: Request) -> JSONResponse:
        body = parse_detokenize(await _json_body(request))
        self.check_model(body.model)
        out = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, detokenize, self._tokenizer, body, self.engine.vocab_size)
        return JSONResponse(out.model_dump())

    async def health(self) -> Response:
        if self.engine.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.engine.error}")
        if not self.engine.is_running:
            raise EngineDeadError("the engine is shutting down")
        return JSONResponse({"status": "ok"})

    async def version(self) -> Response:
        """GET /version, as vLLM's: {"version": the package's}."""
        return JSONResponse({"version": __version__})

    async def metrics_endpoint(self) -> Response:
        await self.engine.fresh_stats()  # read by the engine collector
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False)
        self._grammar_pool.shutdown(wait=False)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus a clean end for requests still running at shutdown.

    On SIGINT/SIGTERM uvicorn stops accepting and waits for open connections. After `grace`
    seconds we abort what is left in the engine: streams then end properly (a final chunk with
    finish_reason "abort", then `data: [DONE]`) and unstreamed requests get a 503, instead of
    uvicorn cancelling their tasks mid-write, which it still does as a backstop a little later.
    """

    def __init__(self, engine: AsyncEngine, app: FastAPI, grace: float, **config: Any) -> None:
        config.setdefault("timeout_graceful_shutdown", grace + 5.0)
        super().__init__(uvicorn.Config(app, **config))
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets: list | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.grace, lambda: self.engine.shutdown(abort=True, wait=False))
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()


# The SamplingParams fields whose errors the engine names first in its message.
_ENGINE_CHECKED_FIELDS = ("bad_words", "allowed_token_ids", "logit_bias")


def _engine_error_field(message: str, param: str, grammar_param: str | None) -> str | None:
    """The request field an engine's ValueError is about: the grammar's field for a
    structured_outputs error, a sampling field its message starts with, else `param`."""
    if message.startswith("structured_outputs"):
        return grammar_param
    return next((name for name in _ENGINE_CHECKED_FIELDS if message.startswith(name)), param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        if first.get("type") == "missing":
            return "the request needs a JSON body", None
        return f"invalid request body: {first.get('msg', '')}", None
    param = loc[0]
    # A union field fails once per alternative, each with the alternative's name in its location;
    # name just the field then.
    union = sum(1 for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == [param]) > 1
    where = param if union else ".".join(loc)
    return f"invalid value for {where}: {first.get('msg', '')}", param


def create_app(engine: Any, model_name: str, api_key: str | None = None, *, limits: ServerLimits | None = None,
               max_prompt_chars: int | None = None,
               stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT,
               parsers: ParserConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (a `CoreClient`, or an in-process `AsyncEngine`) as model
    `model_name`. With `api_key`, /v1/* requires `Authorization: Bearer <api_key>` (/health and
    /metrics stay open). `limits`: the limits, Host and CORS policy (docs/server.md); the
    connection-level ones go to uvicorn separately (http_protocol.uvicorn_options).
    `max_prompt_chars` (default max_model_len x 16) refuses longer prompts before tokenizing them.
    `parsers`: the tool-call and reasoning parsers (entrypoints/tools.py; ValueError if
    --enable-auto-tool-choice finds no parser for the chat template)."""
    limits = limits if limits is not None else ServerLimits()
    server = OpenAIServer(engine, model_name, limits, max_prompt_chars, stream_write_timeout, parsers)
    app = FastAPI(title="nano-vllm", docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, limits=limits, api_key=api_key)  # inside the metrics middleware
    app.add_middleware(_HTTPMetricsMiddleware, counter=server.metrics.http_requests)
    app.add_middleware(InternalErrorGuard)  # a bug's 500, inside CORSGuard: it gets the CORS headers too
    app.add_middleware(CORSGuard, limits=limits)  # outermost: preflights go uncounted, refusals get its headers
    document_responses(app, model_name)  # the OpenAPI schema declares the real responses

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        if param is None and "json" not in request.headers.get("content-type", ""):
            message = "the request body must be a JSON object sent with 'Content-Type: application/json'"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "service_unavailable", code="server_overloaded"), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "service_unavailable", code="engine_unavailable"), status_code=503)

    # The API key is checked by RequestGuard, before the body is read.
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", server.model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize_endpoint, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize_endpoint, methods=["POST"])
    return app
