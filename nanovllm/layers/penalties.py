"""Logit biases, vLLM's three penalties and token bans, applied to a step's logits on their device.

Definitions (vLLM's, which OpenAI's presence/frequency penalties match):
- logit_bias: token id -> b in [-100, 100], added to the raw logit first.
- repetition_penalty r, over tokens seen in the prompt or the output: a logit > 0 is divided
  by r, any other multiplied by r (r > 1 discourages repeats).
- frequency_penalty f and presence_penalty p, over the output only:
  logit -= f * count + p * (count > 0).
- bans (TokenBans), after those: a row's banned tokens (min_tokens' stop ids, the tokens that
  would complete a bad word) and, where it has allowed_token_ids, every token but those, at -inf.
Temperature and the top-k / top-p / min-p filters come after (layers/sampler.py).

Only the rows that carry a penalty are touched (gathered, edited, scattered back), so a batch
mixing them with plain requests costs the plain rows nothing. Every control is a tensor built
on the host when the step is prepared; nothing here reads the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanovllm.layers.host_copy import to_device
from nanovllm.sampling_params import SamplingParams


@dataclass
class LogitBias:
    """Every (row, token, bias) of the batch's logit_bias entries, flattened: [N] each."""

    rows: torch.Tensor  # int64
    token_ids: torch.Tensor  # int64
    values: torch.Tensor  # float32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device) -> LogitBias | None:
        """None when no row has a bias. A token id outside the logits is a ValueError (the
        engine checks it against the vocabulary when the request is added)."""
        rows, tokens, values = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if t >= vocab_size:
                        raise ValueError(f"SamplingParams.logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")
                    rows.append(i)
                    tokens.append(t)
                    values.append(b)
        if not rows:
            return None
        index = to_device(torch.tensor([rows, tokens], dtype=torch.int64), device)
        return cls(index[0], index[1], to_device(torch.tensor(values, dtype=torch.float32), device))

    def apply_(self, logits: torch.Tensor) -> None:
        """logits [B, V] fp32 += the biases, in place (a token listed twice cannot occur: dict keys)."""
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


@dataclass
class Penalties:
    """The penalized rows of a step ([P] each) and their token statistics ([P, V])."""

    rows: torch.Tensor  # int64, rows of the batch's logits
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    repetition: torch.Tensor  # float32; 1 = off
    output_counts: torch.Tensor  # [P, V] int32: how often each token was sampled so far
    seen: torch.Tensor  # [P, V] bool: the token is in the prompt or was sampled
    # Host flags: whether some row has a repetition / a presence or frequency penalty.
    any_repetition: bool = True
    any_additive: bool = True

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], output_counts: torch.Tensor,
                    seen: torch.Tensor) -> Penalties | None:
        """None when no row is penalized (SamplingParams.penalized); else output_counts and
        seen hold one row per penalized row of `params`, in order."""
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        if output_counts.shape[0] != len(rows) or seen.shape != output_counts.shape:
            raise ValueError(f"Penalties: {len(rows)} penalized rows, token statistics of shape "
                             f"{tuple(output_counts.shape)} and {tuple(seen.shape)}")
        device = output_counts.device
        knobs = torch.tensor([[params[i].presence_penalty for i in rows], [params[i].frequency_penalty for i in rows],
                              [params[i].repetition_penalty for i in rows]], dtype=torch.float32)
        knobs = to_device(knobs, device)
        return cls(to_device(torch.tensor(rows, dtype=torch.int64), device), knobs[0], knobs[1], knobs[2], output_counts, seen,
                   any_repetition=any(params[i].repetition_penalty != 1.0 for i in rows),
                   any_additive=any(params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0 for i in rows))

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalize the rows of logits [B, V] fp32 in place. Plain indexing, not index_select:
        on the CPU, torch's index_select of long rows is an order of magnitude slower."""
        whole = self.rows.shape[0] == logits.shape[0]  # every row penalized: no gather
        x = logits if whole else logits[self.rows]
        if self.any_repetition:
            r = torch.where(self.seen, self.repetition.unsqueeze(1), 1.0)
            x = torch.where(x > 0, x / r, x * r)
        if self.any_additive:
            counts = self.output_counts.to(torch.float32)
            x = x - (self.frequency.unsqueeze(1) * counts + self.presence.unsqueeze(1) * (counts > 0))
        if whole:
            logits.copy_(x)
        else:
            logits[self.rows] = x


@dataclass
class TokenBans:
    """The tokens a step's rows may not sample, as index tensors on the logits' device: (row,
    token) of every banned token ([N] each), and (row, token) of every allowed token ([M] each)
    of the rows with allowed_token_ids (`restricted`, [R]), whose other tokens are all banned."""

    banned_rows: torch.Tensor  # int64
    banned_tokens: torch.Tensor  # int64
    allowed_rows: torch.Tensor  # int64
    allowed_tokens: torch.Tensor  # int64
    restricted: torch.Tensor  # int64

    @classmethod
    def from_rows(cls, banned: Sequence[list[int] | None], allowed: Sequence[list[int] | None],
                  device: torch.device) -> TokenBans | None:
        """Each row's banned token ids and allowed token ids (None: none / every token), in one
        host-to-device copy; None when no row bans or restricts anything."""
        banned_pairs = [(i, t) for i, ids in enumerate(banned) if ids for t in ids]
        allowed_pairs = [(i, t) for i, ids in enumerate(allowed) if ids is not None for t in ids]
        if not banned_pairs and not allowed_pairs:
            return None
        restricted = [i for i, ids in enumerate(allowed) if ids is not None]
        flat = [r for r, _ in banned_pairs] + [t for _, t in banned_pairs]
        flat += [r for r, _ in allowed_pairs] + [t for _, t in allowed_pairs] + restricted
        values = to_device(torch.tensor(flat, dtype=torch.int64), device)
        n, m = len(banned_pairs), len(allowed_pairs)
        return cls(values[:n], values[n : 2 * n], values[2 * n : 2 * n + m], values[2 * n + m : 2 * n + 2 * m],
                   values[2 * n + 2 * m :])

    def apply_(self, logits: torch.Tensor) -> None:
        """The banned logits of logits [B, V] fp32 to -inf, in place: a restricted row is set to
        -inf whole and its allowed tokens' logits are put back (no [R, V] temporary)."""
        if self.allowed_rows.numel():
            kept = logits[self.allowed_rows, self.allowed_tokens]
            logits.index_fill_(0, self.restricted, float("-inf"))
            logits[self.allowed_rows, self.allowed_tokens] = kept
        if self.banned_rows.numel():
            logits[self.banned_rows, self.banned_tokens] = float("-inf")

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of logits [B, V] with the bans applied (logits are left as they are)."""
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()
        self.apply_(out)
        return out
