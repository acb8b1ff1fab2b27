"""The scheduler's waiting queue: preempted sequences first, then round-robin across requests.

Strict FIFO let one request starve the others: a request of n=128 samples (or a server request
of many prompts, one engine request each) queued all its sequences ahead of a later 2-token
request, which then waited for every one of them to be admitted. Here each request keeps its
own FIFO of sequences, and admission takes one sequence from each waiting request in turn
(in order of first arrival; a request goes to the back of the line after each admission). So a
new request waits for at most one admission per request ahead of it, however many sequences
those hold. Preempted sequences were running already; they come back first, most recently
preempted first, as before.

The interface is the part of `collections.deque` the scheduler uses: `q[0]` is the next
sequence to admit and `popleft()` admits it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from nanovllm.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._preempted: deque[Sequence] = deque()
        self._by_request: dict[str, deque[Sequence]] = {}  # insertion order = round-robin order
        self._len = 0

    def append(self, seq: Sequence) -> None:
        """A new sequence: at the back of its request's line."""
        self._by_request.setdefault(seq.request_id, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: admitted before any new one."""
        self._preempted.appendleft(seq)
        self._len += 1

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("only the next sequence to admit (index 0) can be looked up")
        if self._preempted:
            return self._preempted[0]
        for line in self._by_request.values():
            return line[0]
        raise IndexError("the waiting queue is empty")

    def popleft(self) -> Sequence:
        """Take the next sequence; its request moves to the back of the round-robin order."""
        if self._preempted:
            self._len -= 1
            return self._preempted.popleft()
        if not self._by_request:
            raise IndexError("the waiting queue is empty")
        request_id = next(iter(self._by_request))
        line = self._by_request.pop(request_id)
        seq = line.popleft()
        if line:
            self._by_request[request_id] = line  # re-inserted: now last in turn
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        line = self._by_request.get(seq.request_id)
        if line is not None and seq in line:
            line.remove(seq)
            if not line:
                del self._by_request[seq.request_id]
        else:
            self._preempted.remove(seq)  # ValueError if it is not waiting at all, as deque's
        self._len -= 1

    def clear(self) -> None:
        self._preempted.clear()
        self._by_request.clear()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        yield from self._preempted
        for line in self._by_request.values():
            yield from line
