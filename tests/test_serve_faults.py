"""The engine core / front-end split under faults and bad input (CPU, tiny checkpoints).

`nanovllm serve` runs as a process where a test kills parts of it: the core killed -9 under load,
SIGTERM with two front-ends (CORS flags on each, metrics summed across them, admission control,
no orphans). The core alone (a CoreProcess) checks that a dead front-end's requests are aborted.
The in-process `live` server of test_server.py covers stop strings freeing blocks, the prompt
character limit, a client that never reads, and 256 concurrent streams with random disconnects.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm import SamplingParams
from nanovllm.engine.core import CoreProcess
from nanovllm.engine.core_client import CoreClient
from nanovllm.entrypoints.server import create_app
from test_server import KEY, MODEL, assert_error_body, live, offline, offline_streamed, serve_in_thread, wait_until  # noqa: F401


# ---- helpers ---------------------------------------------------------------------------------
def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def gone(pids: set[int]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


class Serve:
    """`nanovllm serve` as a process; reads its log for the URL, the core's pid and socket dir."""

    def __init__(self, checkpoint, *args: str, frontends: int = 1, new_session: bool = False) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanovllm", "serve", str(checkpoint), "--port", "0", "--device", "cpu",
             "--served-model-name", MODEL, *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, start_new_session=new_session)
        self.log: list[str] = []
        self.pids: set[int] = set()
        ports = set()
        self.core_pid = self.sock_dir = None
        started = 0
        try:
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"engine core: pid (\d+), sockets in (\S+)", line)
                if m:
                    self.core_pid, self.sock_dir = int(m.group(1)), m.group(2)
                m = re.search(r"(?:Uvicorn running on|serving) (http://127\.0\.0\.1:\d+)", line)
                if m:
                    ports.add(m.group(1))
                started += "Application startup complete" in line
                if ports and started >= frontends:
                    break
            assert len(ports) == 1 and self.core_pid, "the server did not start:\n" + "".join(self.log[-30:])
        except BaseException:
            self.pids = descendants(self.proc.pid)
            self.close()
            raise
        self.url = ports.pop()
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
        time.sleep(0.2)
        self.pids = descendants(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in descendants(self.proc.pid) | self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def metric_values(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def stream_request(url: str, body: dict, first_chunk: threading.Event, result: dict) -> None:
    """Stream a completion; record how it ended (status, error event, [DONE]) and when."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
            result["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
                    if '"error"' in line:
                        result["error_event"] = True
                    if '"finish_reason":"abort"' in line.replace(" ", ""):
                        result["aborted"] = True
                    if line == "data: [DONE]":
                        result["done"] = True
    except httpx.HTTPError as exc:
        result["exception"] = repr(exc)
    finally:
        first_chunk.set()
        result["end"] = time.monotonic()


def start_streams(url: str, body: dict, n: int) -> list[tuple[threading.Thread, threading.Event, dict]]:
    """n streaming requests on threads, returned once each has its first chunk."""
    streams = []
    for _ in range(n):
        first, result = threading.Event(), {}
        t = threading.Thread(target=stream_request, args=(url, body, first, result), daemon=True)
        t.start()
        streams.append((t, first, result))
    for _, first, _ in streams:
        assert first.wait(30)
    return streams


# ---- the core dies -------------------------------------------------------------------------
def test_core_killed_under_load_fails_every_request_within_2s(qwen3_tiny):
    serve = Serve(qwen3_tiny, "--max-model-len", "1024", "--num-kvcache-blocks", "512")
    try:
        body = {"model": MODEL, "prompt": "load", "max_tokens": 1000, "ignore_eos": True}
        streams = start_streams(serve.url, body, 6)
        unstreamed: dict = {}

        def post() -> None:
            try:
                unstreamed["status"] = httpx.post(serve.url + "/v1/completions", json=body, timeout=30).status_code
            finally:
                unstreamed["end"] = time.monotonic()

        waiter = threading.Thread(target=post, daemon=True)
        waiter.start()
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(serve.core_pid, signal.SIGKILL)
        assert wait_until(lambda: httpx.get(serve.url + "/health").status_code == 503, timeout=2.0)
        for t, _, result in streams:
            t.join(5)
            assert result.get("status") == 200 and result.get("error_event") and result.get("done"), result
            assert result["end"] - killed < 2.0
        waiter.join(5)
        assert unstreamed["status"] == 503 and unstreamed["end"] - killed < 2.0
        assert serve.proc.wait(timeout=20) == 1  # the front-end exits non-zero once the core is gone
        assert wait_until(lambda: gone(serve.pids), timeout=5), "orphan processes"
        assert not os.path.exists(serve.sock_dir)
    finally:
        serve.close()


# ---- a front-end dies ------------------------------------------------------------------------
FRONTEND = """
import sys, time, zmq, msgspec
from nanovllm.engine.messages import AddRequest, Hello
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
enc = msgspec.msgpack.Encoder()
sock.send(enc.encode(Hello()))
for i in range(4):
    sock.send(enc.encode(AddRequest(f"doomed-{i}", [5, 6, 7, i + 8], {"max_tokens": 32000, "ignore_eos": True})))
print("sent", flush=True)
while True:
    sock.send(enc.encode(Hello()))
    time.sleep(0.2)
"""


def test_dead_frontend_requests_are_aborted_and_blocks_freed(checkpoint_factory):
    # 32,000 tokens each: far more than the tiny model decodes before the front-end's silence is noticed.
    long_context = checkpoint_factory("qwen3", max_position_embeddings=32768)
    core = CoreProcess(str(long_context), dict(device="cpu", max_model_len=32768, kvcache_block_size=16,
                                               num_kvcache_blocks=8100), max_pending=64, frontend_timeout=1.0)
    observer = CoreClient(core.addresses, core.info, core_alive=core.is_alive)
    front = subprocess.Popen([sys.executable, "-c", FRONTEND, core.addresses.input], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert front.stdout.readline().strip() == "sent"
        assert wait_until(lambda: observer.stats.num_requests_running == 4, timeout=20)
        front.kill()
        front.wait()
        s = lambda: observer.stats  # noqa: E731
        assert wait_until(lambda: s().num_free_blocks == s().num_blocks and s().num_requests_running == 0, timeout=10)
        assert observer.stats.num_aborted == 4  # aborted, not run to their 32000 tokens
    finally:
        front.kill()
        observer.shutdown()
        core.shutdown()


def test_frontend_that_stops_reading_for_a_while_loses_no_output(checkpoint_factory):
    """A live front-end (it keeps saying Hello) that reads nothing until its requests have
    finished: their thousands of outputs wait for it, none dropped, and add up to every token."""
    import msgspec
    import zmq

    from nanovllm.engine.messages import AddRequest, CoreOutput, Hello

    long_context = checkpoint_factory("qwen3", max_position_embeddings=32768)
    core = CoreProcess(str(long_context), dict(device="cpu", max_model_len=8192), max_pending=64)
    observer = CoreClient(core.addresses, core.info, core_alive=core.is_alive)
    ctx = zmq.Context()
    try:
        send, recv = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock, address in ((send, core.addresses.input), (recv, core.addresses.output)):
            sock.setsockopt(zmq.IDENTITY, b"slow-frontend")
            sock.setsockopt(zmq.LINGER, 0)
            if sock is recv:  # a stalled process reads nothing: its socket's queue holds one message
                sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(address)
        encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(CoreOutput).decode
        send.send(encode(Hello()))
        assert recv.poll(10_000)  # the core knows us: its first answer
        # Two requests decoding together: an output per step, twice the 1,000 that the core's
        # queue would hold at ZeroMQ's default high-water mark.
        tokens = 2000
        for i in range(2):
            send.send(encode(AddRequest(f"slow-{i}", [5, 6, 7, 8 + i], {"max_tokens": tokens, "ignore_eos": True})))

        def alive_until(done) -> bool:  # we keep saying Hello, or the core would count us dead
            def check() -> bool:
                send.send(encode(Hello()))
                return done()
            return wait_until(check, timeout=300)  # 8,000 CPU steps: a loaded machine takes minutes

        assert alive_until(lambda: observer.stats.num_requests_running == 2)
        assert alive_until(lambda: observer.stats.num_requests_running == 0)
        got, finished = {"slow-0": 0, "slow-1": 0}, set()
        while recv.poll(1000):
            for delta in decode(recv.recv()).deltas:
                got[delta.request_id] += len(delta.new_token_ids[0])
                if delta.finished:
                    finished.add(delta.request_id)
        assert got == {"slow-0": tokens, "slow-1": tokens} and finished == {"slow-0", "slow-1"}
    finally:
        ctx.destroy(linger=0)
        observer.shutdown()
        core.shutdown()


# ---- several front-ends, CORS, admission control, SIGTERM ---------------------------------------
def check_cors_on_every_frontend(url: str) -> None:
    """The CORS flags (--allowed-origins '["https://app.example"]', --allowed-methods '["GET",
    "POST"]') travel with the front-ends' configuration: whichever front-end a connection lands
    on (a new connection each) answers a browser's preflight by them."""
    for i in range(12):
        origin = "https://app.example" if i % 3 else "https://evil.example"
        r = httpx.options(url + "/v1/chat/completions", timeout=30,
                          headers={"origin": origin, "access-control-request-method": "POST",
                                   "access-control-request-headers": "content-type"})
        if origin == "https://app.example":
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, r.text
            assert r.headers["access-control-allow-methods"] == "GET, POST"
        else:
            assert assert_error_body(r, 400)["code"] == "cors_refused"
        r = httpx.get(url + "/v1/models", headers={"origin": origin}, timeout=30)
        assert r.status_code == 200
        assert r.headers.get("access-control-allow-origin") == (origin if i % 3 else None)


def test_two_frontends_share_the_port_cors_metrics_admission_and_sigterm(qwen3_tiny):
    serve = Serve(qwen3_tiny, "--api-server-count", "2", "--max-pending-requests", "3", "--max-model-len", "1024",
                  "--num-kvcache-blocks", "512", "--shutdown-timeout", "2", "--allowed-origins", '["https://app.example"]',
                  "--allowed-methods", '["GET", "POST"]', frontends=2)
    metrics_dirs = [line for line in serve.log if "front-ends on" in line]
    try:
        assert metrics_dirs, "".join(serve.log)
        check_cors_on_every_frontend(serve.url)
        for i in range(10):  # a new connection each: the kernel spreads them over both front-ends
            r = httpx.post(serve.url + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
        for _ in range(3):  # whichever front-end answers, it reports both front-ends' counts
            values = metric_values(serve.url)
            key = ("nanovllm_http_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))
            assert values[key] == 10

        # Admission: three long streams fill --max-pending-requests 3; the fourth gets a 503.
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 1000, "ignore_eos": True}
        streams = start_streams(serve.url, body, 3)
        r = httpx.post(serve.url + "/v1/completions", json=body, timeout=30)
        err = assert_error_body(r, 503)
        assert err["code"] == "server_overloaded" and r.headers["retry-after"] == "1"

        # SIGTERM: the streams are aborted after --shutdown-timeout and end cleanly; exit 0.
        serve.proc.send_signal(signal.SIGTERM)
        for t, _, result in streams:
            t.join(30)
            assert result.get("status") == 200 and result.get("done") and not result.get("error_event"), result
        assert serve.proc.wait(timeout=30) == 0
        assert wait_until(lambda: gone(serve.pids), timeout=5), "orphan processes"
        assert not os.path.exists(serve.sock_dir)
    finally:
        serve.close()


# ---- in-process server (test_server.py's `live`) -------------------------------------------------
def test_stop_string_frees_the_blocks_at_once(live, offline):
    prompt = "Paris is the capital of"
    full_params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    ref = offline_streamed(offline, [prompt], full_params)[0][0]
    stop = ref[4:8]  # met a few tokens in
    expected = ref[: ref.index(stop)]
    s = lambda: live.engine.stats  # noqa: E731
    pool_free = lambda: s().num_free_blocks == s().num_blocks and s().num_requests_running == 0  # noqa: E731
    kw = dict(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    t0 = time.monotonic()
    r = live.client.completions.create(max_tokens=300, **kw)  # calibration: the whole 300 tokens
    full_time = time.monotonic() - t0
    assert r.choices[0].finish_reason == "length" and wait_until(pool_free)

    r = live.client.completions.create(max_tokens=300, stop=[stop], **kw)
    answered = time.monotonic()
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert wait_until(pool_free)
    assert time.monotonic() - answered < full_time / 2, "the core kept generating after the stop string"


def test_prompt_longer_than_the_character_limit_is_refused_before_tokenizing(live):
    limit = live.engine.max_model_len * 16
    huge = "word " * (limit // 5 + 1)
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": huge, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "characters" in err["message"]
    err = assert_error_body(live.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": huge}]}), 400)
    assert err["param"] == "messages" and "characters" in err["message"]
    # within the character limit but too many tokens: refused after tokenizing
    err = assert_error_body(live.http.post("/v1/completions", json={"prompt": "word " * 600, "max_tokens": 1}), 400)
    assert "max_model_len" in err["message"]


def test_client_that_never_reads_is_dropped_after_the_write_timeout(live):
    """A stream whose client reads nothing: send() blocks (flow control); after the write
    timeout the connection is cut (no [DONE]; the request, if still running, is aborted), and
    the request is counted in the metrics at once."""
    app = create_app(live.engine, MODEL, api_key=KEY, stream_write_timeout=1.0)
    with serve_in_thread(app, sndbuf=4096) as url:  # small kernel buffers: the stream must block
        def counted() -> float:
            values = metric_values(url)
            return sum(v for (name, _), v in values.items() if name == "vllm:request_success_total")

        before = counted()
        gc.disable()  # counted when the stream is cut, not whenever the collector frees its body
        try:
            port = int(url.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect(("127.0.0.1", port))
            body = ('{"prompt": "never read", "max_tokens": 360, "ignore_eos": true, "stream": true, "logprobs": 20}')
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            s = lambda: live.engine.stats  # noqa: E731
            assert wait_until(lambda: s().num_requests_running == 1, timeout=30)
            assert wait_until(lambda: s().num_free_blocks == s().num_blocks and s().num_requests_running == 0, timeout=30)
            time.sleep(2.0)  # longer than the write timeout
            sock.settimeout(10)
            data = b""
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            sock.close()
            assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data
            assert b"[DONE]" not in data  # cut off, not finished
            assert wait_until(lambda: counted() == before + 1, timeout=5)
        finally:
            gc.enable()


def test_256_streams_with_random_disconnects(live, offline):
    prompts = ["The sky is", "One two three", "Hello", "A long time ago"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = [texts[0] for texts in offline_streamed(offline, prompts, params)]
    rng = random.Random(0)
    plan = [(i % len(prompts), rng.random() < 0.2) for i in range(256)]

    async def one(client: httpx.AsyncClient, p: int, disconnect: bool):
        body = {"model": MODEL, "prompt": prompts[p], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage = "", None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code, None, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if disconnect:
                    return 200, None, None  # leave after the first chunk: the response is closed
                payload = __import__("json").loads(line[6:])
                assert "error" not in payload, payload
                if payload.get("usage"):
                    usage = payload["usage"]
                text += "".join(c["text"] for c in payload["choices"])
        return 200, text, usage

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=live.url, limits=limits, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            return await asyncio.gather(*(one(client, p, d) for p, d in plan))

    results = asyncio.run(run())
    assert all(status == 200 for status, _, _ in results)
    for (p, disconnect), (_, text, usage) in zip(plan, results):
        if not disconnect:
            assert text == refs[p] and usage["completion_tokens"] == 8
    s = lambda: live.engine.stats  # noqa: E731
    assert wait_until(lambda: s().num_free_blocks == s().num_blocks and s().num_requests_running == 0
                      and s().num_requests_waiting == 0, timeout=20)


class _SlowEngine:
    """The engine-core's view of an engine with one request, whose steps take `step_s`; its
    third step fails (the core then tells its front-ends and its loop returns)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.steps = step_s, 0

    def has_unfinished_requests(self) -> bool:
        return True

    num_unfinished_requests = 1

    step_ended = None

    def step(self) -> list:
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("stub engine stops")
        time.sleep(self.step_s)
        self.step_ended = time.monotonic()
        return []

    def load_snapshot(self) -> dict:
        return {"num_steps": self.steps}

    def shutdown(self) -> None:
        pass


def test_core_sends_heartbeats_during_a_step_longer_than_the_heartbeat(tmp_path):
    """A front-end hears from the core every HEARTBEAT_S even while one step runs for longer (it
    takes a core silent for HEARTBEAT_TIMEOUT_S for dead), and gets the loop's own replies: the
    answer to its stats request and, when a step fails, the error."""
    import msgspec
    import zmq

    from nanovllm.engine.core import HEARTBEAT_S, CoreAddresses, EngineCore
    from nanovllm.engine.messages import CoreOutput, Hello

    step_s = 4 * HEARTBEAT_S
    core = EngineCore(_SlowEngine(step_s), CoreAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"), max_pending=8)
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (to_core, from_core):
        sock.setsockopt(zmq.IDENTITY, b"frontend-1")
        sock.setsockopt(zmq.LINGER, 0)
    to_core.connect(f"ipc://{tmp_path}/in")
    from_core.connect(f"ipc://{tmp_path}/out")
    status = []
    loop = threading.Thread(target=lambda: status.append(core.run()), daemon=True)
    to_core.send(msgspec.msgpack.encode(Hello(stats_request=7)))
    time.sleep(0.2)
    loop.start()
    decoder = msgspec.msgpack.Decoder(CoreOutput)
    arrivals = []
    deadline = time.monotonic() + 2 * step_s + 3
    next_hello = 0.0
    while time.monotonic() < deadline and not any(out.error for _, out in arrivals):
        if time.monotonic() >= next_hello:  # as a front-end does: the core drops a silent one
            to_core.send(msgspec.msgpack.encode(Hello()))
            next_hello = time.monotonic() + HEARTBEAT_S
        if from_core.poll(100):
            arrivals.append((time.monotonic(), decoder.decode(from_core.recv())))
    loop.join(10)
    to_core.close()
    from_core.close()
    ctx.term()
    assert status == [1] and not loop.is_alive()
    outs = [out for _, out in arrivals]
    assert any(out.stats_answer == 7 for out in outs)  # the loop's reply
    assert any(out.error is not None and "stub engine stops" in out.error for out in outs)
    times = [t for t, out in arrivals if out.error is None]
    assert len(times) >= 4, f"{len(times)} messages in two steps of {step_s:.1f} s"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 3 * HEARTBEAT_S, gaps  # steps take 4 x HEARTBEAT_S


def test_frontend_sends_do_not_block_while_the_core_runs_a_long_step(tmp_path):
    """The core reads front-end messages only between steps: while one step runs, a front-end's
    sends (here 5,000 aborts) queue instead of blocking it, and the core handles them after."""
    from nanovllm.engine.core import CoreAddresses, CoreInfo, EngineCore

    class Engine(_SlowEngine):
        busy = False

        def has_unfinished_requests(self) -> bool:
            return self.busy and self.steps < 1

        def abort_request(self, request_id, index=None):
            raise AssertionError("an abort of a request the front-end does not own reaches the engine")

    engine = Engine(3.0)
    addresses = CoreAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    core = EngineCore(engine, addresses, max_pending=8)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    client = CoreClient(addresses, CoreInfo(str(tmp_path), 64, 100, None, 10))
    try:
        engine.busy = True
        assert wait_until(lambda: engine.steps == 1, timeout=5)  # the core is inside its step
        for i in range(5000):
            client.abort(f"not-mine-{i}")
        sent = time.monotonic()
        assert wait_until(lambda: engine.step_ended is not None, timeout=10)
        assert sent < engine.step_ended  # every send returned while the step still ran
        assert client.error is None
    finally:
        client.close()


@contextlib.contextmanager
def core_on_a_thread(tmp_path, engine, identity: bytes, frontend_timeout: float):
    """An EngineCore over `engine` with its loop on a thread, and one front-end's raw sockets
    (to the core, from the core) under `identity`; the loop ends with the block."""
    import zmq

    from nanovllm.engine.core import CoreAddresses, EngineCore

    addresses = CoreAddresses(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    core = EngineCore(engine, addresses, max_pending=8, frontend_timeout=frontend_timeout)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (to_core, from_core):
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
    to_core.connect(addresses.input)
    from_core.connect(addresses.output)
    try:
        yield core, to_core, from_core
    finally:
        to_core.close()
        from_core.close()
        ctx.term()

        def stop() -> bool:
            raise RuntimeError("the test is over")

        engine.has_unfinished_requests = stop  # the core's loop ends on an engine error
        loop.join(10)


def cpu_engine(qwen3_tiny):
    from nanovllm.config import EngineConfig
    from nanovllm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(str(qwen3_tiny), device="cpu", max_model_len=1024), detokenize=False)


def test_frontend_taken_for_dead_that_speaks_again_gets_its_streams_ended(tmp_path, qwen3_tiny):
    """A front-end silent past the timeout (stalled, not dead) has its requests aborted; when it
    speaks again it is told so (each request ends with "abort"), so its streams do not hang."""
    import msgspec

    from nanovllm.engine.messages import AddRequest, CoreOutput, Hello, params_to_wire

    engine = cpu_engine(qwen3_tiny)
    decoder = msgspec.msgpack.Decoder(CoreOutput)
    with core_on_a_thread(tmp_path, engine, b"stalled-frontend", frontend_timeout=1.0) as (core, to_core, from_core):
        params = params_to_wire(SamplingParams(max_tokens=8000, ignore_eos=True))
        for rid in ("a", "b"):
            to_core.send(msgspec.msgpack.encode(AddRequest(rid, [5, 6, 7, 8], params)))
        assert wait_until(lambda: core.num_aborted == 2, timeout=20)  # silent for over a second: taken for dead
        to_core.send(msgspec.msgpack.encode(Hello()))
        ended = {}
        deadline = time.monotonic() + 10
        while len(ended) < 2 and time.monotonic() < deadline:
            if from_core.poll(100):
                for delta in decoder.decode(from_core.recv()).deltas:
                    if delta.finished:
                        ended[delta.request_id] = delta.finish_reasons
        assert ended == {"a": ["abort"], "b": ["abort"]}
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_slow_request_to_handle_does_not_make_its_frontend_silent(tmp_path, qwen3_tiny):
    """While the core's loop handles one slow request (here an add that takes 2.5 s, as a grammar
    of a costly schema can), the front-ends' heartbeats wait unread: that is no silence, and
    no request is aborted (the timeout here is 1 s)."""
    import msgspec

    from nanovllm.engine.messages import AddRequest, CoreOutput, Hello, params_to_wire

    engine = cpu_engine(qwen3_tiny)
    add = engine.add_request

    def slow_add(request_id, *args, **kwargs):
        if request_id == "slow":
            time.sleep(2.5)
        return add(request_id, *args, **kwargs)

    engine.add_request = slow_add
    decoder = msgspec.msgpack.Decoder(CoreOutput)
    with core_on_a_thread(tmp_path, engine, b"frontend-1", frontend_timeout=1.0) as (core, to_core, from_core):
        params = params_to_wire(SamplingParams(max_tokens=40, ignore_eos=True))
        to_core.send(msgspec.msgpack.encode(AddRequest("running", [5, 6, 7, 8], params)))
        time.sleep(0.3)
        to_core.send(msgspec.msgpack.encode(AddRequest("slow", [5, 6, 7, 8], params)))
        ended = {}
        deadline = time.monotonic() + 20
        next_hello = time.monotonic() + 0.3  # the core reads the slow add alone, then the heartbeats wait
        while len(ended) < 2 and time.monotonic() < deadline:
            if time.monotonic() >= next_hello:  # a front-end's heartbeat
                to_core.send(msgspec.msgpack.encode(Hello()))
                next_hello = time.monotonic() + 0.25
            if from_core.poll(50):
                for delta in decoder.decode(from_core.recv()).deltas:
                    if delta.finished:
                        ended[delta.request_id] = delta.finish_reasons
        assert ended == {"running": ["length"], "slow": ["length"]}
        assert core.num_aborted == 0


@pytest.mark.parametrize("frontends", [1, 2])
def test_sigterm_to_the_servers_process_group_drains_like_sigterm_to_the_server(qwen3_tiny, frontends):
    """A shell or a service manager stops a server by signalling its whole process group: the
    engine core must not stop with it before the server has drained, so in-flight streams run to
    their end within --shutdown-timeout and the server exits 0."""
    serve = Serve(qwen3_tiny, "--shutdown-timeout", "30", "--api-server-count", str(frontends), frontends=frontends,
                  new_session=True)
    try:
        body = {"model": MODEL, "prompt": "load", "max_tokens": 300, "ignore_eos": True}
        streams = start_streams(serve.url, body, 4)
        os.killpg(serve.proc.pid, signal.SIGTERM)
        for thread, _, result in streams:
            thread.join(60)
            assert result.get("status") == 200 and result.get("done"), result
            assert not result.get("aborted") and not result.get("error_event"), result
        assert serve.proc.wait(timeout=30) == 0
        assert wait_until(lambda: gone(serve.pids), timeout=5), "orphan processes"
    finally:
        serve.close()
