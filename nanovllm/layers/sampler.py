"""Token sampling for one step, entirely on the logits' device and without a host sync.

Pipeline per row (all in fp32, whatever the logits' dtype):
  raw logits --> logprobs (optional)
             --> + logit_bias --> penalties --> bans (layers/penalties.py; only rows that ask)
             --> grammar mask (structured/bitmask.py; only rows with structured_outputs)
             --> greedy argmax, or
                 / temperature --> top-k --> top-p --> softmax --> min-p --> exponential race
                                                                    (CPU: inverse-CDF draw)

Design decisions:
- Exponential race instead of `torch.multinomial`. If q_i ~ Exp(1) independently, then
  argmax_i(p_i / q_i) is distributed exactly as Categorical(p) (p need not even be normalised),
  and it is one elementwise op plus an argmax: no host sync, no cumulative-sum search, and the
  noise for a seeded row can be drawn independently of the other rows. On the CPU, where torch
  draws the V exponentials of a row one after another (the costliest part of a sampled step
  there), a row instead inverts its cumulative distribution at one uniform draw
  (`_inverse_cdf_draw`): also exactly Categorical(p), for the price of a cumulative sum.
- Logprobs are log_softmax of the *raw* logits, before biases, penalties, bans, temperature and
  filters. That is what vLLM returns by default, and it makes them a property of the model
  rather than of the sampling knobs. Requested logprobs cost one extra full-vocabulary pass; none is done when no row asks.
- Per-row generators. A request with a seed owns a `torch.Generator` (`make_generator`) and its
  noise row is drawn from it alone, so its tokens do not depend on what else is in the batch or
  where its row sits. Unseeded rows share one batched draw from the global RNG. Seeded rows cost
  one small kernel each, which is why the batched path exists.
- On CUDA, a batch with a top-k / top-p / min-p filter or a seeded row takes the sort-free
  kernels of filtered_sampler.py instead (same filters, Gumbel-max draw). Each row's noise is
  keyed by a step seed (`step_seed(seed, position)` for a seeded row, a draw from the global RNG
  otherwise), so a seeded request's tokens depend on its logits alone, whether it is sampled
  here in a batch or by the persistent decode kernel's graphs alone (fastpath/).
- Top-k and top-p are applied together in sorted order (one stable sort, one scatter back), and
  only when some sampled row uses them; the common batch (temperature only) never sorts. Top-k
  keeps exactly k tokens (ties at the boundary go to the lower token id). Top-p keeps a token when
  the probability mass strictly above it is < top_p: the smallest prefix whose mass reaches
  top_p, and always the most likely token. Min-p then drops tokens with prob < min_p * max prob
  (a ratio that top-k/top-p renormalisation does not change).
- Greedy rows (temperature 0) take argmax of the (biased, penalized) logits (first index on
  ties, as torch.argmax and HF do). A batch of greedy rows and nothing else (no bias,
  penalties or logprobs: the common case, and every greedy request under a grammar) skips the
  pipeline: `Sampler.greedy` takes the argmax of the logits as they are, or under the rows'
  grammar masks (on CUDA one kernel, fused_sampler.MaskedGreedy). Temperatures below
  `GREEDY_EPS` are treated as greedy (`SamplingParams.greedy`): dividing by them overflows.
- Everything that decides control flow (the flags, which rows are seeded, how many logprobs) is
  known on the host when `SamplingTensors` is built, so `Sampler.forward` never reads the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from nanovllm.layers.penalties import LogitBias, Penalties, TokenBans
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # xgrammar is imported only once a request has a grammar
    from nanovllm.structured.bitmask import TokenBitmask


def step_seed(seed: int, position: int) -> int:
    """The Philox key (31 bits) of a seeded request's Gumbel noise at the step whose input token
    sits at `position` (the kernels of fused_sampler.py and filtered_sampler.py): splitmix64 of
    the two, so that neighbouring seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return (z ^ (z >> 31)) >> 33


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on.

    Any Python int is accepted: it is reduced to 64 bits (torch rejects larger seeds).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


