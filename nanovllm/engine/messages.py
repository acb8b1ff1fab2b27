"""What the engine core and its front-ends say to each other over ZeroMQ (msgspec msgpack).

Front-end -> core: `AddRequest` (token ids + sampling params), `Abort`, `Hello` (sent on
connect and as a heartbeat). Core -> front-end: one `CoreOutput` per engine step that touched
that front-end's requests (or per heartbeat): which adds were accepted or rejected, each
request's *new* token ids since the last message (never cumulative, never text), finish
reasons, logprobs where asked, the engine's stats, and a fatal error if the core failed.

Structs are `array_like` (encoded as msgpack arrays, no field names on the wire).
"""
from __future__ import annotations

import msgspec

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

# SamplingParams' constructor fields (its derived stop_list is rebuilt by the constructor).
_PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids",
                 "ignore_eos", "logprobs", "prompt_logprobs", "n", "skip_special_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output",
                 "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "bad_words_token_ids")


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields without stop strings (the front-end applies those)


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    index: int | None = None  # one sample (a stop string matched in it); None: the whole request


class Hello(msgspec.Struct, tag=True, array_like=True):
    stats_request: int = 0  # > 0: answer now with the stats, echoing this number (CoreOutput.stats_answer)


class Delta(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[list[int]]  # per sample: tokens generated since the last Delta
    finish_reasons: list[str | None]  # per sample, None while it runs
    finished: bool  # the whole request is done (the core forgot it)
    # per sample, per new token: [token id, logprob] pairs (the top k and the sampled token)
    logprobs: list[list[list[tuple[int, float]]]] | None = None
    num_cached_tokens: int = 0
    # RequestOutput.prompt_logprobs, in the request's first Delta only: per prompt token None
    # (the first) or its [token id, logprob, rank] triples (the prompt token's first, then the top k)
    prompt_logprobs: list[list[tuple[int, float, int | None]] | None] | None = None


class Stats(msgspec.Struct, array_like=True):
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_steps: int = 0  # LLMEngine's step counters (since start)
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    num_prompt_steps: int = 0
    prompt_step_seconds: float = 0.0


class CoreOutput(msgspec.Struct, array_like=True):
    deltas: list[Delta] = []
    accepted: list[str] = []
    rejected: list[tuple[str, str, str]] = []  # (request id, kind: "invalid" | "overloaded" | "dead", message)
    stats: Stats | None = None
    error: str | None = None  # the core failed: every request of this front-end is lost
    stats_answer: int = 0  # the largest Hello.stats_request this output's stats answer


FrontendMessage = AddRequest | Abort | Hello


def prompt_logprobs_to_wire(prompt_logprobs: list[dict | None] | None) -> list | None:
    """RequestOutput.prompt_logprobs as Delta.prompt_logprobs' [token id, logprob, rank] triples."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else [(t, float(lp), lp.rank) for t, lp in entry.items()] for entry in prompt_logprobs]


def prompt_logprobs_from_wire(wire: list | None) -> list[dict[int, Logprob] | None] | None:
    if wire is None:
        return None
    return [None if entry is None else {t: Logprob(lp, rank) for t, lp, rank in entry} for entry in wire]


def params_to_wire(params: SamplingParams) -> dict:
    fields = {name: getattr(params, name) for name in _PARAM_FIELDS}
    so = params.structured_outputs
    # The one field set, as given (a JSON schema as a dict or as its text).
    fields["structured_outputs"] = None if so is None else {so.kind: getattr(so, so.kind)}
    return fields


def params_from_wire(fields: dict) -> SamplingParams:
    so = fields.get("structured_outputs")
    return SamplingParams(**{k: v for k, v in fields.items() if k in _PARAM_FIELDS},
                          structured_outputs=None if so is None else StructuredOutputsParams(**so))
