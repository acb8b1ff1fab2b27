"""Normal clients beside abusive ones: does abuse hurt the normal clients?

Measures, against `nanovllm serve` (started here on the embedded model, CPU, unless --url is
given), the time to first token (TTFT) of normal streaming clients, first alone (unloaded),
then while these run beside them (loaded):

- an idle-connection flood: --idle-connections TCP connections that never send a byte,
  re-opened --idle-reconnect-delay seconds after the server closes them (header timeout,
  eviction at the connection cap);
- stalled clients: they send part of a request's headers, or the headers and part of a body,
  and stop;
- slow readers: streaming requests read one chunk every --slow-read-interval seconds;
- disconnecting clients: streaming requests dropped after the first chunk.

Reports normal clients' TTFT p50/p99 in both phases, their lost requests (an error or a stream
without its end), and the server's RSS (sampled from /proc; only when this script started the
server). The targets: loaded p99 TTFT within 2x of unloaded, 0 lost, RSS bounded.

    python benchmarks/abuse_load.py --duration 30
    python benchmarks/abuse_load.py --url http://127.0.0.1:8000 --duration 30

`run_load` is also what tests/test_load.py runs for a few seconds against the tiny checkpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx


@dataclass
class Load:
    duration: float = 20.0
    normal_clients: int = 4
    max_tokens: int = 16
    idle_connections: int = 300
    idle_reconnect_delay: float = 1.0  # seconds before a closed idle connection is opened again
    stalled_clients: int = 20
    slow_readers: int = 4
    slow_read_interval: float = 1.0
    disconnecting_clients: int = 4


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    completed: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)
    abuse: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        t = sorted(self.ttft_s)
        p = (lambda q: t[min(len(t) - 1, int(q * len(t)))] if t else None)
        return {"requests": self.completed, "lost": self.lost, "ttft_p50_s": p(0.5), "ttft_p99_s": p(0.99),
                "ttft_mean_s": statistics.fmean(t) if t else None, "errors": self.errors[:5], "abuse": self.abuse}


def _count(phase: Phase, key: str) -> None:
    phase.abuse[key] = phase.abuse.get(key, 0) + 1


async def _normal_client(url: str, headers: dict, load: Load, stop: float, phase: Phase, i: int) -> None:
    body = {"prompt": f"Client {i} says: the quick brown fox", "max_tokens": load.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        while time.monotonic() < stop:
            start = time.monotonic()
            first = None
            done = False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and first is None and line != "data: [DONE]":
                            first = time.monotonic() - start
                        if line == "data: [DONE]":
                            done = True
                if not done or first is None:
                    raise RuntimeError("the stream ended without [DONE]")
                phase.ttft_s.append(first)
                phase.completed += 1
            except Exception as exc:  # a lost request: counted, and the client goes on
                phase.lost += 1
                phase.errors.append(f"{type(exc).__name__}: {exc}")


async def _idle_flood(host: str, port: int, count: int, delay: float, stop: float, phase: Phase) -> None:
    """Keep `count` silent connections open, re-opening those the server closes."""
    async def one() -> None:
        while time.monotonic() < stop:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                _count(phase, "idle_connect_failed")
                await asyncio.sleep(0.1)
                continue
            _count(phase, "idle_opened")
            try:
                remaining = stop - time.monotonic()
                data = await asyncio.wait_for(reader.read(1024), timeout=max(0.01, remaining))
                _count(phase, "idle_turned_away" if data.startswith(b"HTTP/1.1 503") else "idle_closed_by_server")
            except (asyncio.TimeoutError, OSError):
                pass
            finally:
                writer.close()
            await asyncio.sleep(delay)

    await asyncio.gather(*(one() for _ in range(count)))


async def _stalled_client(host: str, port: int, key: str | None, stop: float, phase: Phase, i: int) -> None:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    partial = [
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl",  # headers cut short
        (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
         "Content-Length: 1000\r\n\r\n{\"prompt\": \"a").encode(),  # body cut short
    ][i % 2]
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(partial)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(1024), timeout=max(0.01, stop - time.monotonic()))
            _count(phase, f"stalled_{'headers' if i % 2 == 0 else 'body'}_{data[9:12].decode() or 'closed'}")
            writer.close()
        except (asyncio.TimeoutError, OSError):
            await asyncio.sleep(0.1)


async def _slow_reader(url: str, headers: dict, load: Load, stop: float, phase: Phase) -> None:
    body = {"prompt": "A slow reader asks about", "max_tokens": 64, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        while time.monotonic() < stop:
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_raw(64):
                        await asyncio.sleep(load.slow_read_interval)
                        if time.monotonic() > stop:
                            break
                _count(phase, "slow_reads")
            except Exception as exc:
                _count(phase, f"slow_read_error_{type(exc).__name__}")


async def _disconnecting_client(url: str, headers: dict, stop: float, phase: Phase) -> None:
    body = {"prompt": "Leaving early:", "max_tokens": 64, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        while time.monotonic() < stop:
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        break  # gone after the first chunk
                _count(phase, "disconnects")
            except Exception as exc:
                _count(phase, f"disconnect_error_{type(exc).__name__}")


async def _abuse(url: str, key: str | None, load: Load, stop: float, phase: Phase) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    parsed = urlparse(url)
    tasks = [_idle_flood(parsed.hostname, parsed.port, load.idle_connections, load.idle_reconnect_delay, stop, phase)]
    tasks += [_stalled_client(parsed.hostname, parsed.port, key, stop, phase, i) for i in range(load.stalled_clients)]
    tasks += [_slow_reader(url, headers, load, stop, phase) for _ in range(load.slow_readers)]
    tasks += [_disconnecting_client(url, headers, stop, phase) for _ in range(load.disconnecting_clients)]
    await asyncio.gather(*tasks)


def _abuse_process(url: str, key: str | None, load: Load, seconds: float, results: Any) -> None:
    phase = Phase()
    asyncio.run(_abuse(url, key, load, time.monotonic() + seconds, phase))
    results.put(phase.abuse)


async def _phase(url: str, key: str | None, load: Load, abusive: bool) -> Phase:
    """Normal clients here; the abusive ones in another process, so that their event loop's
    work does not delay this one's (and with it the TTFT measured)."""
    phase = Phase()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    abuser = None
    if abusive:
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        abuser = ctx.Process(target=_abuse_process, args=(url, key, load, load.duration + 1.0, results))
        abuser.start()
        await asyncio.sleep(1.0)  # the flood is in place before the normal clients start
    stop = time.monotonic() + load.duration
    await asyncio.gather(*(_normal_client(url, headers, load, stop, phase, i) for i in range(load.normal_clients)))
    if abuser is not None:
        phase.abuse = await asyncio.get_running_loop().run_in_executor(None, results.get)
        abuser.join()
    return phase


