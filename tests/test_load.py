"""A few seconds of benchmarks/abuse_load.py against the tiny checkpoint: normal streaming
clients beside an idle-connection flood over the connection cap, stalled, slow and
disconnecting clients. None of the normal clients' requests may be lost, and the server must
answer /health afterwards. (TTFT ratios are for the full benchmark; this machine is too noisy
to assert them in seconds.)"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.server import create_app
from test_server_limits import KEY, MODEL, serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import abuse_load  # noqa: E402


def test_abusive_clients_lose_no_normal_request(qwen3_tiny):
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), device="cpu", max_model_len=128, kvcache_block_size=4,
                                     num_kvcache_blocks=256)
    limits = ServerLimits(max_connections=48, timeout_header=0.5, timeout_body=0.5)
    load = abuse_load.Load(duration=3.0, normal_clients=3, max_tokens=8, idle_connections=80, idle_reconnect_delay=0.05,
                           stalled_clients=4, slow_readers=2, slow_read_interval=0.2, disconnecting_clients=2)
    try:
        with serve(create_app(engine, MODEL, api_key=KEY, limits=limits), limits) as port:
            result = asyncio.run(abuse_load.run_load(f"http://127.0.0.1:{port}", KEY, load))
    finally:
        engine.shutdown()
    unloaded, loaded = result["unloaded"], result["loaded"]
    assert unloaded["lost"] == 0 and loaded["lost"] == 0, (unloaded["errors"], loaded["errors"])
    assert unloaded["requests"] > 0 and loaded["requests"] > 0
    assert result["health_after"] == 200
    abuse = loaded["abuse"]
    assert abuse.get("idle_opened", 0) > limits.max_connections  # the flood went over the cap
    assert abuse.get("idle_closed_by_server", 0) > 0  # evicted or timed out
    assert abuse.get("disconnects", 0) > 0 and abuse.get("slow_reads", 0) > 0
    assert engine.error is None
