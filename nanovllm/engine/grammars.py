"""The engine's structured-output state: requests waiting for their grammar, and one matcher
per constrained sequence.

A constrained request is checked when it is added (a ValueError naming the field), and its
grammar compiles in a thread pool (structured/compiler.py); until then its sequences stay out
of the scheduler, and other requests run. Once a sequence runs, every token the engine appends
advances its matcher (`accept`); before a step samples, `refresh` fills the masks of the step's
constrained rows in one call on several threads (xgrammar's BatchGrammarMatcher) into a table
whose rows are the step's masked rows in turn, and names the sequences whose grammar is
complete and allows only a stop token next (the engine ends them, "stop"). Preemption
(recompute) keeps the output tokens, so the matcher stays where it is.

Checked after sampling: filling a mask costs tens of microseconds a row on a large vocabulary,
on the host, every step. A greedy row needs none when the grammar allows its argmax, which it
mostly does in free text. With `refresh(check_after=True)` such rows
(SamplingParams.takes_argmax) sample without a mask; `check` then advances their matchers by
their tokens before the engine appends them. A token the grammar refuses is dropped: the
engine rolls its sequence back and samples that position again under the mask (the masked
argmax), so the tokens are the ones masking first would give. Where the grammar is narrow (a
new output's opening, a key and its punctuation, a number) most unmasked tokens would be
refused, and each refusal costs the sequence two steps; so a sequence samples under its mask
first while it is new, until WIDE_MASKS_TO_UNMASK masks in a row have allowed at least
NARROW_FRACTION of the vocabulary. A refusal doubles the wide masks in a row that its sequence
needs before it samples unmasked again (up to MAX_WIDE_MASKS_TO_UNMASK): a model whose argmax
the grammar keeps refusing (a random one; a poor fit of model and schema) ends up masked
nearly always, and one whose argmax the grammar mostly allows is rarely masked.

On CUDA the table is in pinned memory: the runner copies its first rows, as many as the step
masks, to the device without a host copy first (structured/bitmask.py, BitmaskStaging). The
copy runs later, on the device's stream; that is safe because the table is refilled only once
the tokens of the step before have come back (the matchers need them), and that step's copy
ran before its sampling did.
"""
from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.step import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from nanovllm.structured.compiler import GrammarCompiler
    from nanovllm.structured.matcher import SequenceMatcher

logger = logging.getLogger("nanovllm")

