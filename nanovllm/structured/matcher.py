"""One sequence's place in its grammar: advanced token by token; the mask of the tokens it
allows next is filled into a row the caller owns (the engine fills a whole batch's rows at
once, engine/grammars.py)."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr


class SequenceMatcher:
    """Wraps an xgrammar GrammarMatcher. `fill(mask)` writes the mask of the tokens allowed
    next (int32 [1, ceil(vocab / 32)] on the host, bit t set = token t allowed); `done(mask)`
    reads it, so call it after a fill for the current state."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self.xgr_matcher = xgr.GrammarMatcher(compiled)
        self._stop_token_ids = frozenset(stop_token_ids)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def new_mask(self) -> torch.Tensor:
        """A mask row of this grammar's width (all tokens allowed)."""
        return xgr.allocate_token_bitmask(1, self.vocab_size)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is unchanged)."""
        return self.xgr_matcher.accept_token(token)

    def fill(self, mask: torch.Tensor) -> None:
        """The tokens allowed next into `mask` (left as it is once the output is terminated)."""
        if not self.xgr_matcher.is_terminated():
            self.xgr_matcher.fill_next_token_bitmask(mask)

    def allows_nothing(self) -> bool:
        """No token may come next, not even a stop token: the grammar matches no complete
        output from here (e.g. `root ::= root`, or a pattern no string matches)."""
        if self.xgr_matcher.is_terminated():
            return False
        mask = self.new_mask()
        self.xgr_matcher.fill_next_token_bitmask(mask)
        return not bool(mask.any())

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self.xgr_matcher.is_terminated()

    def done(self, mask: torch.Tensor) -> bool:
        """The output is complete: a stop token was accepted, or the grammar has matched and
        `mask` (filled for this state) allows nothing but a stop token next."""
        if self.xgr_matcher.is_terminated():
            return True
        if not self.xgr_matcher.is_completed():
            return False
        return set(allowed_token_ids(mask).tolist()) <= self._stop_token_ids


def allowed_token_ids(mask: torch.Tensor) -> torch.Tensor:
    """The ids a mask row allows (for the engine's completion check, tests and debugging)."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(np.flatnonzero(bits))
