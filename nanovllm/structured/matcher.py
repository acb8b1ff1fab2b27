"""One sequence's place in its grammar: advanced token by token, with the next token mask."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr


class SequenceMatcher:
    """Wraps an xgrammar GrammarMatcher. After every accepted token the mask of the tokens
    allowed next is filled at once (`bitmask`, int32 [1, ceil(vocab / 32)] on the host), so the
    engine can end the sequence when only a stop token is left, and the next step's sampling
    reads the mask without another pass."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_token_ids = frozenset(stop_token_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self._matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is unchanged)."""
        if not self._matcher.accept_token(token):
            return False
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(self.bitmask)
        return True

    @property
    def done(self) -> bool:
        """The output is complete: a stop token was accepted, or the grammar has matched and
        allows nothing but a stop token next."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        allowed = np.flatnonzero(np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little"))
        return set(allowed.tolist()) <= self._stop_token_ids

    def allowed_token_ids(self) -> torch.Tensor:
        """The ids the mask allows now (for tests and debugging)."""
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits))
