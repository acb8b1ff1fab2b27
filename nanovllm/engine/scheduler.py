"""Continuous batching under one token-budget rule. Pure Python.

Each step, running sequences (oldest first) and then waiting ones are given tokens so that
their `num_computed_tokens` catch up with `num_tokens`, within `max_num_batched_tokens` tokens
and `max_num_seqs` running sequences. A decode is just a sequence one token behind; a long
prompt is chunked by the budget; a prefix-cache hit starts a sequence partly computed. When the
block pool runs dry, the most recently admitted running sequence is preempted: its blocks are
freed and it goes back to the front of the waiting queue to be recomputed (its prefix blocks
usually survive in the prefix cache). No waiting sequence is admitted in a step that preempted.
Waiting sequences are admitted preempted ones first, then round-robin across requests
(engine/waiting_queue.py), so that one request of many sequences cannot starve a small one.

The output is plain data (`SchedulerOutput`) with decodes first, which is all the model runner
(or a tensor-parallel worker) needs for one step. Decodes are listed longest context first: the
attention kernels start programs in batch order, and long ones started first leave short ones,
not a long one alone, to finish a launch.

Async scheduling: after a step is launched, `advance` counts its tokens as computed and gives
each sampling sequence a PLACEHOLDER_TOKEN, so the next step can be scheduled (its decode input
is gathered on the device) before the sampled ids reach the host; `resolve` later writes the
real ids in. A synchronous engine calls both back to back.

Multi-step decode (`schedule(decode_burst=K)`): a sequence decoding alone, without a grammar,
banned ids, allowed_token_ids, bad_words or logprobs, with nothing waiting, is given K decode
steps at once (`ScheduledSeq.num_steps`; fewer near its max_tokens: `step.burst_sizes`), which
the runner runs back to back on the device, each step's token feeding the next. Its blocks are allocated for
the K positions up front; the K tokens come back together, and the engine drops those after a
stop (`finish(..., num_tokens=)`). Why: a lone stream's step is short, and the host-device round
trip between steps (input copy, launch, output copy) is a real share of it; a burst pays that
once per K tokens.
"""
from __future__ import annotations

