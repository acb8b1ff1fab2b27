"""The engine's structured-output state: requests waiting for their grammar, and one matcher
per constrained sequence.

A constrained request is checked when it is added (a ValueError naming the field), and its
grammar compiles in a thread pool (structured/compiler.py); until then its sequences stay out
of the scheduler, and other requests run. Once a sequence runs, every token the engine appends
advances its matcher (`accept`); before a step samples, `refresh` fills the masks of the step's
constrained rows in one call on several threads (xgrammar's BatchGrammarMatcher) into a table
of one row per sequence, and names the sequences whose grammar is complete and allows only a
stop token next (the engine ends them, "stop"). Preemption (recompute) keeps the output
tokens, so the matcher stays where it is.

On CUDA the table is in pinned memory: the runner copies it to the device without a host copy
first (structured/bitmask.py, BitmaskStaging). The copy runs later, on the device's stream;
that is safe because a row is refilled only once the tokens of the steps that read it have come
back (its matcher needs them), and those steps' copies ran before their sampling did.
"""
from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.step import SchedulerOutput

if TYPE_CHECKING:
    from nanovllm.structured.compiler import GrammarCompiler
    from nanovllm.structured.matcher import SequenceMatcher

logger = logging.getLogger("nanovllm")


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], pin_memory: bool = False) -> None:
        self._tokenizer = tokenizer
        self._pin_memory = pin_memory
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self._batch = None  # xgrammar's BatchGrammarMatcher, with the first matcher
        self.waiting: dict[str, Future] = {}  # request id -> its grammar's compile
        self.matchers: dict[int, SequenceMatcher] = {}  # seq id -> its matcher
        # The mask table: row self._rows[seq id] holds that sequence's next-token mask.
        self._masks: torch.Tensor | None = None
        self._rows: dict[int, int] = {}
        self._free_rows: list[int] = []

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> Future:
        """Check spec and start compiling it (ValueError naming the field; nothing is kept then)."""
        if self._compiler is None:  # xgrammar is imported only once a request has a grammar
            from nanovllm.structured.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
        future = self._compiler.submit(spec)
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

        matcher = SequenceMatcher(compiled, self._stop_token_ids)
        if not self._free_rows:
            self._grow(matcher)
        self.matchers[seq_id] = matcher
        self._rows[seq_id] = self._free_rows.pop()

    def _grow(self, matcher: SequenceMatcher) -> None:
        """Twice the rows (16 at first); the rows in use keep their place."""
        import xgrammar as xgr

        old = self._masks
        rows = 16 if old is None else 2 * old.shape[0]
        table = matcher.new_mask().expand(rows, -1).contiguous()
        if self._pin_memory:
            table = table.pin_memory()
        if old is None:
            self._batch = xgr.BatchGrammarMatcher()
        else:
            table[: old.shape[0]] = old
        self._free_rows.extend(range(rows - 1, (0 if old is None else old.shape[0]) - 1, -1))
        self._masks = table

    def samples_constrained(self, sched: SchedulerOutput) -> bool:
        """Whether a step samples some sequence with a grammar (whose next mask needs its token)."""
        return bool(self.matchers) and any(item.sample and item.seq_id in self.matchers for item in sched.seqs)

    def refresh(self, sched: SchedulerOutput) -> list[int]:
        """Fill the masks of the step's constrained sampling rows for their matchers' current
        state (every token before the step's accepted), attach them to the rows
        (ScheduledSeq.token_bitmask), and return the seq ids among them whose output is
        complete (SequenceMatcher.done): the caller ends those, and drops their rows' tokens."""
        if not self.matchers:
            return []
        items = [item for item in sched.seqs if item.sample and item.seq_id in self.matchers]
        live = [item.seq_id for item in items if not self.matchers[item.seq_id].terminated]
        if live:
            self._batch.batch_fill_next_token_bitmask([self.matchers[i].xgr_matcher for i in live], self._masks,
                                                      indices=[self._rows[i] for i in live])
        done = []
        for item in items:
            row = self._rows[item.seq_id]
            item.token_bitmask = self._masks[row : row + 1]
            if self.matchers[item.seq_id].done(item.token_bitmask):
                done.append(item.seq_id)
        return done

    def accept(self, seq_id: int, token: int) -> str | None:
        """Advance seq_id's matcher by token: "stop" when it was a stop token the grammar
        accepts, "abort" if the grammar refuses the token (never expected: the mask allowed
        it), None otherwise."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return None
        if not matcher.accept(token):
            logger.error("sequence %d sampled token %d that its grammar does not allow; it is aborted", seq_id, token)
            return "abort"
        return "stop" if matcher.terminated else None

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            if self.matchers.pop(seq_id, None) is not None:
                self._free_rows.append(self._rows.pop(seq_id))

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
