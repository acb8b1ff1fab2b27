"""Schema-driven fuzzing of the live server with schemathesis (not written by us), bounded in time.

Every operation in the app's OpenAPI schema gets requests generated from its schema, valid
ones (positive) and invalid ones (negative), sent to a live server on the tiny checkpoint with
small caps (a short context, n and prompt count capped), so that generating costs little. Each
response is checked: no 5xx, a status code, content type and body the schema declares. The
budget is FUZZ_SECONDS for the whole run; the number of cases tried is printed (`-s`) and must
reach a floor so that the test cannot pass by trying nothing.
"""
from __future__ import annotations

import os
import time

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.server import create_app
from test_server_limits import KEY, MODEL, serve

FUZZ_SECONDS = float(os.environ.get("NANOVLLM_FUZZ_SECONDS", "30"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
LIMITS = ServerLimits(max_n=2, max_prompts=2, max_body_bytes=256 * 1024)


class _TimeUp(Exception):
    """Ends a hypothesis run at its deadline (hypothesis has no time-based stop of its own)."""


def test_fuzz_the_openapi_schema(qwen3_tiny):
    engine = AsyncEngine.from_kwargs(str(qwen3_tiny), device="cpu", max_model_len=48, kvcache_block_size=4,
                                     num_kvcache_blocks=256)
    app = create_app(engine, MODEL, api_key=KEY, limits=LIMITS)
    try:
        with serve(app, LIMITS) as port:
            url = f"http://127.0.0.1:{port}"
            schema = schemathesis.openapi.from_url(url + "/openapi.json")
            operations = [result.ok() for result in schema.get_all_operations()]
            # Operations without a body first: they run out of distinct inputs at once, leaving
            # their time to the completions endpoints.
            operations.sort(key=lambda op: op.method.upper() == "POST")
            runs = [(op, mode) for op in operations for mode in schemathesis.GenerationMode]
            deadline = time.monotonic() + FUZZ_SECONDS
            tried: dict[str, int] = {}
            statuses: dict[int, int] = {}
            for i, (op, mode) in enumerate(runs):
                share = (deadline - time.monotonic()) / (len(runs) - i)  # each run gets its share of what is left
                run_deadline = time.monotonic() + share
                label = f"{op.label} {mode.value}"

                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=400, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                def run(case):
                    if time.monotonic() > run_deadline:
                        raise _TimeUp
                    tried[label] = tried.get(label, 0) + 1
                    response = case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                      checks=CHECKS, timeout=30)
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

                try:
                    run()
                except _TimeUp:
                    pass
                except Unsatisfiable:
                    assert mode is schemathesis.GenerationMode.NEGATIVE, label  # nothing to make invalid
            total = sum(tried.values())
            print(f"\nfuzz: {total} cases in {FUZZ_SECONDS:g} s: " + ", ".join(f"{k}: {v}" for k, v in tried.items())
                  + f"; status codes: {dict(sorted(statuses.items()))}")
            assert total >= 50 and statuses.get(200, 0) >= 5 and engine.error is None
    finally:
        engine.shutdown()
