"""W4 serving load generator: N concurrent streaming clients against a local nano-vllm server.

Each client sends streaming `/v1/completions` requests one after another until the request
count or the time limit is reached. Prompts are random token-id lists (so the load does not
depend on the tokenizer), generation uses `ignore_eos` so every request produces exactly
`output_len` tokens, and `stream_options.include_usage` gives the server's token counts.

Measured as `vllm bench serve` does: no logprobs, output tok/s = completion tokens (from
`usage`) / wall time, TTFT = first chunk's arrival, ITL = the gap before each later chunk (a
chunk can carry several tokens: one ending mid-character waits for the next, and a client that
falls behind gets the merged newest text), TPOT = (last chunk - first chunk) / (tokens - 1);
p50 and p99. With --token-counts the requests ask for `logprobs: 0`, so every chunk lists its
tokens and a chunk of k tokens after a gap g counts as k gaps of g / k. Also reported: failures
(HTTP errors, broken streams, wrong token counts) with a sample message, and, from /metrics
after the run, whether the KV block pool is entirely free again and, over the run, the
engine's steps and the fractions of the wall time it spent inside them (`engine_busy`) and,
within them, waiting for the device's tokens (`engine_device_wait`); busy near 1 with little
waiting means the engine's host work sets the pace (a nano-vllm server's nanovllm_engine_*
counters). The CPU time of the load generator itself (`client_cpu`, its busiest process) and
of the server's front-end process (`frontend_cpu`, from its process_cpu_seconds_total where it
exports one) are given as fractions of the wall time too: near 1, that process is what the run
measures. So that it is not the load generator, its clients are spread over processes
(`--client-processes`; by default one per 16 clients, as far as the machine's cores allow), each
with its share of the clients and of the requests, all started together.

With --json-schema FILE every request carries `response_format` json_schema with that schema:
a request may then end early where its document is complete (finish_reason "stop"; it must
parse as JSON), and otherwise runs to `output_len`.

Bounded on purpose: a request count, a wall-clock limit, a per-request timeout, and the target
must be this machine (127.0.0.1 / localhost), so the tool cannot be pointed at someone else.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Sequence
from urllib.parse import urlparse

if TYPE_CHECKING:
    import httpx

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of /v1/models
    num_clients: int = 16
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    time_limit_s: float = 300.0
    request_timeout_s: float = 120.0
    api_key: str | None = None
    token_id_low: int = 16  # prompt ids are drawn from [low, high): every tokenizer has these
    token_id_high: int = 256
    seed: int = 0
    count_tokens: bool = False  # ask for logprobs=0 so chunks carry their token count (per-token ITL)
    json_schema: dict | None = None  # every request constrained to this JSON schema (response_format)
    # Processes the clients are spread over (each its own event loop and share of the clients
    # and requests): one Python process parses some 10-20k stream chunks a second at most.
    client_processes: int = 1

    def validate(self) -> None:
        host = urlparse(self.url).hostname
        if host not in LOCAL_HOSTS:
            raise ValueError(f"the serving benchmark only targets this machine (127.0.0.1), not {host!r}")
        for name in ("num_clients", "num_requests", "input_len", "output_len", "client_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.client_processes > self.num_clients:
            raise ValueError(f"client_processes ({self.client_processes}) must be at most num_clients ({self.num_clients})")
        if self.time_limit_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("time limits must be positive")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ValueError("need 0 <= token_id_low < token_id_high")


@dataclass
class _RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tpot: float | None = None
    output_tokens: int = 0
    chunks: int = 0  # stream chunks that carried output


@dataclass
class ServeBenchResult:
    config: ServeBenchConfig
    duration_s: float
    num_ok: int
    num_failed: int
    output_tokens: int
    output_chunks: int  # stream chunks that carried output, over the completed requests
    ttft: list[float]
    itl: list[float]
    tpot: list[float]
    errors: list[str]
    pool_free_after: bool | None  # None: /metrics unreadable
    # Over the run, from the server's nanovllm_engine_* counters (None where it has none).
    engine_steps: int | None = None
    engine_step_seconds: float | None = None
    engine_device_wait_seconds: float | None = None
    engine_prompt_steps: int | None = None  # of engine_steps, those that computed prompt tokens
    engine_prompt_step_seconds: float | None = None
    # CPU seconds over the run: the busiest load-generator process's, and the server front-end's
    # (None where unknown).
    client_cpu_seconds: float | None = None
    frontend_cpu_seconds: float | None = None

    @property
    def requests_per_s(self) -> float:
        return self.num_ok / self.duration_s if self.duration_s else 0.0

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]

        ms = lambda x: None if x is None else round(x * 1000, 2)  # noqa: E731
        return {
            "clients": self.config.num_clients,
            "requests_ok": self.num_ok,
            "requests_failed": self.num_failed,
            "duration_s": round(self.duration_s, 3),
            "requests_per_s": round(self.requests_per_s, 3),
            "output_tok_per_s": round(self.output_tok_per_s, 1),
            "output_tokens_per_request": round(self.output_tokens / self.num_ok, 1) if self.num_ok else None,
            # How many tokens a streamed chunk carries: above 1 where the server merges the tokens
            # that arrived while it was busy with other streams.
            "tokens_per_chunk": round(self.output_tokens / self.output_chunks, 2) if self.output_chunks else None,
            "json_schema": self.config.json_schema is not None,
            "ttft_ms_p50": ms(pct(self.ttft, 50)), "ttft_ms_p99": ms(pct(self.ttft, 99)),
            "itl_ms_p50": ms(pct(self.itl, 50)), "itl_ms_p99": ms(pct(self.itl, 99)),
            "tpot_ms_p50": ms(pct(self.tpot, 50)), "tpot_ms_p99": ms(pct(self.tpot, 99)),
            "kv_pool_free_after": self.pool_free_after,
            "engine_steps": self.engine_steps,
            # Output tokens per engine step: about the requests in flight in each decode step (a lone
            # stream's decode burst counts its several tokens); below the client count where
            # requests wait between one ending and the next arriving.
            "tokens_per_engine_step": (round(self.output_tokens / self.engine_steps, 1)
                                       if self.engine_steps else None),
            "engine_busy": self._share_of_run(self.engine_step_seconds),
            # Steps with a prompt chunk of 2+ tokens (beside decodes or not), and the share of the run
            # spent in them: such a step runs the model outside the decode's CUDA graphs.
            "engine_prompt_steps": self.engine_prompt_steps,
            "engine_prompt_busy": self._share_of_run(self.engine_prompt_step_seconds),
            "engine_device_wait": self._share_of_run(self.engine_device_wait_seconds),
            "client_cpu": self._share_of_run(self.client_cpu_seconds),
            "frontend_cpu": self._share_of_run(self.frontend_cpu_seconds),
            "first_error": self.errors[0] if self.errors else None,
        }

    def _share_of_run(self, seconds: float | None) -> float | None:
        """seconds as a fraction of the run's wall time."""
        return round(seconds / self.duration_s, 3) if seconds is not None and self.duration_s else None

    def format(self) -> str:
        s = self.summary()
        lines = [f"{k:>20}: {v}" for k, v in s.items() if k != "first_error" or v is not None]
        return "\n".join(lines)