# The CPU's top-k / top-p look among each row's TOP_CANDIDATES largest logits first
# (_apply_top_k_top_p_among_candidates); a top-p set is taken from them only where they hold at
# least top_p + TOP_P_MARGIN of the mass.
TOP_CANDIDATES = 1024
TOP_P_MARGIN = 1e-4


@dataclass
class SamplingTensors:
    """Per-row sampling controls for the rows sampled this step, on the logits' device.

    Build with `from_params`. The boolean flags and `max_num_logprobs` are host values that let
    the sampler skip work without reading the device.
    """

    # Each control is on the device only when some row needs it (None otherwise): every
    # host-to-device copy is a launch the GPU waits on between steps.
    temperature: torch.Tensor | None  # [B] float32; 0 = greedy row. None when all_greedy
    top_k: torch.Tensor | None  # [B] int64; vocab size when off. None unless any_top_k
    top_p: torch.Tensor | None  # [B] float32; 1 when off. None unless any_top_p
    min_p: torch.Tensor | None  # [B] float32; 0 when off. None unless any_min_p
    # One per row; None = draw from the global RNG. Always None for greedy rows (they draw nothing).
    generators: list[torch.Generator | None]
    all_greedy: bool
    all_random: bool  # no greedy row: skip the greedy argmax
    any_top_k: bool  # flags consider sampled (non-greedy) rows only
    any_top_p: bool
    any_min_p: bool
    # None: no row asked for logprobs. 0: some row wants only the sampled token's logprob.
    # k > 0: also the top k (the largest request in the batch; the runner slices per row).
    max_num_logprobs: int | None
    logit_bias: LogitBias | None = None  # None unless some row has a logit_bias
    penalties: Penalties | None = None  # None unless some row is penalized
    # [B] int64 Philox keys: the batch takes filtered_sampler's kernels (from_params(step_seeds=)).
    step_seeds: torch.Tensor | None = None
    token_mask: TokenBitmask | None = None  # None unless some row has a grammar
    # None unless some row has banned ids (min_tokens, bad_words) or allowed_token_ids.
    bans: TokenBans | None = None

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        vocab_size: int,
        device: torch.device | str,
        token_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
        step_seeds: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """One row per entry of `params`; `generators[i]` is row i's seeded generator or None.
        token_stats: (output counts [P, V] int32, prompt-or-output seen [P, V] bool) of the P
        penalized rows (SamplingParams.penalized), in order; needed when some row is penalized.

        step_seeds: one Philox key per row: the batch is sampled by filtered_sampler's kernels,
        which take every control of every row (`Sampler.wants_step_seeds` says when).

        Each tensor that is needed is one host-to-device copy (pinned and non-blocking on CUDA).
        """
        num_rows = len(params)
        gens: list[torch.Generator | None] = [None] * num_rows if generators is None else list(generators)
        if len(gens) != num_rows:
            raise ValueError(f"SamplingTensors: {len(gens)} generators for {num_rows} rows")
        if vocab_size < 1:
            raise ValueError(f"SamplingTensors: vocab_size must be >= 1 (got {vocab_size})")
        device = torch.device(device)
        for g in gens:
            if g is not None and g.device.type != device.type:
                raise ValueError(f"SamplingTensors: generator on {g.device}, logits on {device}")

        temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
        greedy = [t == 0.0 for t in temperature]
        top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        # A positive top_p below float32's range (5e-324 is valid) would be 0 on the device and
        # drop even the most likely token: the smallest normal float32 keeps it, as any top_p > 0 does.
        smallest_top_p = torch.finfo(torch.float32).tiny
        top_p = [max(float(p.top_p), smallest_top_p) for p in params]
        min_p = [float(p.min_p) for p in params]
        sampled = [i for i in range(num_rows) if not greedy[i]]
        asked = [p.logprobs for p in params if p.logprobs is not None]

        pin = device.type == "cuda"

        def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype, pin_memory=pin)
            return host.to(device, non_blocking=pin)

        any_top_k = any(top_k[i] < vocab_size for i in sampled)
        any_top_p = any(top_p[i] < 1.0 for i in sampled)
        any_min_p = any(min_p[i] > 0.0 for i in sampled)
        kernel = step_seeds is not None
        if kernel and len(step_seeds) != num_rows:
            raise ValueError(f"SamplingTensors: {len(step_seeds)} step seeds for {num_rows} rows")
        penalties = None
        if any(p.penalized for p in params):
            if token_stats is None:
                raise ValueError("SamplingTensors: penalized rows need token_stats (output counts, seen)")
            penalties = Penalties.from_params(params, *token_stats)
        return cls(
            temperature=to_device(temperature, torch.float32) if sampled or kernel else None,
            top_k=to_device(top_k, torch.int32 if kernel else torch.int64) if any_top_k or kernel else None,
            top_p=to_device(top_p, torch.float32) if any_top_p or kernel else None,
            min_p=to_device(min_p, torch.float32) if any_min_p or kernel else None,
            generators=[None if greedy[i] else g for i, g in enumerate(gens)],
            all_greedy=len(sampled) == 0,
            all_random=len(sampled) == num_rows,
            any_top_k=any_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            max_num_logprobs=max(asked) if asked else None,
            logit_bias=LogitBias.from_params(params, vocab_size, device),
            penalties=penalties,
            step_seeds=to_device(list(step_seeds), torch.int64) if kernel else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the device
    sampled_logprobs: torch.Tensor | None  # [B] float32, logprob of token_ids under the raw logits
    top_token_ids: torch.Tensor | None  # [B, k] int64, most likely first
    top_logprobs: torch.Tensor | None  # [B, k] float32, descending


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Each row's token_ids entry under the log_softmax of its raw logits (fp32, as the sampled
    tokens' logprobs): (its logprob [R], its rank [R]: 1 + how many tokens score strictly
    higher, the top k ids [R, k] and logprobs [R, k], descending)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=1) + 1
    top_logprobs, top_ids = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
    return token_logprobs, ranks, top_ids, top_logprobs


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (the first index of each row's maximum; a NaN counts as the maximum).
    On the CPU through numpy, whose vectorised argmax scans a vocabulary-sized row some ten
    times faster than torch's there: a greedy CPU decode step would spend more on the argmax
    than on its sampling bookkeeping."""
    if logits.is_cpu and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.argmax(dim=-1)


class Sampler(nn.Module):
    """`Sampler()(logits [B, V], st) -> SamplerOutput`; see the module docstring.

    fused: whether batches that only need temperature / greedy sampling take the one-kernel
    Triton path (fused_sampler.py) on CUDA; None reads NANOVLLM_FUSED_OPS. Tests force it on
    other devices by editing `fused_devices`."""

    def __init__(self, fused: bool | None = None) -> None:
        super().__init__()
        if fused is None:
            from nanovllm.layers.fusion import fused_ops_from_env

            fused = fused_ops_from_env()
        self.fused_devices: tuple[str, ...] = ("cuda",) if fused else ()
        self._filtered = None  # filtered_sampler.FilteredSampler, made at the first batch that needs it
        self._greedy: tuple[torch.Tensor, torch.Tensor] | None = None  # _greedy_inputs
        self._masked_greedy = None  # fused_sampler.MaskedGreedy, made at the first masked greedy batch

    # The fused kernel runs one program per row: it pays for large batches that sample (one pass
    # instead of ~6); a small batch, or an all-greedy one without grammar masks, is faster as
    # torch's own argmax.
    fast_path_min_rows = 32

    def fast_path_ok(self, st: SamplingTensors) -> bool:
        """Temperature sampling, and greedy rows where grammar masks apply (the kernel reads the
        masks in its scan, where the reference path would copy, mask and scan the logits): no
        filters, penalties or biases, no seeded rows, no logprobs, enough rows."""
        return not ((st.all_greedy and st.token_mask is None) or st.num_rows < self.fast_path_min_rows
                    or st.logit_bias is not None or st.penalties is not None
                    or st.any_top_k or st.any_top_p or st.any_min_p or st.max_num_logprobs is not None
                    or any(g is not None for g in st.generators))

    def wants_step_seeds(self, params: Sequence[SamplingParams], device: torch.device) -> bool:
        """Whether a batch of these rows on `device` takes filtered_sampler's kernels: on CUDA,
        where some sampled row has a top-k / top-p / min-p filter or a seed of its own. The
        caller then passes one step seed per row to SamplingTensors.from_params."""
        return device.type in self.fused_devices and any(p.filters_or_seed for p in params)

    def masked_dry_pass(self, logits: torch.Tensor) -> None:
        """The fused launches for a batch under grammar masks, on logits [B, V] of the model's
        dtype: greedy rows (Sampler.greedy) and, where B >= fast_path_min_rows, sampled ones
        (the fused kernel's masked variant). Inside a dry pass (nanovllm/precompile.py) they
        only queue their compiles: a batch's first grammar mask can come in the middle of a
        loaded run, and compiling then would stall the batch."""
        from nanovllm.layers.fused_sampler import MaskedGreedy, gumbel_argmax

        rows, vocab = logits.shape
        device = logits.device
        words = torch.zeros((rows, (vocab + 31) // 32), dtype=torch.int32, device=device)
        row_of = torch.zeros(rows, dtype=torch.int32, device=device)
        # An instance of its own: the dry pass runs on a compile thread beside the engine.
        MaskedGreedy(device)(logits.contiguous(), words, row_of)
        if rows >= self.fast_path_min_rows:
            temperature, seed = self._greedy_inputs(rows, device)
            gumbel_argmax(logits.contiguous(), temperature, seed, None, (words, row_of))

    def greedy(self, logits: torch.Tensor, token_mask: TokenBitmask | None = None) -> SamplerOutput:
        """A batch whose every row takes the argmax (SamplingParams.takes_argmax, no logit
        bias): each row's most likely token among those its grammar mask allows, the lowest id
        on ties. No SamplingTensors are built: nothing but the logits and the masks is read. On
        the fused devices the masked argmax is one kernel (fused_sampler.MaskedGreedy); else the
        disallowed logits of an fp32 copy are set to -inf first."""
        if token_mask is None:
            return SamplerOutput(greedy_argmax(logits), None, None, None)
        if logits.device.type in self.fused_devices:
            if self._masked_greedy is None:
                from nanovllm.layers.fused_sampler import MaskedGreedy

                self._masked_greedy = MaskedGreedy(logits.device)
            return SamplerOutput(self._masked_greedy(logits.contiguous(), token_mask.words, token_mask.row_of),
                                 None, None, None)
        masked = logits.float() if logits.dtype != torch.float32 else logits.clone()
        token_mask.apply_(masked)
        return SamplerOutput(greedy_argmax(masked), None, None, None)

    def _greedy_inputs(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(zero temperatures [rows], a seed) on device for an all-greedy batch of the fused
        kernel; kept, and grown as batches grow. Nothing writes into them."""
        kept = self._greedy
        if kept is None or kept[0].device != device or kept[0].shape[0] < rows:
            kept = self._greedy = (torch.zeros(max(rows, 64), dtype=torch.float32, device=device),
                                   torch.zeros(1, dtype=torch.int64, device=device))
        return kept[0][:rows], kept[1]

    def _filtered_sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        from nanovllm.layers.filtered_sampler import FilteredSampler

        rows, vocab = logits.shape
        f = self._filtered
        if f is None or f.vocab_size != vocab or f.max_rows < rows or f.cand_val.device != logits.device:
            f = self._filtered = FilteredSampler(vocab, max(rows, 64), logits.device)
        return f(logits.contiguous(), st.temperature, st.top_k, st.top_p, st.min_p, st.step_seeds)

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != st.num_rows:
            raise ValueError(f"Sampler: logits {tuple(logits.shape)} for {st.num_rows} rows; expected [B, V]")
        if logits.device.type in self.fused_devices and self.fast_path_ok(st):
            from nanovllm.layers.fused_sampler import gumbel_argmax

            if st.bans is not None:  # no logprobs read the raw logits (fast_path_ok)
                logits = st.bans.applied(logits)
            mask = None if st.token_mask is None else (st.token_mask.words, st.token_mask.row_of)
            temperature = st.temperature  # None where every row is greedy (then masked: fast_path_ok)
            if temperature is None:  # no noise is drawn: fixed zeros serve every step
                temperature, seed = self._greedy_inputs(st.num_rows, logits.device)
            else:
                seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, dtype=torch.int64)
            return SamplerOutput(gumbel_argmax(logits.contiguous(), temperature, seed, None, mask), None, None, None)
        # May alias the caller's tensor when it is already fp32: nothing below writes into it.
        converted = logits.dtype != torch.float32
        logits = raw = logits.float()
        if st.logit_bias is not None or st.penalties is not None or st.bans is not None or st.token_mask is not None:
            # Edited in place: a copy, unless raw is one already and no logprobs read it.
            logits = raw if converted and st.max_num_logprobs is None else raw.clone()
            if st.logit_bias is not None:
                st.logit_bias.apply_(logits)
            if st.penalties is not None:
                st.penalties.apply_(logits)
            if st.bans is not None:
                st.bans.apply_(logits)
            if st.token_mask is not None:
                st.token_mask.apply_(logits)

        if st.all_greedy:
            token_ids = greedy_argmax(logits)
        elif st.step_seeds is not None:
            token_ids = self._filtered_sample(logits, st)
        else:
            sampled = self._sample(logits, st)
            if st.all_random:
                token_ids = sampled
            else:
                token_ids = torch.where(st.temperature == 0, greedy_argmax(logits), sampled)

        if st.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        logprobs = torch.log_softmax(raw, dim=-1)
        sampled_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        k = min(st.max_num_logprobs, logits.shape[1])
        if k == 0:
            return SamplerOutput(token_ids, sampled_logprobs, None, None)
        top_logprobs, top_token_ids = torch.topk(logprobs, k, dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top_token_ids, top_logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        # Greedy rows divide by 1 here and their sample is discarded by the caller.
        temperature = st.temperature.masked_fill(st.temperature == 0, 1.0)
        x = logits / temperature.unsqueeze(1)  # a fresh tensor: safe to modify in place
        if st.any_top_k or st.any_top_p:
            # On the CPU, where sorting a whole vocabulary per row costs more than the rest of
            # the step's sampling, the filters look among each row's largest logits first
            # (its checks read the tensors: on CUDA that would be a host sync).
            among = _apply_top_k_top_p_among_candidates(x, st) if x.is_cpu else None
            x = among if among is not None else _apply_top_k_top_p(x, st)
        probs = x.softmax(dim=-1)
        if st.any_min_p:
            threshold = probs.amax(dim=-1, keepdim=True) * st.min_p.unsqueeze(1)
            probs.masked_fill_(probs < threshold, 0.0)
        if probs.device.type == "cpu":
            return _inverse_cdf_draw(probs, st.generators)
        return _exponential_race(probs, st.generators)


def _apply_top_k_top_p(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Masks x [B, V] to -inf outside each row's top-k, then outside its top-p. In place."""
    # Stable, so ties keep token-id order and a row's result does not depend on the batch.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if st.any_top_k:
        rank = torch.arange(x.shape[1], device=x.device)
        sorted_x.masked_fill_(rank.unsqueeze(0) >= st.top_k.unsqueeze(1), float("-inf"))
    if st.any_top_p:
        probs = sorted_x.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs  # exactly 0 for the first token
        drop = mass_above >= st.top_p.unsqueeze(1)
        # Rows with top_p == 1 are left alone: rounding in the cumsum could reach 1.0 early.
        drop &= (st.top_p < 1.0).unsqueeze(1)
        sorted_x.masked_fill_(drop, float("-inf"))
    return x.scatter_(1, order, sorted_x)


def _apply_top_k_top_p_among_candidates(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor | None:
    """What _apply_top_k_top_p(x, st) gives, found among each row's TOP_CANDIDATES largest
    entries (a partial selection, ties put in token-id order as the reference's stable sort
    does), or None unless that is certain for every row: a top-k beyond the candidates, a top-p
    set that may need more than their mass (under top_p + TOP_P_MARGIN), or a tie between the
    last kept entry and the largest one left out each send the batch to the reference. The
    probabilities are the reference's up to rounding, so a token whose mass above is within
    rounding of top_p may fall the other way. x is left as it is."""
    rows, vocab = x.shape
    if vocab <= TOP_CANDIDATES:
        return None
    top_k = st.top_k if st.any_top_k else torch.full((rows,), vocab, dtype=torch.int64)
    has_k = top_k < vocab
    if bool((has_k & (top_k > TOP_CANDIDATES)).any()):
        return None
    values, ids = x.topk(TOP_CANDIDATES, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    keep = torch.arange(TOP_CANDIDATES).unsqueeze(0) < top_k.unsqueeze(1)
    filtered = has_k
    if st.any_top_p:
        has_p = st.top_p < 1.0
        filtered = filtered | has_p
        kept_by_k = values.masked_fill(~keep, float("-inf"))
        # The reference's softmax runs over the row after top-k: the candidates where a top-k
        # holds, the whole row where none does.
        norm = torch.where(has_k.unsqueeze(1), torch.logsumexp(kept_by_k, dim=-1, keepdim=True),
                           torch.logsumexp(x, dim=-1, keepdim=True))
        probs = (kept_by_k - norm).exp()
        if bool((has_p & ~has_k & (probs.sum(dim=-1) < st.top_p + TOP_P_MARGIN)).any()):
            return None
        mass_above = probs.cumsum(dim=-1) - probs
        keep &= ~((mass_above >= st.top_p.unsqueeze(1)) & has_p.unsqueeze(1))
    last_kept = values.gather(1, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    if bool((filtered & (last_kept <= values[:, -1])).any()):
        return None
    out = torch.full_like(x, float("-inf")).scatter_(1, ids, values.masked_fill(~keep, float("-inf")))
    return torch.where(filtered.unsqueeze(1), out, x)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V] (>= 0, some > 0 per row): argmax(p / q), q ~ Exp(1).
    Writes into probs."""
    return probs.div_(_exponential_noise(probs, generators)).argmax(dim=-1)


def _inverse_cdf_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V] (>= 0, some > 0 per row): the first token whose
    cumulative probability exceeds u * the row's total, u ~ U[0, 1) drawn once per row (a seeded
    row from its own generator, the rest batched). The sums are in float64; a token with p = 0
    adds nothing to them, so it is never the first to exceed."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.empty_like(total)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        u.uniform_()
    for i, gen in seeded:
        u[i] = torch.rand(1, dtype=torch.float64, generator=gen)
    # u < 1, but u * total can round up to total: stay below it, where some token exceeds.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row with no mass (NaN logits) has no answer; it gets an id in range rather than V.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like probs [B, V]: seeded rows from their own generator, the rest batched."""
    noise = torch.empty_like(probs)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    for i, gen in seeded:
        # A fresh [V] tensor, so the draw is the same whatever row (and offset) it lands in.
        noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=gen)
    # Exp(1) can round to 0; p / 0 would be inf (or nan for a filtered p = 0, which argmax prefers).
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)
