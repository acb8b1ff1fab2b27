"""The fast path's one seam with the runner: `FastPath.take(step)`.

A lone decoding sequence is latency-bound: its step reads every weight once, and a per-op
decode graph spends more on its ~250 kernel launches than on those reads. The fast path runs
such a step as one persistent kernel (decoder.py, kernel.py) replayed in a CUDA graph
(graphs.py), and a decode burst (several steps of one sequence, `ScheduledSeq.num_steps`) as
one graph of them. Greedy and plain-temperature streams are picked by the kernel's LM head; a
stream with top-k / top-p / min-p, or with penalties or a logit bias, takes the filtered
graphs, where every logit is stored, its logit bias and penalties are applied on the device
(fastpath/penalties.py keeps the stream's token counts at fixed addresses) and
layers/filtered_sampler.py samples after each step; an unedited top-k stream (Qwen3's
defaults) takes the top-k graphs instead, where the kernel's int8 LM head stores bounds and
only the rows that can be in the top k are recomputed exactly and listed for the sampler's
pick (head_refine.py). A seeded stream's noise is keyed by
sampler.step_seed, as in the runner's sampler, so its tokens depend on its logits alone.
Grammars, banned or allowed ids (min_tokens, bad_words, allowed_token_ids) and logprobs take
the runner's own path, as does everything else.

Interface (ModelRunner is the only caller):
- `FastPath.build(runner)`: the fast path for this runner's model, or None where it is turned
  off or the model is not one the kernel supports (logged).
- `take(step) -> StepResult | None`: asked once per step; runs the step and returns its result
  where the fast path takes it, else None (the runner runs it). The first decode step starts the
  kernel's background compile; a later step adopts the compiled kernel (captures its graphs).
- `decode_burst`: the longest burst its graphs hold (1 before they are captured).
- `bind(k_caches, v_caches)`, `finish_background_compile()`, `release()`: lifecycle.

What it uses of the runner: `model`, `device`, `dtype`, `config`, `block_size`, `staging` (the
pinned host buffers), `graph_runner` (its memory pool), `sample(rows, logits)`,
`run_steps(item, launch)`, `penalty_state` (its penalized sequences' token counts) and the
device-side ids of the last step's samples, `prev_tokens` and `prev_rows`.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.fastpath.graphs import BurstTokens, LoneGraphs, SingleDecodeInputs
from nanovllm.fastpath.head_refine import HeadRefine
from nanovllm.fastpath.penalties import LonePenalties
from nanovllm.layers.sampler import SamplerOutput, step_seed
from nanovllm.precompile import compile_in_background
from nanovllm.sampling_params import SamplingParams
from nanovllm.step_result import Done, PendingOutput, RunnerOutput, StepResult
from nanovllm.step import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput

logger = logging.getLogger("nanovllm")

# Decode steps per burst where the persistent kernel's graphs serve a lone greedy (or, with
# its fused LM head, plain-temperature) sequence (EngineConfig.decode_burst=None): longer bursts
# gained little more (docs/benchmarks.md).
DEFAULT_DECODE_BURST = 8


@dataclass(frozen=True)
class LoneRoute:
    """How a lone decode step's token is made, decided once per step (FastPath._route):
    picks, the kernel's own LM head picks or samples it (greedy, plain temperature); filtered,
    the filtered graphs (every logit stored, logit edits applied, layers/filtered_sampler.py
    samples); top_k, of the filtered ones, the top-k graphs (the int8 head's bounds,
    head_refine.py); none of them, the runner's sampler reads the step's logits."""

    picks: bool
    filtered: bool
    top_k: bool


class BurstOutput:
    """The K tokens of a decode burst's graph (LoneGraphs.replay_burst), on their way to the
    host (BurstTokens)."""

    def __init__(self, tokens: BurstTokens) -> None:
        self.tokens = tokens

    def result(self) -> RunnerOutput:
        return RunnerOutput(list(self.tokens.tolist()))


class FastPath:
    def __init__(self, runner: Any, decoder: Any) -> None:
        from nanovllm.layers.filtered_sampler import FilteredSampler
        from nanovllm.layers.fused_sampler import GreedyRow

        self.runner = runner
        self.decoder = decoder
        vocab = runner.model.lm_head.num_embeddings
        self.greedy_row = GreedyRow(vocab, runner.device)  # the graphs' argmax
        self.filtered = FilteredSampler(vocab, 1, runner.device)  # the filtered graphs' sampler
        # The filtered graphs' logit bias and token counts; penalized streams take them where
        # the runner counts tokens over the same vocabulary.
        self.penalties = LonePenalties(vocab, runner.device)
        self.penalties_match = runner.penalty_state.vocab_size == vocab
        # The top-k graphs' exact top rows, from the int8 head's bounds (head_refine.py)
        self.refine = (HeadRefine(decoder.logits, decoder.logits_hi, decoder.out, decoder.head_weight, decoder.head_val,
                                  self.filtered) if decoder.quantized_head else None)
        config = runner.config
        self.graphs = LoneGraphs(runner.graph_runner.capture_in_pool, runner.device,
                                 -(-config.max_model_len // runner.block_size), config.max_model_len,
                                 burst=self._graph_burst)
        # The kernel compiles off the start-up path, on a thread that the first decode step
        # starts (started at start-up, its Python front end held the GIL against the first
        # request); `take` adopts the kernel once compiled.
        self._pending: Future | None = None
        g, greedy = self.graphs, self.greedy_row
        ids, pos, meta = g.single.token, g.single.position, g.single.meta()
        logits = torch.empty((1, greedy.vocab_size), dtype=runner.dtype, device=runner.device)
        device = runner.device

        filtered, penalties, s = self.filtered, self.penalties, g.single
        picked = torch.empty(1, dtype=torch.int64, device=device)

        def dry_pass() -> None:
            with torch.cuda.device(device), torch.inference_mode():
                if decoder.fused_head:
                    decoder(ids, pos, meta, ids, g.single.temperatures[0], g.single.seeds[0])
                else:
                    decoder(ids, pos, meta)
                    greedy(logits, ids)
                # The filtered graphs' kernels, over the views they are captured with (the
                # counts are nobody's yet).
                edited = penalties.apply(logits, s.penalty_knobs[0])
                filtered(edited, s.sample_temperatures[0], s.top_ks[0], s.top_ps[0], s.min_ps[0], s.seeds[0], out=picked)
                penalties.count(picked)
                if self.refine is not None:  # the top-k graphs'
                    self.refine(s.sample_temperatures[0], s.top_ks[0])
                    filtered.pick_listed(logits, s.sample_temperatures[0], s.top_ks[0], s.top_ps[0], s.min_ps[0],
                                         s.seeds[0], out=picked)

        self._dry_pass: Callable[[], None] | None = dry_pass

    @classmethod
    def build(cls, runner: Any) -> FastPath | None:
        """The fast path of `runner` (its CUDA graphs captured or not), or None where it is
        turned off or the model is not one the persistent kernel supports (logged)."""
        model = runner.model
        if not runner.config.persistent_decode or not getattr(getattr(model, "model", None), "fused_ops", False):
            return None
        from nanovllm.fastpath.decoder import PersistentDecoder, unsupported_reason

        reason = unsupported_reason(model)
        if reason is not None:
            logger.info("persistent decode off: %s", reason)
            return None
        sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
        return cls(runner, PersistentDecoder(model, num_programs=sms))

    # ---- lifecycle -----------------------------------------------------------------------
    def bind(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        if self.decoder is not None:
            self.decoder.bind(k_caches, v_caches)

    def finish_background_compile(self) -> None:
        """Start the persistent decode kernel's background compile if no step has, wait for it
        and adopt the kernel now (tests and benchmarks; serving adopts it at the first step
        after it is done). Call it on the thread that runs steps."""
        self._start_background_compile()
        if self._pending is not None:
            self._pending.exception()  # waits
            self._adopt()

    def _start_background_compile(self) -> None:
        if self._dry_pass is not None:
            self._pending = compile_in_background(self._dry_pass)
            self._dry_pass = None

    def _adopt(self) -> None:
        """Capture the compiled persistent kernel's graphs: from now on a lone decode replays
        them. Anything that stops it (a compile error, a failed capture) leaves the per-op path
        on."""
        pending, self._pending = self._pending, None
        try:
            if not pending.result():
                raise RuntimeError("this Triton cannot compile in the background")
            self.graphs.capture(self._lone_step, burst=self._graph_burst, one_launch=self.decoder.multi_step,
                                filtered_step=self._lone_filtered_step,
                                top_k_step=self._lone_top_k_step if self.refine is not None else None)
        except Exception as e:  # noqa: BLE001 - an optional fast path: log it and serve without it
            logger.warning("persistent decode off: %s", e)
            self.graphs.single_graph = None
            self.decoder = None

    def release(self) -> None:
        """Drop the graphs (see CudaGraphRunner.release); later lone decodes take the runner's
        path, from the token counts written back here."""
        self.penalties.flush(self.runner.penalty_state)
        self.graphs.release()

    @property
    def _graph_burst(self) -> int:
        """The decode burst the graphs are captured for (EngineConfig.decode_burst)."""
        burst = self.runner.config.decode_burst
        return burst if burst is not None else DEFAULT_DECODE_BURST

    @property
    def decode_burst(self) -> int:
        """The longest decode burst the captured graphs hold (1 before they are captured)."""
        g = self.graphs
        return g.burst_steps if g.burst_graphs else 1

    @property
    def lone_sampling(self) -> bool:
        """Whether the lone-sequence graphs sample a plain-temperature stream themselves (the
        persistent kernel's fused head: SamplingParams.plain_temperature), so that such a stream
        takes decode bursts in one graph too. Else it samples after each graph, from its logits."""
        return self.graphs.has_single and self.decoder is not None and self.decoder.fused_head

    # ---- one step ------------------------------------------------------------------------
    def take(self, out: SchedulerOutput) -> StepResult | None:
        """Run `out` and return its result where it is a lone decode (or decode burst) that the
        captured graphs serve; None: the runner runs it."""
        if self._pending is not None and self._pending.done():
            self._adopt()
        elif self._dry_pass is not None and out.num_decodes:
            self._start_background_compile()  # the first decode step: every first token is out
        # A prompt's one-token chunk that scores the next prompt token (prompt_logprobs) needs
        # that position's every logit: the runner computes it.
        lone = (self.graphs.has_single and len(out.seqs) == 1 and out.num_decodes == 1
                and not out.seqs[0].prompt_logprob_ids)
        item = out.seqs[0] if lone else None
        route = self._route(item) if item is not None else None
        if route is not None and route.filtered:
            self.penalties.load(item, self.runner.penalty_state)
        else:  # the runner may use the token counts of the stream the filtered graphs counted
            self.penalties.flush(self.runner.penalty_state)
        if item is None or (item.params.edits_logits and not route.filtered):
            return None  # grammar masks (and edits without the filtered graphs) take the runner's sampler
        if item.num_steps > 1:
            return self._execute_burst(item, route)
        launched = self._execute_single(item, route)
        if launched is None:
            return Done(RunnerOutput([]))
        return PendingOutput(*launched, self.runner.readback)

    def _lone_step(self, token: torch.Tensor, position: torch.Tensor, meta: AttentionMetadata,
                   next_token: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, steps: int = 1,
                   record_bytes: int = 0, host_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of a lone sequence through the persistent kernel, its greedy token
        into next_token; returns the logits (what the lone-sequence graphs capture). The kernel
        runs the LM head and the argmax itself where it can (fused_head), and then samples the
        token instead where `temperature` ([1] float32, SingleDecodeInputs) is above 0
        (`lone_sampling`); else cuBLAS and GreedyRow follow it. steps > 1: a decode burst in
        this one launch (the decoder's multi_step; inputs and host_tokens as
        PersistentDecoder.__call__ takes them)."""
        decoder = self.decoder
        if decoder.fused_head:
            decoder(token, position, meta, next_token, temperature, seed, steps, record_bytes, host_tokens)
            return decoder.logits
        if steps != 1:
            raise ValueError("several decode steps in one launch need the persistent kernel's fused head")
        logits = self.runner.model.compute_logits(decoder(token, position, meta))
        self.greedy_row(logits, next_token)
        return logits

    def _lone_filtered_step(self, s: SingleDecodeInputs, i: int, next_token: torch.Tensor) -> None:
        """Step i of a filtered stream over record i of `s` (its temperature word asks for every
        logit): the persistent kernel, the logit bias and the record's penalties, then its
        top-k / top-p / min-p sample under its seed into next_token, counted (what the filtered
        graphs capture)."""
        logits = self._lone_step(s.tokens[i], s.positions[i], s.meta(i), next_token, s.temperatures[i], s.seeds[i])
        edited = self.penalties.apply(logits, s.penalty_knobs[i])
        self.filtered(edited, s.sample_temperatures[i], s.top_ks[i], s.top_ps[i], s.min_ps[i], s.seeds[i], out=next_token)
        self.penalties.count(next_token)

    def _lone_top_k_step(self, s: SingleDecodeInputs, i: int, next_token: torch.Tensor) -> None:
        """Step i of a top-k stream over record i of `s` (its temperature word asks for bounds):
        the persistent kernel with the int8 head's bounds, its top rows' exact logits listed
        (head_refine.py), then the filtered sampler's pick under its seed into next_token (what
        the top-k graphs capture). No logit edits: the seam sends only unedited streams here."""
        logits = self._lone_step(s.tokens[i], s.positions[i], s.meta(i), next_token, s.temperatures[i], s.seeds[i])
        self.refine(s.sample_temperatures[i], s.top_ks[i])
        self.filtered.pick_listed(logits, s.sample_temperatures[i], s.top_ks[i], s.top_ps[i], s.min_ps[i], s.seeds[i],
                                  out=next_token)

    def _execute_burst(self, item: ScheduledSeq, route: LoneRoute) -> StepResult:
        """A decode burst (ScheduledSeq.num_steps steps of one greedy or plain-temperature
        sequence): one replay of a burst graph where they have this size and its steps' tokens
        come from the graph (`_graph_picks_token`), its inputs copied on a second stream while
        the burst before runs (LoneGraphs.uploading); otherwise that many lone-sequence steps
        launched back to back (ModelRunner.run_steps)."""
        g = self.graphs
        runner = self.runner
        if item.num_steps in g.burst_family(route.filtered, route.top_k) and (route.filtered or route.picks):
            j, s = g.next_burst()
            with g.uploading(j) as stream:
                self._upload_lone_inputs(item, route, steps=item.num_steps, s=s, stream=stream)
            tokens = g.replay_burst(j, item.num_steps, filtered=route.filtered, top_k=route.top_k)
            runner.prev_tokens, runner.prev_rows = g.last_token(j, route.filtered), {item.seq_id: 0}
            return BurstOutput(tokens)
        return runner.run_steps(item, lambda step: self._execute_single(step, self._route(step)))

    def _upload_lone_inputs(self, item: ScheduledSeq, route: LoneRoute, steps: int = 1,
                            s: SingleDecodeInputs | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Copy the inputs of `steps` decode steps of `item` into lone-sequence graph inputs `s`
        (SingleDecodeInputs; None: the graph of one step's) in one copy, on `stream` (None: the
        current one). A greedy stream's input token is where the last replay wrote it, else it is
        copied or written there on the current stream (after the launch in flight, which may
        write it)."""
        runner = self.runner
        staging = runner.staging
        s = self.graphs.single if s is None else s
        host = staging.take(s.nbytes)
        token = item.token_ids[0]
        p = item.params
        picks, filtered = route.picks, route.filtered
        seeds = None
        temperature = 0.0  # greedy
        all_logits = False
        if filtered and p.greedy:  # a greedy stream with logit edits: the filtered graphs' argmax
            seeds = [0] * steps
        elif (not p.greedy and picks) or filtered:  # the graph samples: a seed per step
            temperature = p.temperature if picks else 0.0
            if item.seed is None:
                seeds = torch.randint(0, 2**31 - 1, (steps,)).tolist()  # torch.manual_seed governs them
            else:
                seeds = [step_seed(item.seed, item.start_pos + i) for i in range(steps)]
        elif item.sample and not picks:  # the sampler needs every logit (a quantized head would not store them)
            all_logits = True
        filters = ((0.0, -1, 1.0, 0.0) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)) if filtered else None
        s.fill_host(host, token, item.start_pos, item.block_table, runner.block_size, steps, temperature, seeds,
                    all_logits=all_logits, filters=filters,
                    penalties=(p.presence_penalty, p.frequency_penalty, p.repetition_penalty),
                    bounds=route.top_k)
        if token == PLACEHOLDER_TOKEN:
            row = runner.prev_rows[item.seq_id]
            if not (runner.prev_tokens is s.token and row == 0):
                s.token.copy_(runner.prev_tokens[row : row + 1])
        elif stream is None:
            staging.upload(0, s.nbytes, out=s.buffer)
            return
        else:
            s.token.fill_(token)
        staging.upload(s.POSITION, s.nbytes, out=s.buffer[s.POSITION :], stream=stream)

    def _execute_single(self, item: ScheduledSeq, route: LoneRoute) -> tuple[list[ScheduledSeq], SamplerOutput] | None:
        """A lone decoding sequence: one copy of its inputs, one replay of the graph of the
        persistent kernel, LM head and greedy argmax or sample (LoneGraphs.capture); the sampler
        runs only for rows whose token the graph does not pick (`_graph_picks_token`). Returns
        (sampling rows, SamplerOutput), or None where the step samples nothing."""
        runner = self.runner
        s = self.graphs.single
        self._upload_lone_inputs(item, route)
        if not item.sample and runner.prev_tokens is s.token:
            runner.prev_tokens = s.token.clone()  # the replay's argmax overwrites them
        logits = self.graphs.replay_single(filtered=route.filtered, top_k=route.top_k)
        if not item.sample:
            return None
        if route.filtered or route.picks:
            sampled = SamplerOutput(s.token, None, None, None)  # the graph's argmax (or sample)
        else:
            sampled = runner.sample([item], logits)
        runner.prev_tokens = sampled.token_ids
        runner.prev_rows = {item.seq_id: 0}
        return [item], sampled

    def _graph_picks_token(self, item: ScheduledSeq) -> bool:
        """Whether the token the lone-sequence graphs leave in SingleDecodeInputs is this step's
        token: a sampling step without logprobs, banned or allowed ids or logit edits that is
        greedy, or at a plain temperature (no filter) where the kernel samples (`lone_sampling`)."""
        p = item.params
        if (not item.sample or p.logprobs is not None or item.banned_token_ids or p.restricts_tokens
                or p.edits_logits):
            return False
        return p.greedy or (p.plain_temperature and self.lone_sampling)

    def _route(self, item: ScheduledSeq) -> LoneRoute:
        """How this lone step's token is made (LoneRoute)."""
        picks = self._graph_picks_token(item)
        filtered = self._graph_filters(item, picks)
        top_k = filtered and self.graphs.has_top_k and self._bounds_suffice(item.params)
        return LoneRoute(picks=picks, filtered=filtered, top_k=top_k)

    def _bounds_suffice(self, p: SamplingParams) -> bool:
        """Whether a filtered stream sampling under `p` can take the int8 head's bounds
        (head_refine.py) instead of the 16-bit head: a top-k sample (k at most the kernel's
        programs) without logit edits, which could lift a row the bounds left inexact."""
        return (self.refine is not None and not p.greedy and not p.edits_logits
                and 0 < p.top_k <= self.decoder.num_programs)

    def _graph_filters(self, item: ScheduledSeq, picks: bool | None = None) -> bool:
        """Whether this step takes the filtered graphs: a sampling step without logprobs, banned
        or allowed ids or a grammar that has penalties or a logit bias (greedy too: the filtered
        sampler's argmax), or whose token the kernel's own head does not pick (top-k, top-p or
        min-p; or any temperature where the kernel has no fused head). picks:
        `_graph_picks_token(item)`, where the caller has it."""
        p = item.params
        if (not self.graphs.has_filtered or not item.sample or p.logprobs is not None or item.banned_token_ids
                or p.restricts_tokens):
            return False
        if p.edits_logits:
            return p.structured_outputs is None and (self.penalties_match or not p.penalized)
        return not p.greedy and not (self._graph_picks_token(item) if picks is None else picks)
