"""Data parallelism as N independent replicas behind the vLLM router (docs/scaling.md).

Two `nanovllm serve` replicas on the CPU sit behind the real `vllm-router` binary (PyPI
`vllm-router`); the official `openai` client drives the router. Killing one replica mid-load
must leave every request sent after the kill served by the other one.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the router test drives the router with the openai client")
httpx = pytest.importorskip("httpx")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTER = shutil.which("vllm-router") or (
    os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if os.path.exists(os.path.join(os.path.dirname(sys.executable), "vllm-router")) else None
)
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router, "
                                "part of the test extra)")
START_TIMEOUT_S = 120.0
SUCCESS_METRIC = 'vllm:request_success_total{finished_reason="length",model_name="tiny"}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy within {timeout_s}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def start_replica(model: str, port: int, log) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "serve", model, "--device", "cpu", "--port", str(port),
         "--served-model-name", "tiny", "--max-model-len", "512"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )


def start_router(port: int, workers: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        # The router's own metrics listener defaults to the fixed port 29000: another port, free now.
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
         "--worker-urls", *workers, "--policy", "round_robin",
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--retry-max-retries", "3",
         "--retry-initial-backoff-ms", "50", "--cb-failure-threshold", "1", "--worker-startup-timeout-secs", "60"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def completions_served(url: str) -> float:
    """Completions a replica finished successfully, from its Prometheus text."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(SUCCESS_METRIC))


@pytest.fixture(scope="module")
def deployment(qwen3_tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    files = [open(logs / f"replica{i}.log", "w") for i in range(2)] + [open(logs / "router.log", "w")]
    replicas = [start_replica(str(qwen3_tiny), p, f) for p, f in zip(ports, files)]
    router = None
    try:
        for url, proc in zip(urls, replicas):
            wait_healthy(url, proc)
        router_url = f"http://127.0.0.1:{free_port()}"
        router = start_router(int(router_url.rsplit(":", 1)[1]), urls, files[2])
        wait_healthy(router_url, router)
        yield dict(urls=urls, replicas=replicas, router=router_url, logs=logs)
    finally:
        for proc in ([router] if router else []) + replicas:
            stop(proc)
        for f in files:
            f.close()


def test_the_router_passes_the_replica_contract_through(deployment, qwen3_tiny):
    router = deployment["router"]
    card = httpx.get(router + "/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == "tiny" and card["root"] == str(qwen3_tiny)
    tokens = httpx.post(router + "/tokenize", json={"model": "tiny", "prompt": "Paris is the capital"}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(router + "/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "Paris is the capital"}


def test_killing_one_replica_mid_load_leaves_every_later_request_served(deployment):
    client = openai.OpenAI(base_url=deployment["router"] + "/v1", api_key="none", max_retries=0, timeout=60)
    victim, survivor = deployment["replicas"][0], deployment["urls"][1]
    results: list[tuple[float, bool, str]] = []  # (sent at, ok, error)
    lock = threading.Lock()
    killed_at: list[float] = []
    stop_at: list[float] = []

    def client_loop(i: int) -> None:
        n = 0
        while not stop_at or time.monotonic() < stop_at[0]:
            sent = time.monotonic()
            try:
                out = client.completions.create(model="tiny", prompt=f"client {i} request {n}", max_tokens=12,
                                                temperature=0.0)
                ok, err = out.choices[0].finish_reason in ("length", "stop"), ""
            except openai.OpenAIError as exc:
                ok, err = False, f"{type(exc).__name__}: {exc}"
            with lock:
                results.append((sent, ok, err))
            n += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while len(results) < 12 and time.monotonic() < deadline:  # both replicas are serving
            time.sleep(0.05)
        served_before = completions_served(survivor)
        assert served_before > 0, "round robin never reached the second replica"
        killed_at.append(time.monotonic())
        os.killpg(victim.pid, signal.SIGKILL)  # mid-load: requests are in flight on it
        victim.wait(10)
        while sum(1 for r in results if r[0] > killed_at[0]) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop_at.append(time.monotonic())
        for t in threads:
            t.join(90)
    later = [r for r in results if r[0] > killed_at[0]]
    assert len(later) >= 30
    failures = [r[2] for r in later if not r[1]]
    assert failures == [], failures
    # They were served by the survivor: its count grew by at least as many.
    assert completions_served(survivor) - served_before >= len(later)