from operator import attrgetter

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from nanovllm.engine.waiting_queue import WaitingQueue
from nanovllm.step import ScheduledSeq, SchedulerOutput, burst_sizes


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()  # admission order: preempted first, then round-robin by request
        self.running: list[Sequence] = []
        self._finished_since_last_step: list[int] = []
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, num_tokens: int | None = None) -> None:
        """End `seq` (stop rule, length, abort): free its blocks and drop it from the queues.
        num_tokens: the sequence ends there (a burst's tokens after its stop are dropped)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if num_tokens is not None:
            seq.truncate(num_tokens)
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            seq.token_ids.pop()  # a token of a step launched after the end: discarded
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_since_last_step.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ------------------------------------------------------------------------
    @staticmethod
    def _banned_ids(seq: Sequence) -> list[int] | None:
        """The ids seq may not sample next (its stop ids until min_tokens are out, the tokens that
        would complete a bad word: Sequence.bad_word_bans), or None."""
        banned = []
        if seq.min_tokens_banned_ids and seq.num_completion_tokens < seq.params.min_tokens:
            banned = seq.min_tokens_banned_ids
        if seq.bad_words_token_ids:
            banned = banned + seq.bad_word_bans()
        return banned or None

    @staticmethod
    def _bans_every_allowed(seq: Sequence, banned: list[int]) -> bool:
        """Whether this step's bans cover all of seq's allowed_token_ids: bad words of several
        tokens can, once the output ends with their other tokens (a request whose single-token
        bans alone cover them is refused when it is added: LLMEngine._check_allowed_left)."""
        allowed = seq.params.allowed_token_ids
        if allowed is None:
            return False
        banned = set(banned)
        return all(token in banned for token in allowed)

    def _burst_steps(self, decode_burst: int) -> int:
        """How many steps the lone running sequence may decode at once where it decodes alone
        (nothing waiting) and needs no grammar, banned ids, allowed_token_ids, bad_words or
        logprobs (any temperature, filter, seed, penalty or logit bias): the longest of
        burst_sizes that it has room for under max_tokens; 1 otherwise."""
        if decode_burst <= 1 or self.waiting or len(self.running) != 1:
            return 1
        seq = self.running[0]
        p = seq.params
        eligible = (
            seq.num_tokens - seq.num_computed_tokens == 1
            and p.structured_outputs is None and p.logprobs is None and not p.restricts_tokens
            and decode_burst <= self.max_num_batched_tokens
            and self._banned_ids(seq) is None
        )
        room = seq.max_tokens - seq.num_completion_tokens
        return next((k for k in burst_sizes(decode_burst) if k <= room), 1) if eligible else 1

    def schedule(self, decode_burst: int = 1) -> SchedulerOutput:
        """The next step. decode_burst > 1: the runner can run that many decode steps of a lone
        sequence at once (see the module docstring)."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        burst = self._burst_steps(decode_burst)
        if burst > 1:
            seq = self.running[0]
            if bm.allocate(seq, burst):
                return self._output([(seq, 1)], burst, self.max_num_batched_tokens - burst)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_completion_tokens >= seq.max_tokens:
                i += 1  # its last token is still in flight; it finishes when that arrives
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, num_new):
                if len(self.running) == 1:
                    # Alone and still out of blocks: this sequence can never grow here. Tokens
                    # of a step still in flight (a burst's: several) are its last: it finishes
                    # once they are in, at the next step.
                    if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                        i += 1
                    else:
                        self.finish(seq, "length")
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chosen.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            # seq was preempted or finished (it left self.running, index i is the next one), or waits
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits = bm.find_cached_prefix(seq) if seq.num_computed_tokens == 0 and not seq.scores_prompt else []
                num_computed = len(hits) * bm.block_size if hits else seq.num_computed_tokens
                num_new = min(seq.num_tokens - num_computed, budget)
                if not bm.allocate(seq, num_new, hits):
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                chosen.append((seq, num_new))
                budget -= num_new

        return self._output(chosen, 1, budget)

    def _output(self, chosen: list[tuple[Sequence, int]], num_steps: int, budget: int) -> SchedulerOutput:
        decodes, prefills = [], []
        for seq, num_new in chosen:
            start = seq.num_computed_tokens
            sample = start + num_new == seq.num_tokens
            banned = self._banned_ids(seq) if sample else None
            if banned and self._bans_every_allowed(seq, banned):
                self.finish(seq, "error")  # nothing is left to sample: not a step on logits all -inf
                budget += num_new
                continue
            item = ScheduledSeq(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids[start : start + num_new],
                start_pos=start,
                block_table=seq.block_table,
                sample=sample,
                params=seq.params,
                seed=seq.seed,
                banned_token_ids=banned,
                num_steps=num_steps,
                # The runner starts its token counts at the first sample and keeps them after.
                penalty_prompt_ids=seq.prompt_token_ids
                if sample and seq.params.penalized and seq.num_completion_tokens == 0 else None,
            )
            if seq.scores_prompt:
                item.prompt_logprobs_from, item.prompt_logprob_ids = self._prompt_tokens_scored(seq, start, num_new)
            (decodes if num_new == 1 else prefills).append(item)
        decodes.sort(key=attrgetter("start_pos"), reverse=True)  # stable: ties keep their order
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            seqs=decodes + prefills,
            num_decodes=len(decodes),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            finished_seq_ids=finished,
        )

    @staticmethod
    def _prompt_tokens_scored(seq: Sequence, start: int, num_new: int) -> tuple[int, list[int] | None]:
        """(first prompt index, the prompt tokens) whose logprobs a step computing seq's tokens
        start .. start + num_new - 1 gives: the token after each of them, where it is a prompt
        token not recorded yet; None where there is none."""
        first = max(len(seq.prompt_logprobs), start + 1)
        end = min(start + num_new + 1, seq.num_prompt_tokens)
        return first, (seq.prompt_token_ids[first:end] if first < end else None)

    def advance(self, output: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """The step was launched: count its tokens as computed, and give every sampling
        sequence a placeholder for the token it will receive."""
        for item in output.seqs:
            seq = seqs[item.seq_id]
            seq.num_computed_tokens += len(item.token_ids) + item.num_steps - 1
            if item.sample:
                seq.token_ids.extend([PLACEHOLDER_TOKEN] * item.num_steps)

    def roll_back(self, seq: Sequence, num_tokens: int) -> None:
        """Drop seq's tokens from index num_tokens on (a sampled token that turned out wrong, and
        the placeholders of steps launched after it) and count the last token kept as not
        computed, so that seq's next step feeds it again and samples in place of the dropped
        one. Steps in flight for the dropped tokens must not be resolved for seq."""
        seq.truncate(num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens - 1)

    def resolve(self, output: SchedulerOutput, seqs: dict[int, Sequence], sampled: list[int],
                void: set[int] = frozenset()) -> list[tuple[Sequence, int]]:
        """Write the step's sampled ids over their placeholders (in order of the sampling rows; a
        burst's row has its num_steps ids in a row) and register newly full blocks in the prefix
        cache. Returns (sequence, index of a new token) for every new token of every live
        sequence, in order; sequences finished meanwhile, and the `void` ones (rolled back
        since the step was launched: roll_back), are skipped."""
        grew: list[tuple[Sequence, int]] = []
        next_id = 0  # sampled[next_id] is the next sampling row's first id
        for item in output.seqs:
            num = item.num_steps if item.sample else 0
            first_id, next_id = next_id, next_id + num
            seq = seqs.get(item.seq_id)
            if seq is None or seq.is_finished or item.seq_id in void:
                continue
            first = item.start_pos + len(item.token_ids)
            for j in range(num):
                seq.token_ids[first + j] = sampled[first_id + j]
                grew.append((seq, first + j))
            self.block_manager.cache_full_blocks(seq)
        return grew
