"""Request outputs that read both ways: vLLM style (`out.outputs[0].text`) and nano-vllm
style (`out["text"]`, `out["token_ids"]`), so code written for either runs unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Logprob(float):
    """A token's log-probability in `CompletionOutput.logprobs` ({token id: Logprob}): a float,
    which is nano-vllm's shape, that also reads as vLLM's Logprob: `.logprob`, `.rank` (1 for
    the step's likeliest token; None for a sampled token outside the top k asked for) and
    `.decoded_token` (None: not computed)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def ranked_logprobs(entry: dict[int, float], top_k: int) -> dict[int, Logprob]:
    """One step's {token: logprob} (its top_k tokens, plus the sampled one where it is not among
    them) as Logprobs ranked by value; a (top_k + 1)-th entry is the sampled token's, unranked."""
    order = sorted(entry.items(), key=lambda item: -item[1])
    return {token: Logprob(lp, rank + 1 if rank < top_k else None) for rank, (token, lp) in enumerate(order)}


def prompt_logprob_entry(token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """One prompt token's RequestOutput.prompt_logprobs entry, vLLM's: the token's own Logprob
    (its rank among the whole vocabulary), then the k likeliest tokens' (ranks 1..k)."""
    entry = {token: Logprob(logprob, rank)}
    for i, (t, lp) in enumerate(top):
        entry.setdefault(t, Logprob(lp, i + 1))
    return entry


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | None while running; "error" where the request's grammar
    # (structured_outputs) allows no token at all after these tokens: it matches no complete output.
    finish_reason: str | None
    # Per generated token (when SamplingParams.logprobs is set): {token_id: logprob}, holding
    # the sampled token and the top-k alternatives; from LLM, each a `Logprob` (vLLM's shape too).
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
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token_id:
    # Logprob} of that token and the k likeliest at its position (prompt_logprob_entry); None
    # when not asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __getitem__(self, key: str) -> Any:
        if key == "text":
            return self.outputs[0].text
        if key == "token_ids":
            return self.outputs[0].token_ids
        raise KeyError(f"{key!r}: a RequestOutput offers 'text' and 'token_ids' (or attributes)")

    def keys(self) -> list[str]:
        return ["text", "token_ids"]
