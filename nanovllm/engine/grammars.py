"""The engine's structured-output state: requests waiting for their grammar, and one matcher
per constrained sequence.

A constrained request is checked when it is added (a ValueError naming the field), and its
grammar compiles in a thread pool (structured/compiler.py); until then its sequences stay out
of the scheduler, and other requests run. Once a sequence runs, its matcher gives the
bitmask of each step's sampling row and is advanced by every token the engine appends; the
sequence ends ("stop") when the grammar is complete and allows only a stop token. Preemption
(recompute) keeps the output tokens, so the matcher stays where it is.
"""
from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.step import SchedulerOutput

if TYPE_CHECKING:
    from nanovllm.structured.compiler import GrammarCompiler
    from nanovllm.structured.matcher import SequenceMatcher

logger = logging.getLogger("nanovllm")


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.waiting: dict[str, Future] = {}  # request id -> its grammar's compile
        self.matchers: dict[int, SequenceMatcher] = {}  # seq id -> its matcher

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

        self.matchers[seq_id] = SequenceMatcher(compiled, self._stop_token_ids)

    def samples_constrained(self, sched: SchedulerOutput) -> bool:
        """Whether a step samples some sequence with a grammar (whose next mask needs its token)."""
        return bool(self.matchers) and any(item.sample and item.seq_id in self.matchers for item in sched.seqs)

    def attach_masks(self, sched: SchedulerOutput) -> None:
        """Give each constrained sampling row of the step its sequence's current bitmask."""
        if not self.matchers:
            return
        for item in sched.seqs:
            matcher = self.matchers.get(item.seq_id)
            if item.sample and matcher is not None:
                item.token_bitmask = matcher.bitmask

    def accept(self, seq_id: int, token: int) -> str | None:
        """Advance seq_id's matcher by token: "stop" when the output is complete, "abort" if the
        grammar refuses the token (never expected: the mask allowed it), None otherwise."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return None
        if not matcher.accept(token):
            logger.error("sequence %d sampled token %d that its grammar does not allow; it is aborted", seq_id, token)
            return "abort"
        return "stop" if matcher.done else None

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
