"""The data of one scheduled step: what the scheduler hands down to the executor, the runner
and its workers. Plain Python, no torch, imported by everything below the engine.

`burst_sizes` is the generic multi-step decode rule: a lone sequence may be given several
decode steps at once (`ScheduledSeq.num_steps`), and the runner must be able to run each size
the scheduler can ask for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams

# Stands in for a token that has been sampled on the device but not yet copied to the host
# (async scheduling: step N+1 is scheduled while step N is still running).
PLACEHOLDER_TOKEN = -1

# One scored prompt token (SamplingParams.prompt_logprobs): (its logprob, its rank: 1 + how many
# tokens score strictly higher, [(token id, logprob)] of the k likeliest, descending).
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


def burst_sizes(decode_burst: int) -> list[int]:
    """The decode bursts a lone sequence takes: decode_burst steps, and where fewer tokens are
    left under its max_tokens, halves of it down to 2, so that a request's last tokens still
    come in bursts rather than single steps. The runner must run every size listed."""
    sizes = []
    while decode_burst >= 2:
        sizes.append(decode_burst)
        decode_burst //= 2
    return sizes


@dataclass
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # True when this step reaches the end of the sequence: sample one token
    params: SamplingParams
    seed: int | None
    banned_token_ids: list[int] | None  # not samplable at this step (min_tokens, bad_words)
    # A decode burst (no grammar, banned or allowed ids, bad words or logprobs; one token in): K
    # steps back to back, the K/V of token_ids[0] and of the first K-1 tokens sampled, and K
    # tokens sampled. 1: an ordinary step.
    num_steps: int = 1
    # A penalized request's first sampling step (SamplingParams.penalized): its prompt, from
    # which the runner starts the sequence's token counts; it adds each sampled token on the
    # device after that (runner/penalty_state.py), so later steps carry nothing.
    penalty_prompt_ids: list[int] | None = None
    # A sampling row with a grammar (SamplingParams.structured_outputs): the host bitmask of the
    # tokens it allows next (int32 [1, ceil(vocab / 32)], a torch tensor, set by the engine).
    token_bitmask: object | None = None
    # A prompt chunk of a request with SamplingParams.prompt_logprobs: the prompt tokens whose
    # logprobs this step computes, from prompt index prompt_logprobs_from on; the i-th is scored
    # by the logits of the chunk's token at position prompt_logprobs_from - 1 + i.
    prompt_logprob_ids: list[int] | None = None
    prompt_logprobs_from: int = 0

    @property
    def prompt_logprob_rows(self) -> range:
        """The rows of this step's tokens whose logits score prompt_logprob_ids."""
        first = self.prompt_logprobs_from - 1 - self.start_pos
        return range(first, first + len(self.prompt_logprob_ids or ()))


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # decodes (one token each) first
    num_decodes: int
    num_batched_tokens: int  # a burst counts its K steps
    finished_seq_ids: list[int] = field(default_factory=list)  # runner may drop per-seq state

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_steps for s in self.seqs[: self.num_decodes])
