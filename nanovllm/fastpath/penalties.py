"""The lone stream's logit bias and token statistics at fixed device addresses, which the
filtered graphs read and update (layers/penalty_kernel.py) with every step's settings in its
record (SingleDecodeInputs.penalty_knobs).

The runner keeps every penalized sequence's statistics in its PenaltyState, whose rows move
when it grows, so a captured graph cannot read them there. `LonePenalties` holds one copy:
`load(item, state)` makes it the statistics of `item`'s sequence (read from its row of `state`,
which starts it from the prompt at its first sampling step) before the filtered graphs run a
step of it, and the graphs count each sampled token here; `flush(state)` writes the copy back
into the sequence's row before anything else may use the row or the copy (any step that is not
a filtered lone step of that sequence, and release). So a sequence that moves between the fast
path and the runner's batches keeps exact counts, and a lone stream's steps and bursts stay on
the device.

The bias is dense ([V] fp32, 0 where a token has none), filled when a biased sequence's step
comes and cleared when another sequence's does. A step without penalties has knobs (0, 0, 1)
and the bias of 0: the kernel then leaves its logits as they are.
"""
from __future__ import annotations

from typing import Any

import torch

from nanovllm.layers.host_copy import to_device
from nanovllm.layers.penalty_kernel import count_token, penalize
from nanovllm.step import ScheduledSeq


class LonePenalties:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.edited = torch.empty((1, vocab_size), dtype=torch.float32, device=device)  # what the sampler reads
        self.owner: int | None = None  # the sequence whose statistics counts / seen are (ahead of its row)
        self.bias_of: int | None = None  # the sequence whose logit_bias is in bias

    def apply(self, logits: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
        """logits [1, V] biased and penalized under knobs ([3] fp32: presence, frequency,
        repetition) into `edited`, which it returns."""
        return penalize(logits, knobs, self.bias, self.counts, self.seen, out=self.edited)

    def count(self, token: torch.Tensor) -> None:
        """Add the sampled token ([1] int64 on the device) to the statistics."""
        count_token(token, self.counts, self.seen)

    def load(self, item: ScheduledSeq, state: Any) -> None:
        """Make the buffers those of `item`'s sequence before a filtered lone step of it; state:
        the runner's PenaltyState."""
        p = item.params
        if not p.penalized:
            self.flush(state)  # the step's counts land here: nobody's
        elif self.owner != item.seq_id or item.penalty_prompt_ids is not None:
            self.flush(state)
            _, counts, seen = state.gather([item])  # starts the row from the prompt where it is due
            self.counts.copy_(counts[0])
            self.seen.copy_(seen[0])
            self.owner = item.seq_id
        wanted = item.seq_id if p.logit_bias else None
        if wanted != self.bias_of:
            if self.bias_of is not None:
                self.bias.zero_()
            if p.logit_bias:
                tokens = [t for t in p.logit_bias if t < self.vocab_size]
                if len(tokens) != len(p.logit_bias):
                    raise ValueError(f"SamplingParams.logit_bias: a token id is outside the vocabulary [0, {self.vocab_size})")
                device = self.bias.device
                values = to_device(torch.tensor([p.logit_bias[t] for t in tokens], dtype=torch.float32), device)
                self.bias[to_device(torch.tensor(tokens, dtype=torch.int64), device)] = values
            self.bias_of = wanted

    def flush(self, state: Any) -> None:
        """Write the owner's statistics back into its row of `state` (a finished sequence has
        none any more) and own nothing."""
        if self.owner is None:
            return
        slot = state.slots.get(self.owner)
        if slot is not None:
            state.counts[slot].copy_(self.counts)
            state.seen[slot].copy_(self.seen)
        self.owner = None