# A mask that allows fewer than this fraction of the vocabulary marks a narrow stretch of the
# grammar; a sequence masked first samples unmasked again after this many wider masks in a row
# (refresh's check_after).
NARROW_FRACTION = 0.5
# The fraction is estimated from every NARROW_SAMPLE_STRIDE-th word of a mask (32 tokens each):
# a threshold this coarse needs no exact count.
NARROW_SAMPLE_STRIDE = 16
WIDE_MASKS_TO_UNMASK = 2
MAX_WIDE_MASKS_TO_UNMASK = 64
# Fewer masks than this are filled one by one: xgrammar's batch call hands rows to a thread
# pool, which costs more than a few rows' work (~0.4 ms a call on a 16-core host).
BATCH_FILL_MIN_ROWS = 16


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], pin_memory: bool = False,
                 check_in_pool: bool = False) -> None:
        self._tokenizer = tokenizer
        self._pin_memory = pin_memory
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._stop_token_set = frozenset(stop_token_ids)
        # Build each spec's grammar in the compile pool rather than in `submit` (the engine
        # core: its front-ends check specs first, and a slow build must not hold its loop).
        self.check_in_pool = check_in_pool
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self._batch = None  # xgrammar's BatchGrammarMatcher, with the first matcher
        self.waiting: dict[str, Future] = {}  # request id -> its grammar's compile
        self.matchers: dict[int, SequenceMatcher] = {}  # seq id -> its matcher
        # The mask table: row i holds the next-token mask of the step's i-th masked row.
        self._masks: torch.Tensor | None = None
        self._mask_words: np.ndarray | None = None  # the same table as uint32 words
        self._row_views: list[torch.Tensor] = []  # row i of the table, as [1, W]
        # seq id -> a token its matcher was advanced by in `check`, before the engine appends it.
        self._accepted_ahead: dict[int, int] = {}
        # Sequences whose next step samples under their mask even where it could be checked
        # after -> how many wide masks in a row they still need to leave (module docstring).
        self._mask_first: dict[int, int] = {}
        # seq id -> how many wide masks in a row it needs to leave masking (doubled by refusals).
        self._wide_to_unmask: dict[int, int] = {}

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> Future:
        """Check spec and start compiling it (ValueError naming the field; nothing is kept
        then); with check_in_pool, the check is the compile's (a failed compile ends the
        request: `compiled`)."""
        if self._compiler is None:  # xgrammar is imported only once a request has a grammar
            from nanovllm.structured.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
        future = self._compiler.submit(spec, check_in_pool=self.check_in_pool)
        self.waiting[request_id] = future
        return future

    def compiled(self) -> list[tuple[str, object]]:
        """(request id, CompiledGrammar or the exception its compile raised) for every waiting
        request whose grammar is ready; they stop waiting."""
        ready = [rid for rid, f in self.waiting.items() if f.done()]
        out = []
        for rid in ready:
            future = self.waiting.pop(rid)
            out.append((rid, future.exception() or future.result()))
        return out

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled, or timeout seconds."""
        concurrent.futures.wait(list(self.waiting.values()), timeout, concurrent.futures.FIRST_COMPLETED)

    def start(self, seq_id: int, compiled) -> None:
        from nanovllm.structured.matcher import SequenceMatcher

        self.matchers[seq_id] = SequenceMatcher(compiled, self._stop_token_ids)
        self._sample_masked_first(seq_id)

    def _reserve(self, rows: int, matcher: SequenceMatcher) -> None:
        """A table of at least `rows` rows (16 at first, then doubled as needed). Its content
        is not kept: every step fills the rows it uses."""
        import xgrammar as xgr

        old = self._masks
        if old is not None and old.shape[0] >= rows:
            return
        capacity = 16 if old is None else old.shape[0]
        while capacity < rows:
            capacity *= 2
        table = matcher.new_mask().expand(capacity, -1).contiguous()
        if self._pin_memory:
            table = table.pin_memory()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._masks = table
        self._mask_words = table.numpy().view(np.uint32)
        self._row_views = [table[i : i + 1] for i in range(capacity)]

    def samples_constrained(self, sched: SchedulerOutput) -> bool:
        """Whether a step samples some sequence with a grammar (whose next mask needs its token)."""
        return bool(self.matchers) and any(item.sample and item.seq_id in self.matchers for item in sched.seqs)

    def refresh(self, sched: SchedulerOutput, check_after: bool = False,
                skip: set[int] = frozenset()) -> tuple[list[int], list[int]]:
        """Fill the masks of the step's constrained sampling rows for their matchers' current
        state (every token before the step's accepted) and attach them to the rows
        (ScheduledSeq.token_bitmask); rows of the `skip` sequences (whose token the caller will
        drop) are left alone. Returns (done, unchecked): the seq ids among them whose output
        is complete (SequenceMatcher.done: the caller ends those, and drops their rows'
        tokens), and, with check_after, the indices among the step's sampling rows that were
        left without a mask (SamplingParams.takes_argmax): the caller passes their tokens to
        `check` before it appends them. (An unmasked row whose grammar has matched is ended
        by its stop token, which the check accepts, or, for any other token, by the refusal
        and the masked step after it, where `done` sees the match.)"""
        if not self.matchers:
            return [], []
        matchers, mask_first = self.matchers, self._mask_first
        unchecked, filled = [], []
        for i, item in enumerate(s for s in sched.seqs if s.sample):
            matcher = matchers.get(item.seq_id)
            if matcher is None or item.seq_id in skip:
                continue
            checkable = check_after and item.params.takes_argmax
            if checkable and item.seq_id not in mask_first:
                item.token_bitmask = None
                unchecked.append(i)
            else:
                filled.append((item, matcher, checkable))
        if not filled:
            return [], unchecked
        self._reserve(len(filled), filled[0][1])
        self._fill(filled)
        done, judged, judged_rows = [], [], []
        for row, (item, matcher, checkable) in enumerate(filled):
            item.token_bitmask = self._row_views[row]
            if matcher.done(item.token_bitmask):
                done.append(item.seq_id)
            elif checkable:
                judged.append(item.seq_id)
                judged_rows.append(row)
        for seq_id, narrow in zip(judged, self._narrow(judged_rows)):
            if narrow:
                self._sample_masked_first(seq_id)
            elif mask_first[seq_id] > 1:
                mask_first[seq_id] -= 1
            else:
                del mask_first[seq_id]
        return done, unchecked

    def _sample_masked_first(self, seq_id: int) -> None:
        """seq_id samples under its mask first until as many wide masks in a row as it needs."""
        needed = self._wide_to_unmask.get(seq_id, WIDE_MASKS_TO_UNMASK)
        if needed > 0:
            self._mask_first[seq_id] = needed

    def _narrow(self, rows: list[int]) -> list[bool]:
        """Whether each of these rows' masks allows under NARROW_FRACTION of the vocabulary."""
        if not rows:
            return []
        sample = self._mask_words[rows, ::NARROW_SAMPLE_STRIDE]
        allowed = np.bitwise_count(sample).sum(axis=1, dtype=np.int64) * NARROW_SAMPLE_STRIDE
        return (allowed < NARROW_FRACTION * self._vocab_size).tolist()

    def _fill(self, filled: list[tuple[ScheduledSeq, SequenceMatcher, bool]]) -> None:
        """The masks of the `filled` rows' matchers into rows 0, 1, ... of the table (one
        multi-threaded xgrammar call for many, one call each for a few). A terminated matcher
        (its sequence ends at this step, its token dropped) allows every token."""
        live = []
        for row, (_, matcher, _) in enumerate(filled):
            if matcher.terminated:
                self._masks[row].fill_(-1)
            else:
                live.append((row, matcher.xgr_matcher))
        if len(live) >= BATCH_FILL_MIN_ROWS:
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], self._masks, indices=[r for r, _ in live])
            return
        for row, xgr_matcher in live:
            xgr_matcher.fill_next_token_bitmask(self._masks, row)

    def check(self, rows: list[ScheduledSeq], tokens: list[int]) -> list[int]:
        """Advance the matchers of rows sampled without a mask (refresh's unchecked) by their
        tokens. Returns the indices (into rows) of the tokens their grammar refuses: those
        matchers stay where they were, and their sequences sample under their masks next
        (the caller drops the refused tokens). The accepted tokens are remembered, so that
        `accept` does not advance by them twice. Rows whose request ended meanwhile are
        skipped."""
        # One call per matcher, on the loop's thread: xgrammar's batch_accept_token takes longer
        # than these calls at 16 and 64 rows. Each call releases the GIL, but the same calls
        # handed to a thread while the loop launches the next forward pass took longer in all
        # than doing both in turn (the two threads trade the GIL at every torch call).
        refused = []
        for j, item in enumerate(rows):
            matcher = self.matchers.get(item.seq_id)
            if matcher is None:
                continue
            if matcher.xgr_matcher.accept_token(tokens[j]):
                self._accepted_ahead[item.seq_id] = tokens[j]
            else:
                refused.append(j)
                # At least one: unmasked, its next step would sample the refused token again.
                needed = self._wide_to_unmask.get(item.seq_id, WIDE_MASKS_TO_UNMASK)
                self._wide_to_unmask[item.seq_id] = min(max(2 * needed, 1), MAX_WIDE_MASKS_TO_UNMASK)
                self._sample_masked_first(item.seq_id)
        return refused

    def accept(self, seq_id: int, token: int, restricted: bool = False) -> str | None:
        """Advance seq_id's matcher by token (unless `check` did already): "stop" when it was a
        stop token the grammar accepts; "error" if the grammar refuses the token because no
        token was left to sample: the grammar allows none here (it matches no complete
        output), or, where the row was `restricted` (allowed_token_ids, bad_words, a min_tokens
        ban), none of those it allows; "abort" if it refuses it otherwise (never expected: the
        mask allowed it, or the check did); None otherwise. The caller drops a refused token."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return None
        ahead = self._accepted_ahead.pop(seq_id, None)
        if ahead is not None and ahead != token:
            logger.error("sequence %d: token %d appended where its grammar took %d; it is aborted", seq_id, token, ahead)
            return "abort"
        if ahead is None and not matcher.accept(token):
            if restricted or matcher.allows_nothing():
                return "error"
            logger.error("sequence %d sampled token %d that its grammar does not allow; it is aborted", seq_id, token)
            return "abort"
        # A matcher terminates only by taking a stop token.
        return "stop" if token in self._stop_token_set and matcher.terminated else None

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._accepted_ahead.pop(seq_id, None)
            self._mask_first.pop(seq_id, None)
            self._wide_to_unmask.pop(seq_id, None)
            self.matchers.pop(seq_id, None)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
