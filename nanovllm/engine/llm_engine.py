"""The engine loop: requests in, one `step()` at a time, RequestOutputs out.

`step()` = schedule (pure Python) -> execute (runner on every rank) -> postprocess (append
tokens, stop rules, detokenize, build outputs). Requests are validated when added, so a bad
prompt raises for that request alone and never reaches the loop.
"""
from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from nanovllm.bad_words import bad_words_token_ids, check_in_vocabulary
from nanovllm.config import EngineConfig, resolve_max_model_len
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import (
    IncrementalDetokenizer, decode_after, stop_token_reason, streamable_text, text_token_ids, truncate_at_stop,
)
from nanovllm.engine.grammars import Grammars
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.executor.executor import make_executor
from nanovllm.layers.rotary import context_length
from nanovllm.loaders.generation_config import read_generation_defaults
from nanovllm.loaders.source import resolve_model
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, prompt_logprob_entry
from nanovllm.sampling_params import SamplingParams, truncate_prompt
from nanovllm.step import SchedulerOutput
from nanovllm.text import check_token_ids

if TYPE_CHECKING:
    from nanovllm.runner.model_runner import RunnerOutput
    from nanovllm.step_result import StepResult

logger = logging.getLogger("nanovllm")


def _freeze_startup_objects() -> None:
    """Move every object alive now out of the garbage collector's sight (gc.freeze).

    Start-up leaves millions of long-lived objects (torch, transformers, the model's modules), and
    a full collection walks all of them, hundreds of milliseconds in the middle of a run with
    the GPU waiting. Frozen objects are skipped;
    collections then only walk what requests create. Unfrozen again at exit, so that interpreter
    shutdown still frees them (extension modules check for leaks then). Nothing is collected
    first: start-up runs without collections (gc_pause.py), and one now would walk all those
    objects (0.16 s on a 2-vCPU machine for the embedded model) to free the few thousand that
    start-up left in cycles, which are frozen with the rest instead."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # one registration however many engines are built
    atexit.register(gc.unfreeze)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    stream: bool
    # Outputs carry only what each sample gained since the request's previous output
    # (LLMEngine.add_request's delta); sent_tokens / sent_text: how much of each sample was output.
    delta: bool = False
    sent_tokens: list[int] = field(default_factory=list)
    sent_text: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False  # delta: the prompt logprobs went out (once, whole)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:
            return self.seqs[0].is_finished
        return all(s.is_finished for s in self.seqs)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet (async scheduling)."""

    sched: SchedulerOutput
    result: StepResult
    # Indices of its sampling rows that sampled without their grammar's mask (Grammars.refresh's
    # check_after): the grammar checks their tokens before they are processed.
    unchecked: list[int] = field(default_factory=list)
    # Sequences whose token from this step is void: their input was a token that the grammar
    # refused after this step was launched (LLMEngine._check).
    void: set[int] = field(default_factory=set)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True, grammars_checked: bool = False) -> None:
        """detokenize=False: outputs carry token ids only (empty text) and stop strings are not
        applied; the engine core runs so, its front-ends detokenize and match stop strings.
        grammars_checked=True: whoever adds requests has checked their grammars (the engine
        core's front-ends do), so a grammar is built in the compile pool, off the loop, and one
        that fails there ends its request instead of raising from add_request."""
        self.config = config
        self.detokenize = detokenize
        # Start-up breakdown in seconds (benchmarks/startup.py prints it with the runner's).
        self.startup_seconds: dict[str, float] = {}
        t = time.perf_counter()
        self.source = resolve_model(config.model, config.hf_config)
        hf = self.source.hf_config
        t = self._mark("config", t)
        self.tokenizer = self.source.tokenizer()
        self.eos_token_ids = [config.eos] if config.eos is not None else self.source.eos_token_ids(self.tokenizer)
        t = self._mark("tokenizer", t)
        self.vocab_size = hf.vocab_size
        if config.eos is not None and config.eos >= self.vocab_size:
            raise ValueError(f"LLM(eos={config.eos}): outside the vocabulary [0, {self.vocab_size})")
        # SamplingParams keyword arguments for every field a request leaves unset (EngineConfig.generation_config).
        self.generation_defaults = read_generation_defaults(self.source) if config.generation_config == "auto" else {}
        # The positions the model reaches (its rope scaling may extend max_position_embeddings).
        model_len = context_length(hf) if hasattr(hf, "max_position_embeddings") else None
        self.max_model_len = resolve_max_model_len(config.max_model_len, model_len)
        config = self.config = replace(config, max_model_len=self.max_model_len)  # what the runners size by
        self.executor = make_executor(config, self.source)
        t = self._mark("executor", t)
        self.block_manager = BlockManager(
            self.executor.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self._mark("block_manager", t)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # Structured output: requests waiting for their grammar, matchers of constrained sequences.
        # On CUDA the mask table is pinned, so that the runner copies it to the device as it is.
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                 pin_memory=self.executor.device_type == "cuda", check_in_pool=grammars_checked)
        self.requests: dict[str, Request] = {}
        # Sequences with a bad word of several tokens: the tokens they may sample next depend on
        # their last tokens (Sequence.bad_word_bans), so a step of theirs in flight is taken first.
        self._bans_follow_output: set[int] = set()
        self.closed = False  # shut down: no new requests
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self.last_step = StepStats()
        # Since start: engine steps, the seconds spent inside them, and of those the seconds
        # spent waiting for a launched step's tokens (async scheduling). A loop that spends
        # nearly all its time in steps and little of it waiting is bound by its host. Of the
        # steps, those that computed a prompt chunk of more than one token, and their seconds:
        # such a step runs the model outside the decode's CUDA graphs (a prompt's single last
        # token is computed as a decode).
        self.num_steps = 0
        self.step_seconds = 0.0
        self.device_wait_seconds = 0.0
        self.num_prompt_steps = 0
        self.prompt_step_seconds = 0.0
        # Async scheduling: step N+1 is scheduled and launched before step N's sampled ids are
        # read back, so host work overlaps the device. Needs an executor that can launch
        # without waiting (the in-process one); the step in flight is kept here.
        wanted = config.async_scheduling
        if wanted is None:
            wanted = self.executor.device_type == "cuda"
        self.async_scheduling = wanted and self.executor.supports_async
        self._in_flight: InFlight | None = None
        t = time.perf_counter()
        _freeze_startup_objects()
        self._mark("gc_freeze", t)

    def _mark(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.startup_seconds[part] = now - since
        return now

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: strings are encoded as the tokenizer does by default (BOS
        where the model wants one); token-id lists are checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt) if prompt else []
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return check_token_ids(prompt, self.vocab_size)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, stream: bool = False,
        delta: bool = False,
    ) -> None:
        """Queue a request. stream: an output after every step that gave it tokens (else only
        the final one). delta: each output carries only what every sample gained since the
        request's previous output (its new token ids, their logprobs, the new text) instead of
        all of it, so that a long stream costs the same per step at any length; the finish
        reasons and the cumulative logprob are whole as always."""
        if self.closed:
            raise RuntimeError("this engine was shut down; create a new LLM to generate again")
        params = params if params is not None else SamplingParams(**self.generation_defaults)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")
        bad_bias = sorted(t for t in params.logit_bias or () if t >= self.vocab_size)
        if bad_bias:
            raise ValueError(f"logit_bias keys {bad_bias} are outside the vocabulary [0, {self.vocab_size})")
        outside = sorted({t for t in params.allowed_token_ids or () if t >= self.vocab_size})
        if outside:
            raise ValueError(f"allowed_token_ids {outside} are outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words_token_ids is not None:  # tokenized by the server's front end
            bad_words = params.bad_words_token_ids
            check_in_vocabulary(bad_words, self.vocab_size)
        else:
            bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else []
        banned = []  # what the first min_tokens tokens may not be
        if params.min_tokens:
            banned = sorted(set((self.eos_token_ids if not params.ignore_eos else []) + params.stop_token_ids))
        self._check_allowed_left(params, bad_words, banned)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(it must leave room for at least one generated token)"
            )
        need = self.block_manager.blocks_needed(len(ids) + 1)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"the prompt needs {need} KV cache blocks but the whole pool has {self.block_manager.num_blocks}"
            )
        grammar = None
        if params.structured_outputs is not None:  # last check: nothing is kept after it
            grammar = self.grammars.submit(request_id, params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:  # a cached failed compile
                del self.grammars.waiting[request_id]
                raise ValueError(f"structured_outputs.{params.structured_outputs.kind}: {grammar.exception()}")
        room = self.max_model_len - len(ids)  # the most tokens the context leaves
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                prompt_token_ids=ids,
                params=params,
                seed=None if params.seed is None else params.seed + i,
                min_tokens_banned_ids=banned,
                max_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
                bad_words_token_ids=bad_words,
                # the samples share their prompt: the first one scores it
                prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
            )
            for i in range(params.n)
        ]
        if any(len(word) > 1 for word in bad_words):
            self._bans_follow_output.update(seq.seq_id for seq in seqs)
        need_detok = (stream or params.stop_list) and self.tokenizer is not None and self.detokenize
        request = Request(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            seqs=seqs,
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if need_detok else None
                for _ in seqs
            ],
            stream=stream,
            delta=delta,
            sent_tokens=[0] * len(seqs),
            sent_text=[0] * len(seqs),
        )
        self.requests[request_id] = request
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
        if grammar is None:
            for seq in seqs:
                self.scheduler.add(seq)
        elif grammar.done():  # a cached grammar: admitted at once (other ready ones wait for step())
            del self.grammars.waiting[request_id]
            for seq in seqs:
                self.grammars.start(seq.seq_id, grammar.result())
                self.scheduler.add(seq)

    @staticmethod
    def _check_allowed_left(params: SamplingParams, bad_words: list[list[int]], min_tokens_banned: list[int]) -> None:
        """ValueError naming allowed_token_ids where the bans leave none of them to sample: each
        is a bad word of one token, or, for the first min_tokens tokens, one of
        min_tokens_banned (the stop tokens)."""
        if not params.allowed_token_ids:
            return
        banned = {word[0] for word in bad_words if len(word) == 1}
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError("allowed_token_ids: bad_words ban every one of them")
        if min_tokens_banned:
            banned.update(min_tokens_banned)
            if banned.issuperset(params.allowed_token_ids):
                raise ValueError(f"allowed_token_ids: every one of them is a stop token or a bad word, which the first "
                                 f"min_tokens={params.min_tokens} tokens may not be")

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """The token sequences that `bad_words` ban with this engine's tokenizer (nanovllm/bad_words.py)."""
        return bad_words_token_ids(self.tokenizer, bad_words, self.vocab_size)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar has compiled join the scheduler with one matcher per sample;
        one whose compile failed ends ("abort"). Returns the outputs of the ended ones."""
        outputs = []
        for request_id, compiled in self.grammars.compiled():
            request = self.requests.get(request_id)
            if request is None:
                continue
            if isinstance(compiled, BaseException):
                logger.error("request %r: its grammar failed to compile (%s); it is aborted", request_id, compiled)
                self._end_unscheduled(request, "abort")
                outputs.append(self._finish_request(request))
                continue
            for seq in request.seqs:
                self.grammars.start(seq.seq_id, compiled)
                self.scheduler.add(seq)
        return outputs

    @staticmethod
    def _end_unscheduled(request: Request, reason: str) -> None:
        """End a request whose sequences never reached the scheduler (waiting for a grammar)."""
        for seq in request.seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason

    def abort_request(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output (or None). With
        `index`, stop only that sample (finish reason "stop": a front-end matched a stop string
        in it); the output is returned only if that ended the request."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if self.grammars.waiting.pop(request_id, None) is not None:
            self._end_unscheduled(request, "abort" if index is None else "stop")
            return self._finish_request(request)
        if index is not None:
            if 0 <= index < len(request.seqs) and not request.seqs[index].is_finished:
                self.scheduler.finish(request.seqs[index], "stop")
            return self._finish_request(request) if request.finished else None
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        return self._finish_request(request)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight matters only while some request may get tokens from it.
        return (self.scheduler.has_unfinished() or bool(self.grammars.waiting)
                or (self._in_flight is not None and bool(self.requests)))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def load_snapshot(self) -> dict[str, int | float]:
        """Requests running and waiting, the KV pool, the prefix cache and the step counters,
        as the engine's stats (AsyncEngine's, the core process's) publish them."""
        sched, bm = self.scheduler, self.block_manager
        running = len({seq.request_id for seq in sched.running})
        return dict(
            num_requests_running=running,
            num_requests_waiting=max(0, self.num_unfinished_requests - running),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            device_wait_seconds=self.device_wait_seconds,
            num_prompt_steps=self.num_prompt_steps,
            prompt_step_seconds=self.prompt_step_seconds,
        )

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. With async scheduling, this launches step N and then processes the
        results of step N-1 (so outputs trail the device by one step)."""
        outputs = []
        if self.grammars.waiting and not self.scheduler.has_unfinished() and self._in_flight is None:
            self.grammars.wait(timeout=0.05)  # nothing else to do (idle: not counted in the step)
        t0 = time.perf_counter()
        if self.grammars.waiting:
            outputs += self._admit_compiled()
        deferred = self.async_scheduling and self.executor.defers_sampling
        if self._in_flight is not None and self._needs_in_flight(deferred):
            outputs += self._take_in_flight()
        sched = self.scheduler.schedule(self.executor.decode_burst)
        decode_tokens = sched.num_decode_tokens
        self.last_step = StepStats(sched.num_batched_tokens - decode_tokens, decode_tokens, 0.0)
        if not self.async_scheduling:
            complete, _ = self.grammars.refresh(sched)
            result = self.executor.execute(sched)
            self.scheduler.advance(sched, self.seqs)
            outputs += self._end_complete(complete)
            outputs += self._process(sched, result)
        elif deferred and not sched.is_empty and self.grammars.samples_constrained(sched):
            # The forward pass runs while the host takes the step in flight (checking the
            # tokens that sampled without their masks) and fills this step's masks from its
            # tokens; then the sampling is launched. Greedy rows sample without a mask; a row
            # whose token the grammar then refuses is rolled back (_check), and its token from
            # this step, whose input was the refused one, is void.
            forward = self.executor.launch_forward(sched)
            self.scheduler.advance(sched, self.seqs)
            taken, rolled_back = self._take_and_check_in_flight()
            outputs += taken
            void = {item.seq_id for item in sched.seqs if item.sample and item.seq_id in rolled_back}
            complete, unchecked = self.grammars.refresh(sched, check_after=True, skip=void)
            outputs += self._end_complete(complete)
            self._in_flight = InFlight(sched, forward.sample(), unchecked, void)
        else:
            complete, _ = self.grammars.refresh(sched)
            launched = self.executor.execute_async(sched)
            self.scheduler.advance(sched, self.seqs)
            outputs += self._end_complete(complete)
            outputs += self._take_in_flight()
            self._in_flight = InFlight(sched, launched)
            if sched.is_empty:  # nothing was launched: drain now instead of on the next call
                outputs += self._take_in_flight()
        self.last_step.seconds = time.perf_counter() - t0
        self.num_steps += 1
        self.step_seconds += self.last_step.seconds
        if self.last_step.num_prefill_tokens:
            self.num_prompt_steps += 1
            self.prompt_step_seconds += self.last_step.seconds
        return outputs

    def _needs_in_flight(self, deferred: bool) -> bool:
        """Whether the next step must be scheduled with the tokens of the step in flight on the
        host: a grammar's next mask needs its row's token (unless the sampling is deferred,
        which fills the masks after the forward is launched), and so do the bans of a bad word
        of several tokens (Sequence.bad_word_bans)."""
        sched = self._in_flight.sched
        if not deferred and self.grammars.samples_constrained(sched):
            return True
        follow = self._bans_follow_output
        return bool(follow) and any(item.sample and item.seq_id in follow for item in sched.seqs)

    def _take_in_flight(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and process its tokens (checked first)."""
        return self._take_and_check_in_flight()[0]

    def _take_and_check_in_flight(self) -> tuple[list[RequestOutput], set[int]]:
        """Wait for the step in flight, if any, check the tokens it sampled without their
        masks, and process its tokens. Returns the outputs and the sequences rolled back."""
        if self._in_flight is None:
            return [], set()
        step, self._in_flight = self._in_flight, None
        t = time.perf_counter()
        output = step.result.result()
        self.device_wait_seconds += time.perf_counter() - t
        rolled_back = self._check(step, output) if step.unchecked else set()
        return self._process(step.sched, output, step.void | rolled_back), rolled_back

    def _check(self, step: InFlight, output: RunnerOutput) -> set[int]:
        """Hand the tokens that step sampled without their masks to their grammars
        (Grammars.check), which advance by the tokens they allow. A refused token is dropped
        and its sequence rolled back by one more token (Scheduler.roll_back): its next step
        computes the token before the refused one again and samples under the mask. The token
        before has to be computed again because the step launched since may have read the
        refused token as its input. Returns the sequences rolled back."""
        rows = [item for item in step.sched.seqs if item.sample]
        unchecked = step.unchecked  # never a void row: refresh skipped those
        refused = self.grammars.check([rows[i] for i in unchecked], [output.token_ids[i] for i in unchecked])
        rolled_back = set()
        for j in refused:
            item = rows[unchecked[j]]
            seq = self.seqs.get(item.seq_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.roll_back(seq, item.start_pos + len(item.token_ids))
                rolled_back.add(seq.seq_id)
        return rolled_back

    def _end_complete(self, seq_ids: list[int]) -> list[RequestOutput]:
        """End the sequences whose grammar is complete and allows only a stop token next
        (Grammars.refresh), "stop"; a step's token for them is dropped."""
        outputs = []
        for seq_id in seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "stop")
            request = self.requests[seq.request_id]
            if request.detokenizers[0] is not None:
                request.detokenizers[request.seqs.index(seq)].flush()
            if request.finished:
                outputs.append(self._finish_request(request))
            elif request.stream:
                outputs.append(self._make_output(request))
        return outputs

    def _process(self, sched: SchedulerOutput, result: RunnerOutput, void: set[int] = frozenset()) -> list[RequestOutput]:
        """Resolve a finished step: tokens in (but those of the `void` sequences), stop rules,
        outputs for the requests it touched."""
        grew = self.scheduler.resolve(sched, self.seqs, result.token_ids, void)
        if result.prompt_logprobs:
            self._record_prompt_logprobs(result.prompt_logprobs)
        touched: dict[str, Request] = {}
        now = time.monotonic()
        sample_row = {item.seq_id: i for i, item in enumerate(s for s in sched.seqs if s.sample)} if result.logprobs else None
        for seq, index in grew:
            if seq.is_finished:
                continue  # a burst's tokens after its stop
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            if sample_row is not None:
                lp = result.logprobs[sample_row[seq.seq_id]]
                if lp is not None:
                    seq.add_logprobs(lp)
            self._check_stop(request, seq, index)
        for seq_id in sched.finished_seq_ids:  # finished inside schedule() (pool too small)
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.request_id in self.requests:
                touched[seq.request_id] = self.requests[seq.request_id]

        outputs = []
        for request in touched.values():
            if request.finished:
                outputs.append(self._finish_request(request))
            elif request.stream:
                outputs.append(self._make_output(request))
        return outputs

    def _record_prompt_logprobs(self, scored: dict) -> None:
        """A step's prompt logprobs (RunnerOutput.prompt_logprobs) onto their sequences."""
        for seq_id, (first, entries) in scored.items():
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.prompt_logprobs is not None:
                seq.add_prompt_logprobs(first, entries)

    def _check_stop(self, request: Request, seq: Sequence, index: int) -> None:
        params = request.params
        token = seq.token_ids[index]
        n = index + 1 - seq.num_prompt_tokens  # generated tokens up to and including this one
        reason = stop_reason = None
        stopped_by_string = False
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"
            stop_reason = stop_token_reason(token, params.ignore_eos, params.stop_token_ids, self.eos_token_ids)
        detok = request.detokenizers[request.seqs.index(seq)] if request.detokenizers[0] is not None else None
        if reason is None and self.grammars.matchers:
            restricted = params.restricts_tokens or (bool(seq.min_tokens_banned_ids) and n <= params.min_tokens)
            reason = self.grammars.accept(seq.seq_id, token, restricted)
            if reason in ("error", "abort"):  # the grammar refused the token: it is dropped
                self.scheduler.finish(seq, reason, num_tokens=index)
                if detok is not None:
                    detok.flush()
                return
        # A stop token's text is left out, unless include_stop_str_in_output (as vLLM's).
        if detok is not None and (reason is None or params.include_stop_str_in_output):
            detok.add(token)
            if params.stop_list:
                found = truncate_at_stop(detok, params.stop_list, n > params.min_tokens,
                                         params.include_stop_str_in_output)
                if found is not None:
                    reason, stop_reason = "stop", found
                    stopped_by_string = True
        if reason is None and n >= seq.max_tokens:
            reason = "length"
        if detok is not None and reason is not None and not stopped_by_string:
            detok.flush()
            found = None
            if params.stop_list:
                found = truncate_at_stop(detok, params.stop_list, n > params.min_tokens,
                                         params.include_stop_str_in_output)
            if found is not None:
                reason = "stop"
                if stop_reason is None:
                    stop_reason = found
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason, num_tokens=index + 1)

    def _text(self, request: Request, index: int, final: bool) -> str:
        seq, detok = request.seqs[index], request.detokenizers[index]
        if detok is not None:
            return streamable_text(detok, request.params.stop_list, final or seq.is_finished,
                                   request.params.include_stop_str_in_output)
        if self.tokenizer is None or not self.detokenize:  # the engine core's: token ids only
            return ""
        ids = text_token_ids(seq.completion_token_ids, seq.finish_reason, request.params.stop_token_ids,
                             self.eos_token_ids, request.params.include_stop_str_in_output)
        return decode_after(self.tokenizer, seq.prompt_token_ids, ids, request.params.skip_special_tokens)

    def _make_output(self, request: Request, final: bool = False) -> RequestOutput:
        completions = []
        delta, want_logprobs = request.delta, request.params.logprobs is not None
        for i, seq in enumerate(request.seqs):
            start = request.sent_tokens[i] if delta else 0
            token_ids = seq.completion_token_ids_from(start)
            text = self._text(request, i, final)
            if delta:
                request.sent_tokens[i] += len(token_ids)
                if text:
                    text, request.sent_text[i] = text[request.sent_text[i]:], len(text)
            logprobs = cumulative = None
            if want_logprobs:
                logprobs, cumulative = [], seq.cumulative_logprob
                for token, (lp, top) in zip(token_ids, seq.logprobs[start:]):
                    entry = dict(top)
                    entry[token] = lp
                    logprobs.append(entry)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=seq.finish_reason,
                    logprobs=logprobs,
                    cumulative_logprob=cumulative,
                    stop_reason=seq.stop_reason if seq.finish_reason == "stop" else None,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(request, final),
            outputs=completions,
            finished=final,
            num_cached_tokens=max([s.num_cached_tokens for s in request.seqs]),
            metrics={
                "arrival_time": request.arrival_time,
                "first_token_time": request.first_token_time,
                "finished_time": time.monotonic() if final else None,
            },
        )

    @staticmethod
    def _prompt_logprobs(request: Request, final: bool) -> list[dict[int, Logprob] | None] | None:
        """The request's RequestOutput.prompt_logprobs (those recorded so far); a delta output
        carries them once, in the first output where they are whole (or the last)."""
        recorded = request.seqs[0].prompt_logprobs
        if recorded is None:
            return None
        if request.delta:
            if request.sent_prompt_logprobs or (request.seqs[0].scores_prompt and not final):
                return None
            request.sent_prompt_logprobs = True
        ids = request.prompt_token_ids
        return [None] + [prompt_logprob_entry(ids[j], *entry) for j, entry in enumerate(recorded[1:], 1)]

    def _finish_request(self, request: Request) -> RequestOutput:
        output = self._make_output(request, final=True)
        del self.requests[request.request_id]
        for seq in request.seqs:
            self.seqs.pop(seq.seq_id, None)
        if self._bans_follow_output:
            self._bans_follow_output.difference_update(seq.seq_id for seq in request.seqs)
        self.grammars.drop(seq.seq_id for seq in request.seqs)
        return output

    def shutdown(self) -> None:
        """Stop the executor and the grammar threads; later requests are refused. Safe to repeat."""
        if self.closed:
            return
        self.closed = True
        self.grammars.shutdown()
        self.executor.shutdown()