def _headers(cfg: ServeBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream, split where the SSE format ends a line (LF, CRLF), not
    where str.splitlines would (httpx's aiter_lines also breaks at U+2028, U+0085, ..., which
    JSON may carry unescaped inside a string)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode()
    if buffer:
        yield buffer.removesuffix(b"\r").decode()


async def _one_request(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str, prompt: list[int]) -> _RequestResult:
    import httpx

    body = {
        "model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.count_tokens:
        body["logprobs"] = 0  # each chunk then lists its tokens, even those with no text yet
    if cfg.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": cfg.json_schema}}
    text, finish_reason = [], None
    start = time.perf_counter()
    chunks: list[tuple[float, int]] = []  # (arrival time, tokens; 1 if unknown) per chunk with output
    usage = None
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=_headers(cfg)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return _RequestResult(False, f"HTTP {resp.status_code}: {text[:200]}")
            async for line in sse_lines(resp.aiter_bytes()):
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    return _RequestResult(False, f"stream error: {payload['error'].get('message')}")
                now = time.perf_counter()
                if payload.get("usage"):
                    usage = payload["usage"]
                choices = payload.get("choices")
                for choice in choices or ():
                    text.append(choice.get("text") or "")
                    finish_reason = choice.get("finish_reason") or finish_reason
                if choices and not cfg.count_tokens:
                    chunks.append((now, 1))  # as vllm bench serve: every chunk with a choice
                for choice in choices if cfg.count_tokens else ():
                    tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
                    if tokens:
                        chunks.append((now, tokens))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _RequestResult(False, f"{type(exc).__name__}: {exc}")
    if not done or usage is None:
        return _RequestResult(False, "stream ended without usage and [DONE]")
    tokens = usage.get("completion_tokens", 0)
    if cfg.json_schema is not None and finish_reason == "stop":  # the document ended: it must parse
        try:
            json.loads("".join(text))
        except ValueError:
            return _RequestResult(False, f"a constrained output is not JSON: {''.join(text)[:200]!r}")
    elif tokens != cfg.output_len:
        return _RequestResult(False, f"got {tokens} tokens, expected {cfg.output_len}")
    result = _RequestResult(True, output_tokens=tokens, chunks=len(chunks))
    if chunks:
        first, last = chunks[0][0], chunks[-1][0]
        result.ttft = first - start
        if tokens > 1:
            result.tpot = (last - first) / (tokens - 1)
        for (t0, _), (t1, k) in zip(chunks, chunks[1:]):  # a chunk of k tokens: k gaps of (t1 - t0) / k
            result.itls.extend([(t1 - t0) / k] * k)
    return result


async def _metric_values(client: httpx.AsyncClient) -> dict[str, float] | None:
    """Every sample of the server's /metrics by name (None where it cannot be read)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get("/metrics")
        return {s.name: s.value for f in text_string_to_metric_families(resp.text) for s in f.samples}
    except (httpx.HTTPError, ValueError):
        return None


ENGINE_COUNTERS = ("nanovllm_engine_steps_total", "nanovllm_engine_step_seconds_total",
                   "nanovllm_engine_device_wait_seconds_total", "nanovllm_engine_prompt_steps_total",
                   "nanovllm_engine_prompt_step_seconds_total")
FRONTEND_CPU = "process_cpu_seconds_total"


async def _server_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's ENGINE_COUNTERS and FRONTEND_CPU now, those it exports."""
    values = await _metric_values(client) or {}
    return {k: values[k] for k in (*ENGINE_COUNTERS, FRONTEND_CPU) if k in values}


async def _pool_free(client: httpx.AsyncClient, wait_s: float = 5.0) -> bool | None:
    """True once /metrics shows no running/waiting request and every KV block free."""
    deadline = time.monotonic() + wait_s
    while True:
        values = await _metric_values(client)
        if values is None:
            return None
        needed = ("nanovllm_kv_cache_blocks_free", "nanovllm_kv_cache_blocks_total", "vllm:num_requests_running",
                  "vllm:num_requests_waiting")
        if not all(k in values for k in needed):
            return None
        free = (values["nanovllm_kv_cache_blocks_free"] == values["nanovllm_kv_cache_blocks_total"]
                and values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0)
        if free or time.monotonic() > deadline:
            return free
        await asyncio.sleep(0.1)


def _http_client(cfg: ServeBenchConfig) -> httpx.AsyncClient:
    import httpx

    limits = httpx.Limits(max_connections=cfg.num_clients + 2, max_keepalive_connections=cfg.num_clients + 2)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    return httpx.AsyncClient(base_url=cfg.url.rstrip("/"), limits=limits, timeout=timeout)


async def _served_model(client: httpx.AsyncClient, cfg: ServeBenchConfig) -> str:
    """The model the server serves (/v1/models); ValueError saying why it could not be read."""
    import httpx

    try:
        resp = await client.get("/v1/models", headers=_headers(cfg))
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach the server at {cfg.url}: {exc or type(exc).__name__}") from None
    if resp.status_code in (401, 403):
        raise ValueError(f"the server at {cfg.url} refused the API key ({resp.status_code}): pass --api-key")
    try:
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {cfg.url.rstrip('/')}/v1/models gave no model (status {resp.status_code}); "
                         "pass --model") from None


async def _run_clients(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str,
                       prompts: list[list[int]]) -> list[_RequestResult]:
    """cfg.num_clients clients sending these prompts, each prompt once, until they are all sent
    or cfg.time_limit_s has passed."""
    results: list[_RequestResult] = []
    next_prompt = iter(prompts)
    deadline = time.perf_counter() + cfg.time_limit_s

    async def client_loop() -> None:
        for prompt in next_prompt:  # shared iterator: each prompt is sent once
            if time.perf_counter() > deadline:
                return
            results.append(await _one_request(client, cfg, model, prompt))

    tasks = [asyncio.create_task(client_loop()) for _ in range(cfg.num_clients)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=cfg.time_limit_s + cfg.request_timeout_s)
    except asyncio.TimeoutError:
        pass
    return results


def _client_process(cfg: ServeBenchConfig, model: str, prompts: list[list[int]], ready, start, results) -> None:
    """A load-generator process: its share of the clients, started with the others (`ready`,
    then `start`, multiprocessing events); puts (its results, its CPU seconds) on `results`."""
    async def run() -> tuple[list[_RequestResult], float]:
        async with _http_client(cfg) as client:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, start.wait)
            cpu = time.process_time()
            out = await _run_clients(client, cfg, model, prompts)
            return out, time.process_time() - cpu

    results.put(asyncio.run(run()))


