"""What a launched step gives back: `StepResult.result()` waits for its sampled ids. A leaf that
the runner, the fast path and the executors share.

Every way of running a step (the runner's own, and the fast path's: nanovllm/fastpath/) returns
an object with that one method, so the engine can launch the next step before it waits for
this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nanovllm.step import PromptLogprob


@dataclass
class RunnerOutput:
    token_ids: list[int]  # one per sampling row, in scheduler order (a burst's row: its steps' ids)
    # Per sampling row: None, or (sampled logprob, {token_id: logprob} of the top k).
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # seq id -> (prompt index of its first entry, one PromptLogprob per prompt token this step
    # scored: ScheduledSeq.prompt_logprob_ids), for the rows that asked (prompt_logprobs).
    prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]] | None = None


class StepResult(Protocol):
    def result(self) -> RunnerOutput: ...


class ReadbackSlots:
    """Pinned host buffers that launched steps' sampled ids are copied into, reused round-robin
    (allocating pinned memory for every step costs the host more than the step's copy).

    A slot is taken again `slots` steps later. The engine reads each step's ids before it
    launches the step after next, so by then its previous ids were read; a PendingOutput read
    after its slot was taken again raises instead of returning another step's ids."""

    def __init__(self, slots: int = 4) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._owners: list[object | None] = [None] * slots
        self._next = 0

    def take(self, like: torch.Tensor, owner: object) -> tuple[torch.Tensor, int]:
        """(a pinned host tensor of like's shape and dtype, its slot), the slot now owner's."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        buf = self._buffers[i]
        if buf is None or buf.dtype != like.dtype or buf.numel() < like.numel():
            size = max(like.numel(), 2 * (0 if buf is None else buf.numel()), 256)
            with torch.inference_mode(False):  # written later outside inference mode too
                buf = self._buffers[i] = torch.empty(size, dtype=like.dtype, pin_memory=True)
        self._owners[i] = owner
        return buf[: like.numel()].view(like.shape), i

    def owned_by(self, slot: int, owner: object) -> bool:
        return self._owners[slot] is owner


class PendingOutput:
    """The sampled ids of a launched step, on their way to the host.

    The device-to-host copy is queued behind the step's kernels into pinned memory (the ids
    into one of `readback`'s slots) and marked with an event, so the host can launch the next
    step before it waits for this one. readback None: the tensors are on the host already (CPU).
    """

    def __init__(self, rows, sampled, readback: ReadbackSlots | None,
                 prompt_logprobs: ScoredPrompts | None = None) -> None:
        self.rows = rows
        self.prompt_logprobs = prompt_logprobs
        self.has_logprobs = sampled.sampled_logprobs is not None
        tensors = [sampled.token_ids]
        if self.has_logprobs:
            tensors += [sampled.sampled_logprobs, sampled.top_token_ids, sampled.top_logprobs]
        self.event = None
        self._readback = readback
        if readback is not None:
            ids, self._slot = readback.take(sampled.token_ids, self)
            self.host = [ids.copy_(sampled.token_ids, non_blocking=True)]
            self.host += [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors[1:]]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def result(self) -> RunnerOutput:
        if self.event is not None:
            self.event.synchronize()
            if not self._readback.owned_by(self._slot, self):
                raise RuntimeError("a step's sampled ids were read after their readback slot was reused")
        token_ids = self.host[0].tolist()
        prompt_logprobs = self.prompt_logprobs.result() if self.prompt_logprobs is not None else None
        if not self.has_logprobs:
            return RunnerOutput(token_ids, prompt_logprobs=prompt_logprobs)
        sampled_lp = self.host[1].tolist()
        top_ids = self.host[2].tolist() if self.host[2] is not None else None
        top_lp = self.host[3].tolist() if self.host[3] is not None else None
        logprobs: list = []
        for i, s in enumerate(self.rows):
            k = s.params.logprobs
            if k is None:
                logprobs.append(None)
                continue
            top = dict(zip(top_ids[i][:k], top_lp[i][:k])) if (k and top_ids is not None) else {}
            logprobs.append((sampled_lp[i], top))
        return RunnerOutput(token_ids, logprobs, prompt_logprobs)


class ScoredPrompts:
    """The prompt logprobs a step computed (ModelRunner._score_prompts), on the device until
    `result()`: per asking row (seq id, prompt index of its first entry, how many entries, its
    k), and for all their entries together the prompt token's logprob [R] and rank [R] and the
    top k ids and logprobs [R, k] (k the step's largest; each row keeps its own k)."""

    def __init__(self, rows: list[tuple[int, int, int, int]], token_logprobs: torch.Tensor, ranks: torch.Tensor,
                 top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        self.rows = rows
        self.tensors = (token_logprobs, ranks, top_ids, top_logprobs)

    def result(self) -> dict[int, tuple[int, list[PromptLogprob]]]:
        token_lps, ranks, top_ids, top_lps = (t.tolist() for t in self.tensors)
        scored, at = {}, 0
        for seq_id, first, count, k in self.rows:
            scored[seq_id] = (first, [(token_lps[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k])))
                                      for i in range(at, at + count)])
            at += count
        return scored


def launched(rows, sampled, readback: ReadbackSlots | None, prompt_logprobs: ScoredPrompts | None) -> StepResult:
    """The result of a launched step: its sampled ids on their way to the host (sampled None:
    nothing sampled) and the prompt logprobs it computed, if any."""
    if sampled is not None:
        return PendingOutput(rows, sampled, readback, prompt_logprobs)
    return Done(RunnerOutput([], prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs.result()))


class Done:
    """A step result that is already complete (nothing sampled, or a non-zero rank)."""

    def __init__(self, output: RunnerOutput) -> None:
        self.output = output

    def result(self) -> RunnerOutput:
        return self.output
