"""Request outputs that read both ways: vLLM style (`out.outputs[0].text`) and nano-vllm
style (`out["text"]`, `out["token_ids"]`), so code written for either runs unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | None while running; "error" where the request's grammar
    # (structured_outputs) allows no token at all after these tokens: it matches no complete output.
    finish_reason: str | None
    # Per generated token (when SamplingParams.logprobs is set): {token_id: logprob}, holding
    # the sampled token and the top-k alternatives.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # vLLM's: the stop string or the stop_token_ids entry that ended the sample ("stop"); None
    # for an EOS token and every other ending.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key == "text":
            return self.outputs[0].text
        if key == "token_ids":
            return self.outputs[0].token_ids
        raise KeyError(f"{key!r}: a RequestOutput offers 'text' and 'token_ids' (or attributes)")

    def keys(self) -> list[str]:
        return ["text", "token_ids"]