async def _run_client_processes(cfg: ServeBenchConfig, model: str,
                                prompts: list[list[int]]) -> tuple[list[_RequestResult], float]:
    """The clients spread over cfg.client_processes processes, started together; returns every
    request's result and the CPU seconds of the busiest process."""
    import multiprocessing
    from dataclasses import replace

    ctx = multiprocessing.get_context("spawn")
    n = cfg.client_processes
    start, results = ctx.Event(), ctx.Queue()
    readies, procs = [], []
    for k in range(n):
        share = replace(cfg, num_clients=cfg.num_clients // n + (k < cfg.num_clients % n))
        readies.append(ctx.Event())
        procs.append(ctx.Process(target=_client_process, args=(share, model, prompts[k::n], readies[-1], start, results),
                                 daemon=True))
        procs[-1].start()
    loop = asyncio.get_running_loop()
    try:
        for ready in readies:
            if not await loop.run_in_executor(None, ready.wait, 120.0):
                raise RuntimeError("a load-generator process did not start within 120 s")
        start.set()
        gathered, cpu = [], 0.0
        for _ in procs:
            try:
                out, seconds = await loop.run_in_executor(None, results.get, True,
                                                          cfg.time_limit_s + cfg.request_timeout_s + 30)
            except queue.Empty:
                raise RuntimeError("a load-generator process ended without its results") from None
            gathered += out
            cpu = max(cpu, seconds)
        return gathered, cpu
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


async def run_serve_bench(cfg: ServeBenchConfig) -> ServeBenchResult:
    cfg.validate()
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(cfg.token_id_low, cfg.token_id_high) for _ in range(cfg.input_len)]
               for _ in range(cfg.num_requests)]
    async with _http_client(cfg) as client:
        model = cfg.model or await _served_model(client, cfg)
        before = await _server_counters(client)
        start, cpu_start = time.perf_counter(), time.process_time()
        if cfg.client_processes == 1:
            results = await _run_clients(client, cfg, model, prompts)
            client_cpu = time.process_time() - cpu_start
        else:
            results, client_cpu = await _run_client_processes(cfg, model, prompts)
        duration = time.perf_counter() - start
        after = await _server_counters(client)  # before _pool_free's scrapes, which are not the run's
        pool_free = await _pool_free(client)
    delta = {k: after[k] - before[k] for k in before.keys() & after.keys()}
    steps, step_seconds, wait_seconds, prompt_steps, prompt_seconds = (delta.get(k) for k in ENGINE_COUNTERS)
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    return ServeBenchResult(
        config=cfg,
        duration_s=duration,
        num_ok=len(ok),
        num_failed=len(failed) + (cfg.num_requests - len(results)),
        output_tokens=sum(r.output_tokens for r in ok),
        output_chunks=sum(r.chunks for r in ok),
        ttft=[r.ttft for r in ok if r.ttft is not None],
        itl=[x for r in ok for x in r.itls],
        tpot=[r.tpot for r in ok if r.tpot is not None],
        errors=[r.error for r in failed if r.error] + (["not sent: time limit"] if len(results) < cfg.num_requests else []),
        pool_free_after=pool_free,
        engine_steps=None if steps is None else int(steps),
        engine_step_seconds=step_seconds,
        engine_device_wait_seconds=wait_seconds,
        engine_prompt_steps=None if prompt_steps is None else int(prompt_steps),
        engine_prompt_step_seconds=prompt_seconds,
        client_cpu_seconds=client_cpu,
        frontend_cpu_seconds=delta.get(FRONTEND_CPU),
    )


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving load (W4)")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (this machine only)")
    g.add_argument("--served-model", default=None, help="model name to request (default: the server's first model)")
    g.add_argument("--num-clients", type=int, default=16, help="concurrent streaming clients")
    g.add_argument("--num-requests", type=int, default=None, help="total requests (default: 4 per client)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    g.add_argument("--time-limit", type=float, default=300.0, help="stop sending new requests after this many seconds")
    g.add_argument("--api-key", default=None)
    g.add_argument("--prompt-seed", type=int, default=0,
                   help="seed of the random prompts (a warm-up with another seed leaves the run's prompts uncached)")
    g.add_argument("--token-counts", dest="count_tokens", action="store_true",
                   help="ask for logprobs=0 so ITL is per token (default: per chunk, as vllm bench serve)")
    g.add_argument("--json-schema", dest="json_schema_file", default=None, metavar="FILE",
                   help="constrain every request to the JSON schema in FILE (response_format json_schema)")
    g.add_argument("--client-processes", type=int, default=None,
                   help="processes the clients are spread over (default: one per 16 clients, at most half "
                        "this machine's cores)")
    g.add_argument("--json", action="store_true", help="print the summary as JSON")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        url=args.url, model=args.served_model, num_clients=args.num_clients,
        num_requests=args.num_requests if args.num_requests is not None else 4 * args.num_clients,
        input_len=args.input_len, output_len=args.output_len, time_limit_s=args.time_limit, api_key=args.api_key,
        count_tokens=args.count_tokens, seed=args.prompt_seed,
        json_schema=_read_schema(args.json_schema_file) if args.json_schema_file else None,
        client_processes=(args.client_processes if args.client_processes is not None
                          else default_client_processes(args.num_clients)),
    )


def default_client_processes(num_clients: int) -> int:
    """One load-generator process per 16 clients, at most half this machine's cores."""
    return max(1, min(-(-num_clients // 16), (os.cpu_count() or 2) // 2))


def _read_schema(path: str) -> dict:
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: not a JSON schema object")
    return schema


def run_from_args(args: argparse.Namespace) -> int:
    result = asyncio.run(run_serve_bench(config_from_args(args)))
    print(json.dumps(result.summary()) if args.json else result.format())
    return 0 if result.num_failed == 0 and result.pool_free_after is not False else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except ValueError as exc:
        print(f"serve_bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
