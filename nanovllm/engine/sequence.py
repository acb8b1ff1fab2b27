"""One generation stream: its tokens, how many of them the KV cache holds, and its blocks.

Pure Python (no torch). vLLM-v1 style bookkeeping: a sequence has `num_computed_tokens`
(tokens whose K/V are in the cache) and `num_tokens`; the scheduler's only job is to let the
first catch up with the second. Prefill, chunked prefill, prefix-cache hits, decode and
recompute after preemption are all that one rule.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams
from nanovllm.step import PLACEHOLDER_TOKEN, PromptLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Seed of this sample's generator (params.seed + sample index), None = global RNG.
    seed: int | None = None
    # Token ids that may not be sampled before params.min_tokens (EOS and stop_token_ids).
    min_tokens_banned_ids: list[int] = field(default_factory=list)
    # Generation ends after this many tokens (params.max_tokens capped by max_model_len).
    max_tokens: int = 2**31 - 1
    # params.bad_words as token sequences (LLMEngine.add_request tokenizes them): see bad_word_bans.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, by index
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    # What ended a "stop": the stop string or stop_token_ids entry (CompletionOutput.stop_reason).
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Per generated token: (sampled logprob, {token_id: logprob} of the top k); only if asked.
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # the sum of the sampled logprobs above
    # SamplingParams.prompt_logprobs (the request's first sample only): per prompt token, None
    # for the first, then a PromptLogprob (step_result.py) as its chunks are computed; None: not asked.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        """Generated tokens known on the host (trailing in-flight placeholders are left out)."""
        return self.completion_token_ids_from(0)

    def completion_token_ids_from(self, start: int) -> list[int]:
        """Generated tokens known on the host from the start-th on (a stream's new ones)."""
        end = len(self.token_ids)
        while end > self.num_prompt_tokens and self.token_ids[end - 1] == PLACEHOLDER_TOKEN:
            end -= 1
        return self.token_ids[self.num_prompt_tokens + start : end]

    def add_logprobs(self, entry: tuple[float, dict[int, float]]) -> None:
        """Record a generated token's (sampled logprob, top-k logprobs)."""
        self.logprobs.append(entry)
        self.cumulative_logprob += entry[0]

    def bad_word_bans(self) -> list[int]:
        """The last token of each bad word whose other tokens end the output so far: the tokens
        this sequence may not sample next (vLLM's rule: only generated tokens count, and a word
        of one token is always banned). The output's last tokens must be known on the host (no
        placeholder: the engine takes a step in flight first, LLMEngine._needs_in_flight)."""
        generated = self.num_completion_tokens
        bans = []
        for word in self.bad_words_token_ids:
            before = len(word) - 1
            if before == 0 or (before <= generated and self.token_ids[-before:] == word[:-1]):
                bans.append(word[-1])
        return bans

    @property
    def scores_prompt(self) -> bool:
        """Whether some of this sequence's prompt tokens still await their logprobs: its prompt
        is then computed whole (no prefix-cache hits, whose positions have no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> None:
        """Record the entries of prompt tokens first, first + 1, ...: those not recorded yet (a
        prompt computed again after a preemption scores its tokens again)."""
        recorded = len(self.prompt_logprobs)
        if first <= recorded:
            self.prompt_logprobs += entries[recorded - first :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens past `num_tokens` (a placeholder of a step that ran after the end, a
        token its grammar refused), with their logprobs."""
        del self.token_ids[num_tokens:]
        while len(self.logprobs) > max(0, num_tokens - self.num_prompt_tokens):
            self.cumulative_logprob -= self.logprobs.pop()[0]