async def run_load(url: str, key: str | None, load: Load) -> dict:
    """The unloaded phase, then the loaded one; their summaries."""
    unloaded = await _phase(url, key, load, abusive=False)
    loaded = await _phase(url, key, load, abusive=True)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        health = (await client.get("/health")).status_code
    return {"unloaded": unloaded.summary(), "loaded": loaded.summary(), "health_after": health}


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _sample_rss(pid: int, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = _rss_mb(pid)
        if rss is not None:
            samples.append(rss)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start `nanovllm serve` here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--serve-args", default="--device cpu", help="extra `nanovllm serve` arguments")
    for name, value in asdict(Load()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    load = Load(**{k: getattr(args, k) for k in asdict(Load())})
    from nanovllm.entrypoints.limits import raise_fd_limit

    raise_fd_limit()  # the flood's sockets (the abusive process inherits the limit)
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        cmd = [sys.executable, "-m", "nanovllm", "serve", "--port", str(port), *args.serve_args.split()]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)

    async def go() -> dict:
        samples: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(_sample_rss(proc.pid, samples, stop)) if proc else None
        result = await run_load(url, args.api_key, load)
        stop.set()
        if sampler:
            await sampler
            result["server_rss_mb"] = {"start": samples[0], "max": max(samples), "end": samples[-1]} if samples else None
        return result

    try:
        result = asyncio.run(go())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    u, l = result["unloaded"]["ttft_p99_s"], result["loaded"]["ttft_p99_s"]
    result["p99_ratio"] = l / u if u and l else None
    result["load"] = asdict(load)
    print(json.dumps(result, indent=2))
    ok = result["loaded"]["lost"] == 0 and result["unloaded"]["lost"] == 0 and (result["p99_ratio"] or 99) <= 2.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
